"""The trainer's side of rlflow's weight-transfer engine for vLLM (engine/rollout/vllm_transfer.py).

A channel carries buckets (engine/rollout/weight_sync.py) to one replica and reads its report back:
- `SharedMemoryChannel` (transport shm): a replica on this host maps the trainer's memfd
  (engine/rollout/staging.py); packing a bucket is the whole transfer.
- `GlooChannel` (transport gloo): a replica anywhere joins a two-rank gloo group whose TCPStore the
  trainer hosts; each bucket is broadcast while its /update_weights call is in flight (the replica
  takes part in the broadcast inside that call), and so is the replica's report.
- `FsspecChannel` (transport fsspec): a replica that shares no network group with the trainer, only
  storage (a shared disk, s3://): each bucket is written there as a safetensors file, the replica
  reads it inside its /update_weights call and writes its report beside it. Each side reaches the
  storage with its own environment's credentials: nothing secret travels in a request.
vLLM's HTTP routes drive all three (`call(path, body)`, the client's); a channel only adds the bytes.
Every collective has the group's timeout: a replica gone mid-broadcast is an error, not a hang.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from rlflow.engine.rollout.staging import REPORT_BYTES, Staging, read_report
from rlflow.engine.rollout.weight_sync import Bucket, pack_bucket

Call = Callable[[str, dict[str, Any] | None], dict[str, Any]]  # POST path with a JSON body
TRAINER, REPLICA = 0, 1  # ranks of the gloo group (as transfer_receiver.py numbers them)
REPORT_FILE = "report.json"  # fsspec: the replica's report, beside the bucket files
# A replica's seconds per update, reported as <phase>_s at its finish: bytes out of the channel into its
# own memory, into the model (vLLM: its weight loaders and the CPU's repacking), the fingerprint's digests.
UPDATE_PHASES = ("receive", "load", "fingerprint")


def _in_thread(call: Call, path: str, body: dict[str, Any] | None) -> tuple[threading.Thread, list]:
    """POST while this thread takes part in the collective the replica runs inside that call."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            call(path, body)
        except BaseException as exc:  # re-raised by _join on the trainer's thread
            failures.append(exc)

    thread = threading.Thread(target=run, name=f"replica-call{path}", daemon=True)
    thread.start()
    return thread, failures


def _join(thread: threading.Thread, failures: list, timeout_s: float) -> None:
    thread.join(timeout_s)
    if failures:
        raise failures[0]
    if thread.is_alive():
        raise TimeoutError(f"the replica did not answer within {timeout_s:g} s (rollout.response_timeout_s)")


def broadcast(group: Any, tensor: torch.Tensor, root: int, failures: list | None = None, timeout_s: float = 600):
    """A gloo broadcast of `tensor` from rank `root`. On the trainer, `failures` is the HTTP call the
    replica joins it from: if that call fails, the replica never joins, and waiting on stops at once."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = root
    work = group.broadcast([tensor], options)
    if failures is None:
        work.wait()
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if failures:
            raise failures[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replica took no part in a weight broadcast within {timeout_s:g} s")
        time.sleep(0.0005)
    work.wait()


class SharedMemoryChannel:
    transport = "shm"

    def __init__(self, fingerprint: bool = True):
        self.fingerprint = fingerprint
        self.staging: Staging | None = None

    @property
    def slot_bytes(self) -> int:
        return self.staging.slot_bytes if self.staging is not None else 0

    def attach(self, call: Call, slot_bytes: int) -> dict[str, Any]:
        self.close()
        self.staging = Staging(slot_bytes, slots=2)
        info = {"transport": "shm", "path": self.staging.path, "nbytes": self.staging.nbytes}
        call("/init_weight_transfer_engine", {"init_info": info | {"fingerprint": self.fingerprint}})
        return self.staging.read_report()

    def send(self, call: Call, bucket: Bucket, index: int) -> None:
        offset = self.staging.slot_offset(index)
        pack_bucket(bucket, self.staging.buffer[offset : offset + bucket.nbytes])
        entries = [e.to_json() for e in bucket.entries]
        call("/update_weights", {"update_info": {"offset": offset, "nbytes": bucket.nbytes, "tensors": entries}})

    def finish(self, call: Call) -> dict[str, Any]:
        call("/finish_weight_update", None)
        return self.staging.read_report()

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None


class GlooChannel:
    transport = "gloo"

    def __init__(self, host: str, advertise: str | None = None, fingerprint: bool = True, timeout_s: float = 600.0):
        """host: where this trainer's TCPStore listens; advertise: the address the replica dials (default host)."""
        self.host, self.advertise, self.fingerprint, self.timeout_s = host, advertise or host, fingerprint, timeout_s
        self.group: Any = None
        self.store: Any = None
        self.buffer: torch.Tensor | None = None

    @property
    def slot_bytes(self) -> int:
        return self.buffer.numel() if self.buffer is not None else 0

    def attach(self, call: Call, slot_bytes: int) -> dict[str, Any]:
        import torch.distributed as dist

        self.close()
        timeout = timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(self.host, 0, 2, True, timeout=timeout, wait_for_workers=False)
        info = {"transport": "gloo", "host": self.advertise, "port": self.store.port, "nbytes": slot_bytes}
        info |= {"timeout_s": self.timeout_s, "fingerprint": self.fingerprint}
        thread, failures = _in_thread(call, "/init_weight_transfer_engine", {"init_info": info})
        self.group = dist.ProcessGroupGloo(self.store, TRAINER, 2, timeout)
        report = self._receive_report(failures)
        _join(thread, failures, self.timeout_s)
        self.buffer = torch.empty(slot_bytes, dtype=torch.uint8)
        return report

    def _receive_report(self, failures: list) -> dict[str, Any]:
        message = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
        broadcast(self.group, message, REPLICA, failures, self.timeout_s)
        return read_report(message)

    def send(self, call: Call, bucket: Bucket, index: int) -> None:
        data = self.buffer[: bucket.nbytes]
        pack_bucket(bucket, data)
        body = {"update_info": {"offset": 0, "nbytes": bucket.nbytes, "tensors": [e.to_json() for e in bucket.entries]}}
        thread, failures = _in_thread(call, "/update_weights", body)
        broadcast(self.group, data, TRAINER, failures, self.timeout_s)
        _join(thread, failures, self.timeout_s)

    def finish(self, call: Call) -> dict[str, Any]:
        thread, failures = _in_thread(call, "/finish_weight_update", None)
        report = self._receive_report(failures)
        _join(thread, failures, self.timeout_s)
        return report

    def close(self) -> None:
        self.group = self.store = self.buffer = None


class FsspecChannel:
    transport = "fsspec"
    def __init__(self, url: str, fingerprint: bool = True):
        """url: a folder both sides reach (file:///shared/weights, s3://bucket/run/weights); this
        channel owns the files it writes there (bucket-*.safetensors, report.json)."""
        import fsspec

        self.url, self.fingerprint = url.rstrip("/"), fingerprint
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.written: set[str] = set()
        self._slot_bytes = 0

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _read_report(self, call: Call, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """POST, then read the report the replica wrote during that call (removed first: never a stale one)."""
        if self.fs.exists(self._path(REPORT_FILE)):
            self.fs.rm_file(self._path(REPORT_FILE))
        call(path, body)
        with self.fs.open(self._path(REPORT_FILE), "rb") as f:
            return json.loads(f.read())

    def attach(self, call: Call, slot_bytes: int) -> dict[str, Any]:
        self.fs.makedirs(self.root, exist_ok=True)
        self.written.add(REPORT_FILE)
        info = {"transport": "fsspec", "url": self.url, "nbytes": slot_bytes, "fingerprint": self.fingerprint}
        report = self._read_report(call, "/init_weight_transfer_engine", {"init_info": info})
        self._slot_bytes = slot_bytes
        return report

    def send(self, call: Call, bucket: Bucket, index: int) -> None:
        from safetensors.torch import save

        name = f"bucket-{index:05d}.safetensors"
        data = save({e.name: t.contiguous() for e, t in zip(bucket.entries, bucket.tensors)})
        with self.fs.open(self._path(name), "wb") as f:
            f.write(data)
        self.written.add(name)
        body = {"update_info": {"offset": 0, "nbytes": bucket.nbytes, "file": name}}
        call("/update_weights", body)

    def finish(self, call: Call) -> dict[str, Any]:
        return self._read_report(call, "/finish_weight_update", None)

    def close(self) -> None:
        for name in sorted(self.written):
            if self.fs.exists(self._path(name)):
                self.fs.rm_file(self._path(name))
        self.written.clear()


def _fsspec(fingerprint: bool, timeout_s: float, gloo_host: str, url: str | None) -> FsspecChannel:
    if not url:
        raise ValueError("weight transport fsspec needs a folder both sides reach (rollout.weights_url)")
    return FsspecChannel(url, fingerprint)


# transport -> the trainer's channel, from (fingerprint, timeout_s, gloo_host, url)
CHANNELS: dict[str, Callable[[bool, float, str, str | None], Any]] = {
    "shm": lambda fingerprint, timeout_s, gloo_host, url: SharedMemoryChannel(fingerprint),
    "gloo": lambda fingerprint, timeout_s, gloo_host, url: GlooChannel(gloo_host, fingerprint=fingerprint,
                                                                        timeout_s=timeout_s),
    "fsspec": _fsspec,
}
TRANSPORTS = tuple(CHANNELS)


def make_channel(
    transport: str, *, fingerprint: bool, timeout_s: float, gloo_host: str = "127.0.0.1", url: str | None = None
):
    """The trainer's channel of `transport` (a key of CHANNELS); unknown ones list the valid ones."""
    if transport not in CHANNELS:
        raise ValueError(f"unknown weight transport {transport!r}; use one of {list(TRANSPORTS)}")
    return CHANNELS[transport](fingerprint, timeout_s, gloo_host, url)
