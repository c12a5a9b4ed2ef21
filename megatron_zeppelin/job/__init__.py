"""The training job without Megatron's loop: ``zeppelin train`` (``train_cpu``, its checkpoints
``job_checkpoint``, its synthetic datasets ``synthetic``) and ``zeppelin check`` (``check``:
distributed training against one process).

Runs Megatron's model with the same pieces the hooks use (``megatron/``) and starts its ranks
through ``launch/``.
"""
