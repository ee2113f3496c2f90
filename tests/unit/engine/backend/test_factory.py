"""make_runtime (rlflow.engine.backend.factory): the torch runtime for engine.backend torch, and on a
CPU the heap keeps freed memory from then on."""

import torch

from rlflow.engine.backend import cpu_memory
from rlflow.engine.backend.factory import make_runtime
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.config.execution import EngineConfig


def test_the_torch_backend_gets_the_plain_torch_runtime_with_its_config():
    cfg = EngineConfig(backend="torch", micro_batch_size=2)
    runtime = make_runtime(cfg)
    assert type(runtime) is Runtime and runtime.name == "torch"
    assert runtime.cfg is cfg
    assert runtime.micro_batches([5, 5, 5]) == [[0, 1], [2]]  # the config it was given cuts the batches


def test_a_cpu_process_keeps_freed_memory_once_a_runtime_is_made(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_applied", None)  # as in a fresh process
    make_runtime(EngineConfig())
    # on a CPU make_runtime has decided it (True or False by platform); on a GPU it is left alone
    assert (cpu_memory._applied is not None) is (not torch.cuda.is_available())
