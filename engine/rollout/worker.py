"""The rollout worker process: the wire format, the request loop, and the transformers backend.

Run by `RolloutClient.start` (never by hand) as

    python -m rlflow.engine.rollout.worker --socket PATH --model-dir DIR --parent-pid PID ...

It connects to the trainer's Unix socket, loads the model, says "ready", then answers requests
until the trainer says "shutdown" or goes away. The protocol is docs/rollout-protocol.md: every
message is a fixed prefix, a JSON header and optional raw bytes (never pickle). The vLLM worker
(`rollout_worker_vllm`) reuses everything here except the backend.

Top-level imports stay light (stdlib, torch, weight_sync): the vLLM environment imports this
module too, and it has no fsspec/prefect.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from rlflow.engine.backend.cpu_memory import keep_freed_memory
from rlflow.engine.errors import RlflowError
from rlflow.engine.faults import fault_point
from rlflow.engine.rollout.weight_sync import DTYPES, TensorEntry, copy_tensor, unpack_bucket, weights_fingerprint

MAGIC = b"RLF1"
PREFIX = struct.Struct(">4sIQ")  # magic, header bytes, payload bytes (big-endian)
MAX_HEADER_BYTES = 64 << 20  # a corrupt prefix must not make us allocate gigabytes
log = logging.getLogger("rlflow.rollout_worker")


class ProtocolError(RlflowError):
    """The peer sent something that is not a valid message (version skew or a stray connection)."""


class PeerClosed(EOFError):
    """The other end closed the connection (or died)."""


class RequestError(RlflowError):
    """A request the worker understood but cannot carry out; sent back as {"ok": false}."""


# --- wire format ---------------------------------------------------------------------------


def send_all(sock: socket.socket, data: Any, on_idle: Callable[[], None] | None = None) -> None:
    """sendall that survives a socket timeout: calls `on_idle` and retries (no half-sent state)."""
    view = memoryview(data).cast("B")
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except TimeoutError:
            if on_idle is not None:
                on_idle()


def recv_exact(sock: socket.socket, view: memoryview, on_idle: Callable[[], None] | None = None) -> None:
    """Fill `view` from the socket; PeerClosed on EOF; `on_idle` runs on each socket timeout."""
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if on_idle is not None:
                on_idle()
            continue
        if n == 0:
            raise PeerClosed(f"connection closed after {got} of {len(view)} bytes")
        got += n


def send_message(
    sock: socket.socket, header: dict[str, Any], payload: Any = None, on_idle: Callable[[], None] | None = None
) -> None:
    body = json.dumps(header, separators=(",", ":")).encode()
    size = 0 if payload is None else memoryview(payload).nbytes
    send_all(sock, PREFIX.pack(MAGIC, len(body), size) + body, on_idle)
    if size:
        send_all(sock, payload, on_idle)


def recv_message(
    sock: socket.socket,
    payload_into: Callable[[int], memoryview] | None = None,
    on_idle: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], memoryview]:
    """One message: (header, payload). The payload lands in `payload_into(n)` if given, else in new memory."""
    prefix = bytearray(PREFIX.size)
    recv_exact(sock, memoryview(prefix), on_idle)
    magic, header_bytes, payload_bytes = PREFIX.unpack(prefix)
    if magic != MAGIC or header_bytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"bad message prefix {bytes(prefix)!r}: peer speaks another protocol version")
    body = bytearray(header_bytes)
    recv_exact(sock, memoryview(body), on_idle)
    header = json.loads(body)
    payload = payload_into(payload_bytes) if payload_into is not None else memoryview(bytearray(payload_bytes))
    recv_exact(sock, payload[:payload_bytes], on_idle)
    return header, payload[:payload_bytes]


# --- typed requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    prompts: list[list[int]]  # B prompts, token ids, unpadded
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    stop_token_ids: list[int]  # a response ends at the first of these (EOS, end of turn)
    pad_token_id: int

    def to_json(self) -> dict[str, Any]:
        return {"op": "generate", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateRequest:
        try:
            prompts = [[int(t) for t in row] for row in data["prompts"]]
            request = cls(
                prompts,
                float(data["temperature"]),
                float(data["top_p"]),
                int(data["max_new_tokens"]),
                int(data["seed"]),
                [int(t) for t in data["stop_token_ids"]],
                int(data["pad_token_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestError(f"malformed generate request ({type(exc).__name__}: {exc})") from None
        if not prompts or not all(prompts) or request.temperature <= 0 or request.max_new_tokens < 1:
            raise RequestError("generate needs non-empty prompts, temperature > 0 and max_new_tokens >= 1")
        if not request.stop_token_ids:
            raise RequestError("generate needs at least one stop token id")
        return request


@dataclass(frozen=True)
class GenerateResult:
    """Responses of one request, ragged: row i is the next lengths[i] entries of ids/logprobs."""

    lengths: list[int]  # B; each response ends at its first EOS (included) or at max_new_tokens
    ids: torch.Tensor  # [sum(lengths)] int64 sampled tokens
    logprobs: torch.Tensor  # [sum(lengths)] float32, log softmax(logits / T) of the sampled token

    def payload(self) -> bytes:
        return self.ids.to(torch.int64).numpy().tobytes() + self.logprobs.to(torch.float32).numpy().tobytes()


@dataclass(frozen=True)
class BucketSource:
    """Where a bucket's bytes are: a uint8 view, plus a path another process can open (staging only)."""

    buffer: torch.Tensor  # uint8 [nbytes]
    path: str | None  # /proc/<pid>/fd/<fd> of the staging memfd; None for inline bytes
    offset: int  # bucket start inside the file at `path`


class WorkerBackend(Protocol):
    name: str
    dtype: torch.dtype

    def describe(self) -> dict[str, Any]: ...  # JSON facts for the "ready" message

    def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def begin_update(self) -> None: ...

    def load(self, entries: list[TensorEntry], source: BucketSource) -> None: ...

    def end_update(self) -> None: ...

    def fingerprint(self) -> str: ...


# --- the transformers backend --------------------------------------------------------------------


class HFBackend:
    """A transformers causal LM on CPU, sampling exactly like `generate_rollouts`."""

    name = "hf"

    def __init__(self, model_dir: str, dtype: str, trust_remote_code: bool = False):
        from rlflow.engine.models.loading import load_policy

        self.model = load_policy(model_dir, dtype=dtype, trust_remote_code=trust_remote_code).eval()
        self.dtype = DTYPES[dtype]
        self.params = dict(self.model.named_parameters())

    def describe(self) -> dict[str, Any]:
        numel = sum(p.numel() for p in self.params.values())
        return {"parameters": numel, "tensors": len(self.params)}

    @torch.no_grad()
    def generate(self, request: GenerateRequest) -> GenerateResult:
        from rlflow.engine.data.batching import left_pad
        from rlflow.engine.config.sampling import SamplingParams
        from rlflow.engine.rollout.generate import sample_tokens
        from rlflow.engine.models.tokens import response_mask_from_ids

        ids, attention = left_pad(request.prompts, request.pad_token_id)
        params = SamplingParams(request.temperature, request.top_p, request.max_new_tokens)
        stops, pad = request.stop_token_ids, request.pad_token_id
        out = sample_tokens(self.model, ids, attention, params, stops, pad, request.seed)
        response, logprobs = out.tokens, out.logprobs
        keep = response_mask_from_ids(response, request.stop_token_ids).bool()
        return GenerateResult(keep.sum(1).tolist(), response[keep], logprobs[keep])

    def begin_update(self) -> None:
        pass

    @torch.no_grad()
    def load(self, entries: list[TensorEntry], source: BucketSource) -> None:
        for name, value in unpack_bucket(entries, source.buffer):
            param = self.params.get(name)
            if param is None:
                raise RequestError(f"worker model has no parameter {name!r}: trainer and worker models differ")
            if param.shape != value.shape:
                raise RequestError(
                    f"parameter {name!r} has shape {tuple(param.shape)}, update has {tuple(value.shape)}"
                )
            copy_tensor(param, value)

    def end_update(self) -> None:
        pass

    def fingerprint(self) -> str:
        return weights_fingerprint(self.model.named_parameters())


# --- the request loop ----------------------------------------------------------------------------


class Staging:
    """The trainer's shared-memory staging file (a memfd received over the socket), mapped here."""

    def __init__(self, fd: int, nbytes: int):
        self.fd = fd
        self.map = mmap.mmap(fd, nbytes)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)  # [nbytes]
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    def close(self) -> None:
        self.buffer = None  # the mapping goes when its last view does
        os.close(self.fd)


class WorkerSession:
    """Dispatches requests to the backend; keeps the staging map and the current update's counters."""

    def __init__(self, sock: socket.socket, backend: WorkerBackend):
        self.sock = sock
        self.backend = backend
        self.staging: Staging | None = None
        self.inline = torch.empty(0, dtype=torch.uint8)  # reused receive buffer for inline buckets
        self.buckets = self.tensors = self.bytes = 0
        self.generations = 0  # generate requests handled: the kill point "rollout:generate:<n>"
        self.idle_s = 0.0  # seconds between sending a reply and the next request arriving

    def payload_buffer(self, n: int) -> memoryview:
        if self.inline.numel() < n:
            self.inline = torch.empty(n, dtype=torch.uint8)
        return memoryview(self.inline.numpy())

    def handle(self, header: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes | None]:
        op = header.get("op")
        if op == "generate":
            self.generations += 1
            fault_point("rollout", "generate", self.generations)
            start = time.monotonic()
            result = self.backend.generate(GenerateRequest.from_json(header))
            seconds = time.monotonic() - start
            log.info("generate: %d rows, %d tokens in %.3f s", len(result.lengths), sum(result.lengths), seconds)
            return {"ok": True, "lengths": result.lengths, "seconds": seconds}, result.payload()
        if op == "attach_staging":
            fds = socket.recv_fds(self.sock, 1, 1)[1]
            if len(fds) != 1:
                raise RequestError("attach_staging arrived without a file descriptor")
            if self.staging is not None:
                self.staging.close()
            self.staging = Staging(fds[0], int(header["nbytes"]))
            log.info("attached a %.1f MB staging buffer", header["nbytes"] / 1e6)
            return {"ok": True}, None
        if op == "begin_update":
            self.buckets = self.tensors = self.bytes = 0
            self.backend.begin_update()
            return {"ok": True}, None
        if op == "load_bucket":
            return self.load_bucket(header, payload), None
        if op == "end_update":
            self.backend.end_update()
            log.info("update: %d buckets, %d tensors, %.1f MB", self.buckets, self.tensors, self.bytes / 1e6)
            return {"ok": True, "buckets": self.buckets, "tensors": self.tensors, "bytes": self.bytes}, None
        if op == "fingerprint":
            return {"ok": True, "fingerprint": self.backend.fingerprint()}, None
        if op == "shutdown":
            return {"ok": True}, None
        raise RequestError(f"unknown op {op!r}")

    def load_bucket(self, header: dict[str, Any], payload: memoryview) -> dict[str, Any]:
        entries = [TensorEntry.from_json(e) for e in header["tensors"]]
        nbytes = int(header["nbytes"])
        if header.get("source") == "staging":
            if self.staging is None:
                raise RequestError("load_bucket from staging before attach_staging")
            offset = int(header["offset"])
            buffer = self.staging.buffer[offset : offset + nbytes]
            source = BucketSource(buffer, self.staging.path, offset)
        else:
            source = BucketSource(self.inline[: len(payload)], None, 0)
        self.backend.load(entries, source)
        self.buckets += 1
        self.tensors += len(entries)
        self.bytes += sum(e.nbytes for e in entries)
        return {"ok": True, "index": header.get("index")}

    def serve(self) -> None:
        """Answer requests in order until the trainer leaves. Every reply carries "idle_s": the
        worker's idle seconds so far (the time the trainer kept it waiting, timing_s/wait_train)."""
        while True:
            waiting = time.monotonic()
            try:
                header, payload = recv_message(self.sock, self.payload_buffer)
            except PeerClosed:
                log.info("trainer closed the connection; exiting")
                return
            self.idle_s += time.monotonic() - waiting
            try:
                reply, out = self.handle(header, payload)
            except RequestError as exc:
                reply, out = {"ok": False, "error": str(exc)}, None
            except Exception as exc:  # a bug or a backend failure: report it, keep serving
                log.exception("request %r failed", header.get("op"))
                reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
            try:
                send_message(self.sock, reply | {"idle_s": self.idle_s}, out)
            except OSError:  # broken pipe: the trainer died while we worked
                log.info("trainer went away before the %r reply; exiting", header.get("op"))
                return
            if header.get("op") == "shutdown":
                log.info("shutdown requested; exiting")
                return


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit when the trainer process is gone, even mid-request (its socket EOF is only seen between requests)."""

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                log.error("trainer process %d is gone; exiting", parent_pid)
                os._exit(3)
            time.sleep(interval_s)

    threading.Thread(target=run, name="parent-watchdog", daemon=True).start()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="rlflow rollout worker (started by RolloutClient)")
    parser.add_argument("--socket", required=True, help="the trainer's Unix socket path")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser.parse_args(argv)


def run_worker(make_backend: Callable[[argparse.Namespace], WorkerBackend], argv: list[str] | None = None) -> int:
    """Connect, load, say ready, serve. Returns the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s rollout-worker[{os.getpid()}] %(message)s"
    )
    watch_parent(args.parent_pid)
    if not os.path.isdir(args.model_dir):
        log.error("model directory %s does not exist; point the rollout worker at a local HF model", args.model_dir)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():  # as make_runtime: a CPU process keeps its freed memory
        keep_freed_memory()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.socket)
    start = time.monotonic()
    try:
        backend = make_backend(args)
    except Exception:
        log.exception("loading %s failed", args.model_dir)
        return 1
    facts = backend.describe()
    log.info(
        "loaded %s (%s, %s) in %.1f s; ready", args.model_dir, backend.name, backend.dtype, time.monotonic() - start
    )
    ready = {
        "op": "ready",
        "pid": os.getpid(),
        "backend": backend.name,
        "dtype": str(backend.dtype).removeprefix("torch."),
    }
    send_message(sock, ready | facts | {"load_s": time.monotonic() - start})
    WorkerSession(sock, backend).serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_worker(lambda a: HFBackend(a.model_dir, a.dtype, a.trust_remote_code), argv)


if __name__ == "__main__":
    sys.exit(main())
