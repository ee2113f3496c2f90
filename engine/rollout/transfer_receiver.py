"""The replica's side of rlflow's weight channels (engine/rollout/transfer.py is the trainer's).

Both replica kinds use it: vLLM's through rlflow's weight-transfer engine (vllm_transfer.py), the HF
replica directly (hf_replica.py). It knows the bytes, not the model:
- `shm`: maps the trainer's memfd (`/proc/<trainer pid>/fd/<fd>`, readable only by the trainer's
  user); a bucket is a view of one of its slots;
- `gloo`: joins the trainer's two-rank gloo group; a bucket is broadcast into a receive buffer while
  its /update_weights call runs;
- `fsspec`: reads the bucket's safetensors file from the folder both reach, with this environment's
  own credentials (safetensors: data only, never pickle).
The replica answers through the same channel (`report`): its dtype at init, after each update the
count and fingerprint of what it loaded and its seconds per phase of the update (`<phase>_s` for
transfer.py's UPDATE_PHASES, counted by `UpdateClock`) (engine/rollout/staging.py's report format).
Every collective has the trainer's timeout: a trainer gone mid-broadcast is an error, not a hang.
"""

from __future__ import annotations

import json
import mmap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from rlflow.engine.rollout.staging import REPORT_BYTES, write_report
from rlflow.engine.rollout.transfer import REPLICA, REPORT_FILE, TRAINER, TRANSPORTS, UPDATE_PHASES, broadcast
from rlflow.engine.rollout.weight_sync import TensorEntry, unpack_bucket


@dataclass
class TransferInit:
    """/init_weight_transfer_engine's `init_info` (transfer.py's channels send it)."""

    transport: str  # one of TRANSPORTS
    nbytes: int  # shm: the staging memory's size; gloo: the largest bucket
    path: str | None = None  # shm: /proc/<trainer pid>/fd/<memfd>
    host: str | None = None  # gloo: the trainer's TCPStore
    port: int | None = None
    url: str | None = None  # fsspec: the folder of the bucket files
    timeout_s: float = 600.0  # gloo: longest wait for the trainer's side of a collective
    fingerprint: bool = True  # digest what was loaded (rollout.check_fingerprint; ~0.3 s per 538 MB here)


@dataclass
class BucketUpdate:
    """/update_weights's `update_info`: one bucket."""

    offset: int  # shm: where the bucket starts in the staging memory; gloo: 0
    nbytes: int
    tensors: list[dict[str, Any]] = field(default_factory=list)  # TensorEntry.to_json, offsets in the bucket
    file: str | None = None  # fsspec: the bucket's safetensors file in the init's folder


class ReplicaChannel:
    """One trainer's channel, replica side: `receive` gives a bucket's (name, tensor) pairs. shm and
    gloo tensors are views of a buffer the next bucket overwrites: copy what must outlive the call."""

    def __init__(self, init: TransferInit):
        if init.transport not in TRANSPORTS:
            raise ValueError(f"unknown weight transport {init.transport!r}; use one of {list(TRANSPORTS)}")
        self.init = init
        self.buffer: torch.Tensor | None = None  # shm: the mapped memfd; gloo: the receive buffer
        self.group: Any = None
        self.fs: Any = None
        self.root: str | None = None
        if init.transport == "shm":
            with open(init.path, "r+b") as f:  # the mapping outlives the descriptor
                mapped = mmap.mmap(f.fileno(), init.nbytes)
            self.buffer = torch.frombuffer(mapped, dtype=torch.uint8)
        elif init.transport == "fsspec":
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(init.url)
        else:
            import torch.distributed as dist

            timeout = timedelta(seconds=init.timeout_s)
            store = dist.TCPStore(init.host, init.port, 2, False, timeout=timeout)
            self.group = dist.ProcessGroupGloo(store, REPLICA, 2, timeout)
            self.buffer = torch.empty(init.nbytes, dtype=torch.uint8)

    @property
    def transport(self) -> str:
        return self.init.transport

    def receive(self, update: BucketUpdate) -> list[tuple[str, torch.Tensor]]:
        if self.transport == "fsspec":
            return self._read_file(update.file)
        end = update.offset + update.nbytes
        if update.offset < 0 or end > self.buffer.numel():
            raise ValueError(
                f"bucket [{update.offset}, {end}) outside the {self.transport} buffer of {self.buffer.numel()} bytes"
            )
        buffer = self.buffer[update.offset : end]
        if self.transport == "gloo":
            broadcast(self.group, buffer, TRAINER)
        return list(unpack_bucket([TensorEntry.from_json(t) for t in update.tensors], buffer))

    def _read_file(self, name: str | None) -> list[tuple[str, torch.Tensor]]:
        from safetensors.torch import load  # no pickle: a file in shared storage is data only

        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"fsspec bucket file {name!r} is not a plain file name in {self.root}")
        with self.fs.open(f"{self.root}/{name}", "rb") as f:
            return list(load(f.read()).items())

    def report(self, report: dict[str, Any]) -> None:
        """Answer the trainer: shm writes into the memfd's report region, fsspec writes report.json,
        gloo broadcasts it from the replica (the trainer takes part inside its HTTP call)."""
        if self.transport == "shm":
            write_report(self.buffer, report)
        elif self.transport == "fsspec":
            with self.fs.open(f"{self.root}/{REPORT_FILE}", "wb") as f:
                f.write(json.dumps(report).encode())
        else:
            message = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
            write_report(message, report)
            broadcast(self.group, message, REPLICA)

    def close(self) -> None:
        self.buffer = None  # a memfd mapping closes with its last view
        self.group = self.fs = self.root = None


class UpdateClock:
    """The seconds a replica spends in each of UPDATE_PHASES during one update, for its finish report."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(UPDATE_PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def report(self) -> dict[str, float]:
        return {f"{name}_s": round(seconds, 6) for name, seconds in self.seconds.items()}
