"""The rollout worker's wire format, typed requests and transformers backend.

The process (engine/rollout/worker_session.py, run by `RolloutClient.start`, never by hand)
connects to the trainer's Unix socket, loads the model, says "ready", then answers requests until
the trainer says "shutdown" or goes away. The protocol is docs/rollout-protocol.md: every message
is a fixed prefix, a JSON header and optional raw bytes (never pickle). A vLLM rollout replica is an
HTTP server instead (engine/rollout/replica.py, vllm_replica.py).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from rlflow.engine.errors import RlflowError
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

    # interrupt (partial rollouts, hf only): asked after each token; True cuts the rows short
    def generate(self, request: GenerateRequest, interrupt: Callable[[], bool] | None = None) -> GenerateResult: ...

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
    def generate(self, request: GenerateRequest, interrupt: Callable[[], bool] | None = None) -> GenerateResult:
        from rlflow.engine.data.batching import left_pad
        from rlflow.engine.config.sampling import SamplingParams
        from rlflow.engine.rollout.generate import sample_tokens
        from rlflow.engine.models.tokens import response_mask_from_ids

        ids, attention = left_pad(request.prompts, request.pad_token_id)
        params = SamplingParams(request.temperature, request.top_p, request.max_new_tokens)
        stops, pad = request.stop_token_ids, request.pad_token_id
        out = sample_tokens(self.model, ids, attention, params, stops, pad, request.seed, interrupt=interrupt)
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
