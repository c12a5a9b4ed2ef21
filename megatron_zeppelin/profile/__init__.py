"""Measured costs: profile this machine into a calibration file, and check the cost model.

* ``kernels``: attention forward/backward time of the engine's kernels over a grid of shapes;
* ``linear``: one layer's GEMMs (QKV, projection, MLP) forward/backward at several token counts;
* ``links``: point-to-point and all-to-all bandwidth and latency, in a node and per rail across
  nodes (needs a distributed world: torchrun, or gloo processes emulating nodes);
* ``runner``: ``profile(...)`` runs the pieces, fits the cost model's curves and writes the file;
* ``validate``: runs planned batches with the engine and compares with the simulator.

The command-line entry points are ``zeppelin profile`` and ``zeppelin validate-cost-model``.
"""
