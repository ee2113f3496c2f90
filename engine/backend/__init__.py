"""Where and how training runs: the Runtime and TrainEngine interface with its plain-torch and
DeepSpeed ZeRO implementations, collectives, the distributed launcher, GPU placement, the
optimizer and its world-size-independent state on disk.

Owns: runtime, deepspeed_runtime, deepspeed_import, factory (make_runtime), dist, launch, placement,
optim, optim_state, cpu_memory, supervise.
May import: engine.data, engine.storage, engine.models, engine.config and below.
"""
