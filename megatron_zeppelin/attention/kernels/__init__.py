"""The varlen attention kernels the ring calls, one adapter each, behind one interface.

``kernel_api`` (the interface: ``VarlenBatch``, what a kernel takes and returns), the adapters
(``kernel_torch``, ``kernel_aten``, ``kernel_cudnn``, ``kernel_fa_switch``, ``kernel_flash``,
``kernel_te``) and ``kernels``, the registry that names them and picks one (``auto``).

Imports ``attention.merge`` for the partial results it merges; nothing else of ``attention/``.
"""
