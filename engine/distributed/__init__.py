"""Tensor and pipeline parallelism (``tensor_parallel_size`` / ``pipeline_parallel_size`` > 1):
one process per rank over torch.distributed (gloo on CPU, NCCL on CUDA), on one host or
several (``nnodes``). Rank 0 is the engine's own ModelRunner: it drives the scheduler and
sends each step plan to the other ranks (``engine/tp_worker.py``), which run the same forward on
their shard (``shard.py``) of their stage's layers (``pipeline.py``, which also carries
activations from stage to stage); ``group.py`` is the communication, ``step_message.py`` the
plan on the wire, ``launcher.py`` starts and watches the ranks."""
