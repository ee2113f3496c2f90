"""rlflow's weight-transfer engines for vLLM, registered through vLLM's own factory.

vLLM 0.32 moves trainer weights into a replica through `WeightTransferEngine`s chosen by
`--weight-transfer-config '{"backend": ...}'`; its built-in ones (nccl, ipc) need a GPU. These serve
the CPU, and any replica that shares a host with its trainer:

- `rlflow_shm`: the trainer packs each bucket (engine/rollout/weight_sync.py) into an anonymous
  memfd it owns; `/init_weight_transfer_engine` names it (`/proc/<pid>/fd/<fd>`, readable only by
  the trainer's user), and each `/update_weights` carries only the bucket's layout as JSON. The
  replica maps the memfd once and hands zero-copy views to `model.load_weights`, which maps HF names
  onto vLLM's fused layers (qkv_proj, gate_up_proj) and converts the dtype. The first
  REPORT_BYTES of the memfd are the replica's report to the trainer (engine/rollout/staging.py):
  its weight dtype once initialised, and after each update the fingerprint of what it loaded
  (per-tensor digests rounded to that dtype), which the trainer compares with its own. vLLM's
  `weight_checker` cannot serve here: on the CPU its checksums of the repacked linear layers hash
  empty tensors, so they would not see a skipped update of those layers.

Every update runs vLLM's layerwise-reload lifecycle (as its NCCL engine does): a backend that repacks
weights after loading (the CPU's linear kernels do) repacks the new ones in `finish_weight_update`.

Loaded by vLLM in each of its processes through the `vllm.general_plugins` entry point (`register`);
this module imports vLLM, so only the replica's environment (.venv-vllm) imports it.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlflow.engine.rollout.staging import write_report
from rlflow.engine.rollout.weight_sync import TensorEntry, fingerprint_from_digests, tensor_digest, unpack_bucket

SHM_BACKEND = "rlflow_shm"


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    path: str  # /proc/<trainer pid>/fd/<memfd>
    nbytes: int  # the staging memory's size
    fingerprint: bool = True  # digest every loaded tensor (rollout.check_fingerprint; ~0.3 s per 538 MB here)


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    offset: int  # where the bucket starts in the staging memory
    nbytes: int
    tensors: list[dict[str, Any]] = field(default_factory=list)  # TensorEntry.to_json, offsets in the bucket


class SharedMemoryTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.staging: torch.Tensor | None = None
        self.fingerprinting = True
        self.digests: dict[str, tuple[tuple[int, ...], str]] = {}  # of the tensors loaded since the start

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        self.shutdown()
        with open(init_info.path, "r+b") as f:  # the mapping outlives the descriptor
            mapped = mmap.mmap(f.fileno(), init_info.nbytes)
        self.staging = torch.frombuffer(mapped, dtype=torch.uint8)
        self.fingerprinting = init_info.fingerprint
        write_report(self.staging, {"dtype": str(self.model_config.dtype).removeprefix("torch.")})

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.digests = {}
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host;
        # loading here is synchronous on every device this engine serves.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        if self.staging is None:
            raise RuntimeError(f"{SHM_BACKEND}: /update_weights before /init_weight_transfer_engine")
        end = update_info.offset + update_info.nbytes
        if update_info.offset < 0 or end > self.staging.numel():
            raise ValueError(
                f"{SHM_BACKEND}: bucket [{update_info.offset}, {end}) outside the staging memory"
                f" of {self.staging.numel()} bytes"
            )
        entries = [TensorEntry.from_json(t) for t in update_info.tensors]
        buffer = self.staging[update_info.offset : end]
        # copy=True: the layerwise reload keeps these tensors until their layer is complete, which may
        # be buckets later, and by then the trainer has packed another bucket into this slot.
        weights = [(name, view.to(self.device, copy=True)) for name, view in unpack_bucket(entries, buffer)]
        self.model.load_weights(weights=weights)
        for name, tensor in weights:
            digest = tensor_digest(tensor, self.model_config.dtype) if self.fingerprinting else ""
            self.digests[name] = (tuple(tensor.shape), digest)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._repack_tied_head()
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        fingerprint = fingerprint_from_digests(self.digests) if self.fingerprinting else None
        report = {"dtype": dtype, "tensors": len(self.digests), "fingerprint": fingerprint}
        write_report(self.staging, report)

    def _repack_tied_head(self) -> None:
        """vLLM 0.32 on the CPU packs every linear layer's weight for oneDNN after loading, the tied
        lm_head's too (a copy of the embedding). Its load_weights skips lm_head.weight when tied, so
        the reload never repacks it: without this, a replica samples with the new embedding and the
        old output layer (measured: 0.86 nats off after scaling the embedding by 1.3). On a GPU
        nothing is packed (no cpu_linear) and this does nothing."""
        head = getattr(self.model, "lm_head", None)
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False) or not hasattr(head, "cpu_linear"):
            return
        head.quant_method.process_weights_after_loading(head)

    def shutdown(self) -> None:
        self.staging = None  # the mapping closes with its last view


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every one of its processes."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(SHM_BACKEND, __name__, "SharedMemoryTransferEngine")
    except ValueError:  # registered already: vLLM loads plugins more than once in one process
        pass
