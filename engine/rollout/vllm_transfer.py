"""rlflow's weight-transfer engines for vLLM, registered through vLLM's own factory.

vLLM 0.32 moves trainer weights into a replica through `WeightTransferEngine`s chosen by
`--weight-transfer-config '{"backend": ...}'`; its built-in ones (nccl, ipc) need a GPU. These serve
the CPU, and any replica that shares a host with its trainer:

backend `rlflow` (`--weight-transfer-config {"backend": "rlflow"}`), two transports chosen by the
trainer at `/init_weight_transfer_engine` (engine/rollout/transfer.py is the trainer's side):

- `shm`, a replica on the trainer's host: the trainer packs each bucket (engine/rollout/weight_sync.py)
  into an anonymous memfd it owns; the init names it (`/proc/<pid>/fd/<fd>`, readable only by the
  trainer's user), and each `/update_weights` carries only the bucket's layout as JSON;
- `gloo`, a replica anywhere: a two-rank torch.distributed gloo group of its own (a TCPStore on the
  trainer), each bucket broadcast from the trainer while its `/update_weights` call is in flight.
- `fsspec`, a replica that shares only storage with the trainer: each bucket is a safetensors file
  in a folder both reach (`url`, read with this environment's own credentials), named by its
  `/update_weights` call; the report is written beside it (report.json).

Either way the tensors go to `model.load_weights`, which maps HF names onto vLLM's fused layers
(qkv_proj, gate_up_proj) and converts the dtype, and the replica reports back (engine/rollout/staging.py
format): its weight dtype at init, and after each update the count and the fingerprint of what it loaded
(per-tensor digests rounded to that dtype), which the trainer compares with its own. shm writes the report
into the memfd's first REPORT_BYTES, gloo broadcasts it from the replica, fsspec writes report.json.
vLLM's `weight_checker` cannot serve here: on the CPU its checksums of the repacked linear layers hash
empty tensors, so they would not see a skipped update of those layers.

Every update runs vLLM's layerwise-reload lifecycle (as its NCCL engine does): a backend that repacks
weights after loading (the CPU's linear kernels do) repacks the new ones in `finish_weight_update`.

Loaded by vLLM in each of its processes through the `vllm.general_plugins` entry point (`register`);
this module imports vLLM, so only the replica's environment (.venv-vllm) imports it.
"""

from __future__ import annotations

import json
import mmap
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlflow.engine.rollout.staging import REPORT_BYTES, write_report
from rlflow.engine.rollout.transfer import REPLICA, TRAINER, TRANSPORTS, broadcast
from rlflow.engine.rollout.weight_sync import TensorEntry, fingerprint_from_digests, tensor_digest, unpack_bucket

BACKEND = "rlflow"


@dataclass
class RlflowInitInfo(WeightTransferInitInfo):
    transport: str  # one of TRANSPORTS
    nbytes: int  # shm: the staging memory's size; gloo: the largest bucket
    path: str | None = None  # shm: /proc/<trainer pid>/fd/<memfd>
    host: str | None = None  # gloo: the trainer's TCPStore
    port: int | None = None
    url: str | None = None  # fsspec: the folder of the bucket files
    timeout_s: float = 600.0  # gloo: longest wait for the trainer's side of a collective
    fingerprint: bool = True  # digest every loaded tensor (rollout.check_fingerprint; ~0.3 s per 538 MB here)


@dataclass
class RlflowUpdateInfo(WeightTransferUpdateInfo):
    offset: int  # shm: where the bucket starts in the staging memory; gloo: 0
    nbytes: int
    tensors: list[dict[str, Any]] = field(default_factory=list)  # TensorEntry.to_json, offsets in the bucket
    file: str | None = None  # fsspec: the bucket's safetensors file in the init's folder


class RlflowTransferEngine(WeightTransferEngine[RlflowInitInfo, RlflowUpdateInfo]):
    init_info_cls = RlflowInitInfo
    update_info_cls = RlflowUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.transport: str | None = None
        self.buffer: torch.Tensor | None = None  # shm: the mapped memfd; gloo: the receive buffer
        self.group: Any = None
        self.fs: Any = None  # fsspec: the filesystem of the bucket files, and their folder
        self.root: str | None = None
        self.fingerprinting = True
        self.digests: dict[str, tuple[tuple[int, ...], str]] = {}  # of the tensors loaded since the start

    def init_transfer_engine(self, init_info: RlflowInitInfo) -> None:
        if init_info.transport not in TRANSPORTS:
            raise ValueError(f"{BACKEND}: unknown transport {init_info.transport!r}; use one of {list(TRANSPORTS)}")
        self.shutdown()
        self.transport, self.fingerprinting = init_info.transport, init_info.fingerprint
        if init_info.transport == "shm":
            with open(init_info.path, "r+b") as f:  # the mapping outlives the descriptor
                mapped = mmap.mmap(f.fileno(), init_info.nbytes)
            self.buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        elif init_info.transport == "fsspec":
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(init_info.url)
        else:
            import torch.distributed as dist

            timeout = timedelta(seconds=init_info.timeout_s)
            store = dist.TCPStore(init_info.host, init_info.port, 2, False, timeout=timeout)
            self.group = dist.ProcessGroupGloo(store, REPLICA, 2, timeout)
            self.buffer = torch.empty(init_info.nbytes, dtype=torch.uint8)
        self._report({"dtype": self._dtype()})

    def _dtype(self) -> str:
        return str(self.model_config.dtype).removeprefix("torch.")

    def _report(self, report: dict[str, Any]) -> None:
        if self.transport == "shm":
            write_report(self.buffer, report)
            return
        if self.transport == "fsspec":
            with self.fs.open(f"{self.root}/report.json", "wb") as f:
                f.write(json.dumps(report).encode())
            return
        message = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
        write_report(message, report)
        broadcast(self.group, message, REPLICA)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.digests = {}
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU-only host;
        # loading here is synchronous on every device this engine serves.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RlflowUpdateInfo) -> None:
        if self.transport == "fsspec":
            self._load(self._read_file(update_info.file))
            return
        if self.buffer is None:
            raise RuntimeError(f"{BACKEND}: /update_weights before /init_weight_transfer_engine")
        end = update_info.offset + update_info.nbytes
        if update_info.offset < 0 or end > self.buffer.numel():
            raise ValueError(
                f"{BACKEND}: bucket [{update_info.offset}, {end}) outside the {self.transport} buffer"
                f" of {self.buffer.numel()} bytes"
            )
        buffer = self.buffer[update_info.offset : end]
        if self.transport == "gloo":
            broadcast(self.group, buffer, TRAINER)
        entries = [TensorEntry.from_json(t) for t in update_info.tensors]
        # copy=True: the layerwise reload keeps these tensors until their layer is complete, which may
        # be buckets later, and by then the next bucket has overwritten this buffer.
        self._load([(name, view.to(self.device, copy=True)) for name, view in unpack_bucket(entries, buffer)])

    def _read_file(self, name: str | None) -> list[tuple[str, torch.Tensor]]:
        from safetensors.torch import load  # no pickle: a file in shared storage is data only

        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{BACKEND}: fsspec bucket file {name!r} is not a plain file name in {self.root}")
        with self.fs.open(f"{self.root}/{name}", "rb") as f:
            return [(key, tensor.to(self.device)) for key, tensor in load(f.read()).items()]

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights=weights)
        for name, tensor in weights:
            digest = tensor_digest(tensor, self.model_config.dtype) if self.fingerprinting else ""
            self.digests[name] = (tuple(tensor.shape), digest)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self._repack_tied_head()
        fingerprint = fingerprint_from_digests(self.digests) if self.fingerprinting else None
        self._report({"dtype": self._dtype(), "tensors": len(self.digests), "fingerprint": fingerprint})

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
        self.buffer = None  # a memfd mapping closes with its last view
        self.group = None
        self.fs = self.root = None


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every one of its processes."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlflowTransferEngine")
    except ValueError:  # registered already: vLLM loads plugins more than once in one process
        pass
