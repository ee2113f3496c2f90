"""Rollout as a service, trainer side: start a worker process, sample from it, push weights to it.

    with RolloutClient.start("hf", model_dir, tokenizer=tokenizer) as client:
        generation = client.generate(prompts, params, seed)   # token ids and log-probs per prompt
        ...optimizer step...
        stats = client.update_weights(policy.named_parameters(), bucket_mb=256)

engine/rollout/served.py turns a Generation into the trainer's RolloutBatch and probes a sync.

The worker (`rollout_worker` for "hf", `rollout_worker_vllm` for "vllm") runs under its own
interpreter and talks over a Unix socket in a private directory (docs/rollout-protocol.md). A dead
worker is an error naming it and quoting its log, never a hang; the worker exits by itself when
the trainer goes away.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, final

import torch
from rlflow.engine.errors import RlflowError
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.models.tokens import stop_token_ids
from rlflow.engine.rollout.staging import Staging
from rlflow.engine.rollout.worker_samples import Generation, generation_from_reply
from rlflow.engine.rollout.worker import GenerateRequest, PeerClosed, recv_message, send_message
from rlflow.engine.rollout.weight_sync import iter_buckets, pack_bucket

WORKER_MODULES = {"hf": "rlflow.engine.rollout.worker_session"}  # vllm: engine/rollout/vllm_replica.py
POLL_S = 0.2  # how often a waiting client checks that the worker is still alive
LOG_TAIL_LINES = 6
MB = 1 << 20


class RolloutWorkerError(RlflowError):
    """The rollout worker failed to start, died, or refused a request (the message quotes its log)."""


@dataclass(frozen=True)
class SyncStats:
    """One weight update: log seconds as timing_s/update_weights and gb_per_s as rollout/sync_gb_per_s."""

    seconds: float
    bytes: int  # tensor bytes sent (alignment padding excluded)
    gb_per_s: float  # bytes / seconds / 1e9
    buckets: int
    tensors: int
    transport: str  # "shm" or "socket"


def _cleanup(proc: subprocess.Popen, paths: list[str]) -> None:
    """Finalizer: no orphan worker even if close() is never called."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)
    if paths:
        try:
            os.rmdir(os.path.dirname(paths[0]))
        except OSError:
            pass


@final
class RolloutClient:
    """Trainer-side handle of one rollout worker process. Use `start`; close (or `with`) when done.

    Not thread-safe. Generations may be pipelined (`submit` several, `collect` them in order, while
    the trainer works); every other request waits until none is outstanding, unless `concurrent`.
    """

    def __init__(self, proc: subprocess.Popen, backend: str, log_path: str, tokenizer: Any, socket_path: str):
        self.proc, self.backend, self.log_path, self.tokenizer = proc, backend, log_path, tokenizer
        self.sock: socket.socket | None = None
        self.dtype = torch.float32  # the worker's weight dtype, from its ready message
        self.info: dict[str, Any] = {}
        self._staging: Staging | None = None
        self._inline = torch.empty(0, dtype=torch.uint8)
        self._failed: str | None = None
        self._outstanding = 0  # generate requests sent, replies not yet collected
        self._ready: deque[tuple[dict[str, Any], memoryview]] = deque()  # replies read while awaiting another
        self._next_id = 0
        # True: control requests go out with generations outstanding; the worker serves them first, so
        # the weights change under samples submitted earlier (asynchronous rollout tags each token's version)
        self.concurrent = False
        self.response_timeout_s: float | None = None  # longest wait for one reply; None: no limit
        self.worker_idle_s = 0.0  # the worker's idle seconds so far, from its latest reply
        self._own_log = False  # a temp log we created: deleted by a clean close
        self._finalizer = weakref.finalize(self, _cleanup, proc, [socket_path])

    @property
    def pid(self) -> int:
        return self.proc.pid

    # --- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        backend: str,
        model_dir: str,
        python: str | None = None,
        startup_timeout_s: float = 300.0,
        threads: int | None = None,
        *,
        response_timeout_s: float | None = None,
        tokenizer: Any = None,
        dtype: str = "float32",
        log_path: str | None = None,
        trust_remote_code: bool = False,
        cuda_visible_devices: str | None = None,
    ) -> RolloutClient:
        """Spawn a worker on `model_dir` and wait until it has loaded the model.

        python: the worker's interpreter (default: this one; for "vllm" rollout.vllm_python).
        threads: torch CPU threads of the worker (default: this process's count, so both sides
        compute alike). tokenizer: the trainer's (pad/EOS ids and decoding); loaded from model_dir
        if None. log_path: the worker's stdout+stderr (default: a temp file, deleted by a clean
        close and kept when the worker failed).
        """
        if backend not in WORKER_MODULES:
            raise RolloutWorkerError(f"unknown rollout.server_backend {backend!r}; use one of {sorted(WORKER_MODULES)}")
        python = python or sys.executable
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise RolloutWorkerError(
                f"rollout worker interpreter {python!r} is not an executable file; for vllm run `make vllm-env`"
                " or set rollout.vllm_python"
            )
        if tokenizer is None:
            from rlflow.engine.models.loading import load_tokenizer

            tokenizer = load_tokenizer(model_dir, trust_remote_code)
        directory = tempfile.mkdtemp(prefix="rlflow-rollout-")  # mode 0700: only this user can connect
        socket_path = os.path.join(directory, "worker.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(socket_path)
        listener.listen(1)
        listener.settimeout(POLL_S)
        own_log = log_path is None
        if own_log:
            fd, log_path = tempfile.mkstemp(prefix="rlflow-rollout-worker-", suffix=".log")
            os.close(fd)
        threads = threads or torch.get_num_threads()
        command = [python, "-m", WORKER_MODULES[backend], "--socket", socket_path, "--model-dir", str(model_dir)]
        command += ["--parent-pid", str(os.getpid()), "--dtype", dtype, "--threads", str(threads)]
        command += ["--trust-remote-code"] if trust_remote_code else []
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
        env.pop("RLFLOW_SECRETS", None)  # the worker needs no credentials
        if cuda_visible_devices is not None:  # placement.rollout: the worker's own GPUs
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env
            )
        client = cls(proc, backend, log_path, tokenizer, socket_path)
        client._own_log, client.response_timeout_s = own_log, response_timeout_s
        try:
            client._connect(listener, time.monotonic() + startup_timeout_s, startup_timeout_s)
        except BaseException:
            client._failed = client._failed or "start-up was interrupted"
            client.close()
            raise
        finally:
            listener.close()
        return client

    def _connect(self, listener: socket.socket, deadline: float, timeout_s: float) -> None:
        def waiting() -> None:
            self._check_alive("starting")
            if time.monotonic() > deadline:
                self._fail(f"did not become ready within {timeout_s:g} s (rollout.startup_timeout_s)")

        while self.sock is None:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                waiting()
                continue
            if _peer_pid(conn) not in (None, self.proc.pid):
                conn.close()  # not our child: the directory is private, so this should never happen
                continue
            conn.settimeout(POLL_S)
            self.sock = conn
        path = listener.getsockname()  # connected: nothing needs the socket's name any more
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
        try:
            header, _ = recv_message(self.sock, on_idle=waiting)
        except (PeerClosed, OSError):
            self._died("starting")
        if header.get("op") != "ready":
            self._fail(f"sent {header.get('op')!r} instead of 'ready'")
        self.info = header
        self.dtype = getattr(torch, header["dtype"])

    def close(self) -> None:
        """Ask the worker to exit, wait briefly, then make sure it is gone. Idempotent."""
        if self.sock is not None:
            if self._failed is None and self.proc.poll() is None:
                try:
                    self.sock.settimeout(10)
                    send_message(self.sock, {"op": "shutdown"})
                    recv_message(self.sock)
                except (OSError, PeerClosed):
                    pass
            self.sock.close()
            self.sock = None
        if self._failed is None:  # a failed worker is killed at once below
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        clean = self._failed is None and self.proc.poll() == 0
        self._finalizer()  # kills the worker if it is still there, removes the socket directory
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        if clean and self._own_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- failure reporting -------------------------------------------------------------------------

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> list[str]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return [line.strip() for line in text.splitlines() if line.strip()][-lines:]

    def _fail(self, what: str) -> NoReturn:
        tail = " | ".join(self.log_tail()) or "(empty)"
        self._failed = f"rollout worker {self.backend} (pid {self.pid}) {what}; log {self.log_path}, last lines: {tail}"
        raise RolloutWorkerError(self._failed)

    def _check_alive(self, doing: str) -> None:
        code = self.proc.poll()
        if code is not None:
            self._fail(f"died with exit code {code} while {doing}")

    def _died(self, doing: str) -> NoReturn:
        """The connection broke: wait for the exit code (briefly), then report."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self._fail(f"closed its connection while {doing} but is still running")
        self._fail(f"died with exit code {code} while {doing}")

    # --- requests ----------------------------------------------------------------------------------

    def _send(self, header: dict[str, Any], payload: Any = None) -> None:
        if self._failed is not None:
            raise RolloutWorkerError(self._failed)
        if self.sock is None:
            raise RolloutWorkerError(f"rollout worker {self.backend} is closed; start a new RolloutClient")
        try:
            send_message(self.sock, header, payload, on_idle=lambda: self._check_alive(f"receiving {header['op']!r}"))
        except OSError:
            self._died(f"receiving {header['op']!r}")

    def _reply(self, op: str) -> tuple[dict[str, Any], memoryview]:
        deadline = None if self.response_timeout_s is None else time.monotonic() + self.response_timeout_s

        def waiting() -> None:
            self._check_alive(f"handling {op!r}")
            if deadline is not None and time.monotonic() > deadline:
                # Alive but silent: stopped, deadlocked or far slower than allowed. Killed, so that
                # nothing it might still send can be read as the reply to a later request.
                self.proc.kill()
                self._fail(
                    f"sent no reply to {op!r} within {self.response_timeout_s:g} s (rollout.response_timeout_s)"
                    " although it was still running; it was killed. Raise rollout.response_timeout_s if a batch"
                    " legitimately takes longer"
                )

        while True:
            try:
                reply, payload = recv_message(self.sock, on_idle=waiting)
            except (PeerClosed, OSError):
                self._died(f"handling {op!r}")
            if op == "generate" or reply.get("op") != "generate":
                break
            self._ready.append((reply, payload))  # a generation finished while a control request waited
        self.worker_idle_s = float(reply.get("idle_s", self.worker_idle_s))
        if not reply.get("ok"):
            raise RolloutWorkerError(f"rollout worker {self.backend} refused {op!r}: {reply.get('error')}")
        return reply, payload

    def _request(self, header: dict[str, Any], payload: Any = None) -> tuple[dict[str, Any], memoryview]:
        self._require_idle(header["op"])
        self._send(header, payload)
        return self._reply(header["op"])

    def _require_idle(self, op: str) -> None:
        if self._outstanding and not self.concurrent:
            raise RolloutWorkerError(f"{op!r} sent with {self._outstanding} generation(s) outstanding; collect() them first")

    @property
    def outstanding(self) -> int:
        """Generate requests submitted and not yet collected."""
        return self._outstanding

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Generation:
        """Sample one response per prompt (token ids, unpadded). Same seed + weights: same tokens."""
        self.submit(prompts, params, seed)
        return self.collect()

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
        *,
        priority: bool = False,
        interruptible: bool = False,
    ) -> int:
        """Send a generate request and return at once; the worker samples with the weights it holds
        when it reaches the request (generations are handled in order, a `priority` one before the
        others), `collect` reads the samples. `interruptible`: a weight update arriving mid-way
        applies at the next token, the rest of the rows sampled with the new weights. Returns the
        request's id."""
        request = GenerateRequest(
            [[int(t) for t in p] for p in prompts],
            params.temperature,
            params.top_p,
            params.max_new_tokens,
            int(seed),
            list(stop_token_ids(self.tokenizer)),
            int(self.tokenizer.pad_token_id),
        )
        flags = {"priority": True} if priority else {}
        flags |= {"interruptible": True} if interruptible else {}
        self._send(request.to_json() | flags | {"id": self._next_id})
        self._next_id += 1
        self._outstanding += 1
        return self._next_id - 1

    def collect(self, request_id: int | None = None) -> Generation:
        """The samples of the oldest generation replied (blocks until the worker has one), or of
        request `request_id` (submit's return value; replies read before it wait for their turn)."""
        if not self._outstanding:
            raise RolloutWorkerError("collect() with no generate request outstanding; submit() one first")
        self._outstanding -= 1  # even if the worker fails now: nothing else will answer the request
        while True:
            found = [i for i, (r, _) in enumerate(self._ready) if request_id is None or r.get("id") == request_id]
            if found:
                reply, payload = self._ready[found[0]]
                del self._ready[found[0]]
                break
            self._ready.append(self._reply("generate"))
        if not reply.get("ok"):
            raise RolloutWorkerError(f"rollout worker {self.backend} refused 'generate': {reply.get('error')}")
        return generation_from_reply(reply, payload)

    def fingerprint(self, meanwhile: Callable[[], None] | None = None) -> str:
        """The worker's weights_fingerprint (compare with the trainer's, rounded to `self.dtype`).

        `meanwhile` runs here while the worker hashes (the trainer's own fingerprint): both sides
        hash at once, so a sync's guard costs one hash of the weights, not two in a row."""
        self._require_idle("fingerprint")
        self._send({"op": "fingerprint"})
        try:
            if meanwhile is not None:
                meanwhile()
        finally:  # the reply is read even if `meanwhile` failed: a later request must not get it
            reply = self._reply("fingerprint")
        return reply[0]["fingerprint"]

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_mb: float = 256,
        transport: str = "shm",
        version: int | None = None,
    ) -> SyncStats:
        """Send tensors (e.g. `policy.named_parameters()`) in buckets of ~bucket_mb; the worker copies them in.
        `version`: the policy version they are (the worker tags what it samples with it).

        transport "shm": bytes go through a shared memfd (two slots, so packing bucket i+1 overlaps
        the worker loading bucket i); "socket": bytes follow each header on the socket.
        """
        if transport not in ("shm", "socket"):
            raise RolloutWorkerError(f"unknown weight transport {transport!r}; use 'shm' or 'socket'")
        start = time.monotonic()
        bucket_bytes = max(1, int(bucket_mb * MB))
        self._request({"op": "begin_update"})
        pending = buckets = tensors = sent = 0
        errors: list[str] = []
        for index, bucket in enumerate(iter_buckets(named_tensors, bucket_bytes)):
            if transport == "shm" and (self._staging is None or bucket.nbytes > self._staging.slot_bytes):
                errors += self._acks(pending)
                pending = 0
                self._attach_staging(max(bucket_bytes, bucket.nbytes))
            if pending == 2:  # the slot (or inline buffer) about to be reused must be free
                errors += self._acks(1)
                pending -= 1
            header = {"op": "load_bucket", "index": index, "nbytes": bucket.nbytes}
            header["tensors"] = [e.to_json() for e in bucket.entries]
            if transport == "shm":
                offset = self._staging.slot_offset(index)
                pack_bucket(bucket, self._staging.buffer[offset : offset + bucket.nbytes])
                self._send(header | {"source": "staging", "offset": offset})
            else:
                if self._inline.numel() < bucket.nbytes:
                    self._inline = torch.empty(bucket.nbytes, dtype=torch.uint8)
                pack_bucket(bucket, self._inline)
                self._send(header | {"source": "inline"}, memoryview(self._inline[: bucket.nbytes].numpy()))
            pending += 1
            buckets, tensors = buckets + 1, tensors + len(bucket.entries)
            sent += sum(e.nbytes for e in bucket.entries)
        errors += self._acks(pending)
        if errors:
            raise RolloutWorkerError(f"rollout worker {self.backend} rejected a weight bucket: {errors[0]}")
        end = {"op": "end_update", "buckets": buckets} | ({"version": int(version)} if version is not None else {})
        reply, _ = self._request(end)
        if reply["buckets"] != buckets or reply["tensors"] != tensors:
            raise RolloutWorkerError(
                f"rollout worker {self.backend} applied {reply['buckets']} buckets / {reply['tensors']} tensors"
                f" of {buckets} / {tensors} sent; the connection lost messages: restart the worker"
            )
        seconds = time.monotonic() - start
        return SyncStats(seconds, sent, sent / max(seconds, 1e-9) / 1e9, buckets, tensors, transport)

    def _acks(self, count: int) -> list[str]:
        """Read `count` bucket replies; errors are collected so the stream stays in step."""
        errors = []
        for _ in range(count):
            try:
                self._reply("load_bucket")
            except RolloutWorkerError as exc:
                if self._failed is not None:
                    raise
                errors.append(str(exc))
        return errors

    def _attach_staging(self, slot_bytes: int) -> None:
        if self._staging is not None:
            self._staging.close()
        self._staging = Staging(slot_bytes)
        self._send({"op": "attach_staging", "nbytes": slot_bytes * self._staging.slots})
        try:  # one byte carrying the memfd (SCM_RIGHTS): the worker maps the same pages, nothing is named
            socket.send_fds(self.sock, [b"F"], [self._staging.fd])
        except OSError:
            self._died("receiving the staging buffer")
        self._reply("attach_staging")


def _peer_pid(conn: socket.socket) -> int | None:
    """The connecting process id (Linux SO_PEERCRED), or None where the platform cannot say."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]
