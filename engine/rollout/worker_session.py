"""The rollout worker's request loop: messages read ahead, control before generation, partial rollouts.

A reader thread takes every message off the socket as it arrives (`Inbox`), so a weight update is
seen while a generation runs. The loop answers control messages (weights, fingerprint, shutdown)
before queued generate requests, and a probe ("priority") before the other generations. A trainer
that sends control messages only with nothing outstanding (synchronous and off_policy_steps runs)
sees replies in request order, as before; an asynchronous one gets a generation's reply tagged
with its request "id" whenever it is ready.

A request marked "interruptible" (rollout.partial_rollouts) is cut at the next token when a control
message arrives: the loop serves the whole update, then continues the unfinished rows under the
new weights (their prompt plus the tokens so far, prefilled again). Each row's reply records the
policy version of each of its segments, so every token's behaviour policy is known.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import mmap
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from rlflow.engine.backend.cpu_memory import keep_freed_memory
from rlflow.engine.faults import fault_point
from rlflow.engine.rollout.weight_sync import TensorEntry
from rlflow.engine.rollout.worker import (
    BucketSource,
    GenerateRequest,
    GenerateResult,
    HFBackend,
    PeerClosed,
    ProtocolError,
    RequestError,
    WorkerBackend,
    recv_message,
    send_message,
)

log = logging.getLogger("rlflow.rollout_worker")
CONTINUATION_STREAM = 7919  # the seed stream of a partial rollout's continuations


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


class Inbox:
    """Messages read off the socket by a reader thread, in arrival order, until the peer leaves.
    An attach_staging message's file descriptor is taken with it (it follows the header)."""

    def __init__(self, sock: socket.socket):
        self.items: deque[tuple[dict[str, Any], memoryview]] = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.controls = 0  # control messages waiting
        threading.Thread(target=self._read, args=(sock,), name="inbox", daemon=True).start()

    def _read(self, sock: socket.socket) -> None:
        while True:
            try:
                header, payload = recv_message(sock)
                if header.get("op") == "attach_staging":
                    header["fds"] = socket.recv_fds(sock, 1, 1)[1]
            except (PeerClosed, ProtocolError, OSError) as exc:
                log.info("inbox closed: %s", exc)
                with self.cond:
                    self.closed = True
                    self.cond.notify_all()
                return
            with self.cond:
                self.items.append((header, payload))
                self.controls += header.get("op") != "generate"
                self.cond.notify_all()

    def control_pending(self) -> bool:
        return self.controls > 0

    def next(self, control_only: bool = False) -> tuple[dict[str, Any], memoryview] | None:
        """The next message to serve (blocks): the oldest control message, else the oldest priority
        generation, else the oldest generation. None once the peer is gone and nothing is left."""
        with self.cond:
            while True:
                item = self._pick(control_only)
                if item is not None:
                    return item
                if self.closed:
                    return None
                self.cond.wait()

    def _pick(self, control_only: bool) -> tuple[dict[str, Any], memoryview] | None:
        ranks = [
            0 if h.get("op") != "generate" else (1 if h.get("priority") else 2) for h, _ in self.items
        ]
        allowed = [r for r in ranks if r == 0 or not control_only]
        if not allowed:
            return None
        index = ranks.index(min(allowed))
        item = self.items[index]
        del self.items[index]
        self.controls -= ranks[index] == 0
        return item


class Shutdown(Exception):
    """The trainer asked the worker to exit (answered already)."""


class WorkerSession:
    """Dispatches requests to the backend; keeps the staging map, the current update's counters and
    the policy version the weights are (sent with each update's end)."""

    def __init__(self, sock: socket.socket | None, backend: WorkerBackend):
        self.sock = sock
        self.backend = backend
        self.inbox: Inbox | None = None
        self.staging: Staging | None = None
        self.buckets = self.tensors = self.bytes = 0
        self.generations = 0  # generate requests handled: the kill point "rollout:generate:<n>"
        self.idle_s = 0.0  # seconds between sending a reply and the next request arriving
        self.version = 0  # the policy version of the weights held (end_update's "version")

    def handle(self, header: dict[str, Any], payload: memoryview) -> tuple[dict[str, Any], bytes | None]:
        op = header.get("op")
        if op == "generate":
            self.generations += 1
            fault_point("rollout", "generate", self.generations)
            start = time.monotonic()
            request = GenerateRequest.from_json(header)
            result, segments = self.generate(request, bool(header.get("interruptible")))
            seconds = time.monotonic() - start
            log.info("generate: %d rows, %d tokens in %.3f s", len(result.lengths), sum(result.lengths), seconds)
            reply = {"ok": True, "lengths": result.lengths, "seconds": seconds, "segments": segments}
            return reply, result.payload()
        if op == "attach_staging":
            fds = header.get("fds") or []
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
            self.version = int(header.get("version", self.version))
            log.info("update: %d buckets, %d tensors, %.1f MB", self.buckets, self.tensors, self.bytes / 1e6)
            return {"ok": True, "buckets": self.buckets, "tensors": self.tensors, "bytes": self.bytes}, None
        if op == "fingerprint":
            return {"ok": True, "fingerprint": self.backend.fingerprint()}, None
        if op == "shutdown":
            return {"ok": True}, None
        raise RequestError(f"unknown op {op!r}")

    def generate(self, request: GenerateRequest, interruptible: bool) -> tuple[GenerateResult, list[list[list[int]]]]:
        """The request's responses, and per row its segments [[first token, version], ...]. Cut by a
        control message (interruptible), the unfinished rows go on after it under the new weights."""
        segments = [[[0, self.version]] for _ in request.prompts]
        interrupt = self.inbox.control_pending if interruptible and self.inbox is not None else None
        result = self._sample(request, interrupt)
        going = _cut_rows(result, request.max_new_tokens, request.stop_token_ids)
        if not going:  # the usual case: the backend's result as it is
            return result, segments
        ids, logprobs = _rows(result)
        rows, part = list(range(len(request.prompts))), 0
        while going:  # cut by a control message: serve it (a whole update), then go on with its weights
            self.serve_control()
            rows, part = [rows[i] for i in going], part + 1
            for i in rows:
                segments[i].append([len(ids[i]), self.version])
            sub = dataclasses.replace(
                request,
                prompts=[request.prompts[i] + ids[i] for i in rows],
                max_new_tokens=request.max_new_tokens - len(ids[rows[0]]),  # rows going on sampled alike
                seed=_continuation_seed(request.seed, part),
            )
            result = self._sample(sub, interrupt)
            for i, row_ids, row_lps in zip(rows, *_rows(result)):
                ids[i] += row_ids
                logprobs[i] += row_lps
            going = _cut_rows(result, sub.max_new_tokens, request.stop_token_ids)
        flat_ids = torch.tensor([t for row in ids for t in row], dtype=torch.int64)
        flat_lps = torch.tensor([x for row in logprobs for x in row], dtype=torch.float32)
        return GenerateResult([len(row) for row in ids], flat_ids, flat_lps), segments

    def _sample(self, request: GenerateRequest, interrupt: Callable[[], bool] | None) -> GenerateResult:
        return self.backend.generate(request) if interrupt is None else self.backend.generate(request, interrupt)

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
            source = BucketSource(torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else
                                  torch.empty(0, dtype=torch.uint8), None, 0)  # fmt: skip
        self.backend.load(entries, source)
        self.buckets += 1
        self.tensors += len(entries)
        self.bytes += sum(e.nbytes for e in entries)
        return {"ok": True, "index": header.get("index")}

    def respond(self, header: dict[str, Any], payload: memoryview) -> None:
        """Handle one message and send its reply (tagged with the op and the request's id). Every
        reply carries "idle_s": the worker's idle seconds so far (timing_s/wait_train)."""
        try:
            reply, out = self.handle(header, payload)
        except (Shutdown, PeerClosed):  # raised while a cut generation served control messages
            raise
        except RequestError as exc:
            reply, out = {"ok": False, "error": str(exc)}, None
        except Exception as exc:  # a bug or a backend failure: report it, keep serving
            log.exception("request %r failed", header.get("op"))
            reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
        tags = {"op": header.get("op")} | ({"id": header["id"]} if "id" in header else {})
        try:
            send_message(self.sock, reply | tags | {"idle_s": self.idle_s}, out)
        except OSError:  # broken pipe: the trainer died while we worked
            log.info("trainer went away before the %r reply; exiting", header.get("op"))
            raise PeerClosed("trainer gone") from None
        if header.get("op") == "shutdown":
            raise Shutdown

    def serve_control(self) -> None:
        """Serve the control messages waiting (a generation was cut for them); an update begun is
        served to its end, waiting for its buckets."""
        updating = False
        while updating or self.inbox.control_pending():
            item = self.inbox.next(control_only=True)
            if item is None:
                raise PeerClosed("trainer gone mid-update")
            self.respond(*item)
            op = item[0].get("op")
            updating = op in ("begin_update", "load_bucket", "attach_staging")

    def serve(self) -> None:
        """Answer requests until the trainer leaves or says shutdown."""
        self.inbox = Inbox(self.sock)
        while True:
            waiting = time.monotonic()
            item = self.inbox.next()
            self.idle_s += time.monotonic() - waiting
            if item is None:
                log.info("trainer closed the connection; exiting")
                return
            try:
                self.respond(*item)
            except PeerClosed:
                return
            except Shutdown:
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



def _rows(result: GenerateResult) -> tuple[list[list[int]], list[list[float]]]:
    """The result's ragged ids and log-probs as one list per row."""
    ids, logprobs = result.ids.tolist(), result.logprobs.tolist()
    starts = [sum(result.lengths[:i]) for i in range(len(result.lengths))]
    return [ids[s : s + n] for s, n in zip(starts, result.lengths)], [
        logprobs[s : s + n] for s, n in zip(starts, result.lengths)
    ]


def _cut_rows(result: GenerateResult, budget: int, stop_ids: list[int]) -> list[int]:
    """Indices of the rows that neither reached a stop id nor used the `budget` of new tokens."""
    ends = torch.tensor(result.lengths).cumsum(0) - 1
    return [
        i
        for i, n in enumerate(result.lengths)
        if n < budget and (n == 0 or int(result.ids[int(ends[i])]) not in stop_ids)
    ]


def _continuation_seed(seed: int, part: int) -> int:
    from rlflow.engine.seeds import step_seed

    return step_seed(seed, CONTINUATION_STREAM, part)


if __name__ == "__main__":
    sys.exit(main())
