"""The oracle, shipped so that ``zeppelin verify`` and ``zeppelin check`` can run it: dense
float64 reference attention (``reference``), the tolerances results are held to
(``tolerances``) and one kernel against the reference (``kernel_check``).

Nothing outside ``testing/`` and ``tests/`` imports it except those commands and the kernel
benchmark (``tests/test_layout.py``).
"""
