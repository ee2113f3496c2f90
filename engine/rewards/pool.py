"""Scores batches with the function and rule reward sources in worker processes.

The caller (PPO) submits a chunk of samples and keeps generating; `future.result()` later gives
each source's raw scores. A batch is cut into contiguous slices, one per worker. Each call of a
function or rule is limited to reward.timeout_s by SIGALRM inside the worker. A call the alarm
cannot stop (stuck in C code, the alarm blocked) is the parent's backstop's: once a worker has made
no progress for timeout_s + backstop_grace_s (noticed within 1.25x that), it is killed, and a new
one starts with the next batch.

Workers are fresh interpreters (`python -c`, the parent's sys.path) that import only this module,
the rules and the user's functions. Not multiprocessing's spawn or forkserver: both re-import the
parent's `__main__` in every worker, and on a training rank that is `rlflow.engine.stages.worker`, which
imports torch (seconds and hundreds of MB per worker). Not fork: the parent holds torch threads.

Protocol on each worker's pipe: parent -> worker: sys.path, then {"sources", "timeout_s"}; then
per slice (prompts, responses, fields, stop_on_error), or None to stop. Worker -> parent: None
(ready) or an error text; then per slice lists of call outcomes, sample-major: a float (the score)
or a str (what went wrong); None ends the slice. Outcomes are sent in chunks (at most every
_FLUSH_S), since one message per call costs more than a rule call; the worker also counts the calls
it has started in a shared 8-byte file mapping, so the parent sees progress between chunks and
knows which call hung.
"""

from __future__ import annotations

import mmap
import queue
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Pipe, wait
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rlflow.engine.data.conversations import prompt_text
from rlflow.engine.errors import ConfigError, RewardSourceError
from rlflow.engine.rewards.pool_worker import CALL_COUNTER, build_scorer, check_function_kwargs, source_spec

if TYPE_CHECKING:
    from rlflow.engine.config.methods import RewardSourceConfig

_BOOT = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from rlflow.engine.rewards.pool_worker import worker_main\n"
    "worker_main(conn, int(sys.argv[2]))\n"
)
_CLOSED = "the reward pool was closed before this batch was scored"
_MAX_READS = 100  # messages read from one worker before the others (and the backstop) get a look


@dataclass(frozen=True)
class SourceScores:
    """One batch's function and rule scores."""

    scores: dict[str, list[float]]  # per source name: one raw (unweighted) score per sample, batch order
    skipped: dict[str, int]  # per source name: samples scored 0.0 after a failed call (on_error=skip)
    # Per source that skipped any: the message of its failure on the lowest sample index (for a log).
    errors: dict[str, str] = field(default_factory=dict)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, init: dict[str, Any]):
        parent_end, child_end = Pipe(duplex=True)
        with tempfile.TemporaryFile() as file:  # unlinked: gone with the last mapping
            file.truncate(CALL_COUNTER.size)
            self.counter = mmap.mmap(file.fileno(), CALL_COUNTER.size)
            fds = (child_end.fileno(), file.fileno())
            # stdout=2: a function's print() must not land in the parent's stdout (rank 0's event lines).
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, *map(str, fds)], pass_fds=fds, stdin=subprocess.DEVNULL, stdout=2
            )
        child_end.close()  # else the parent would never see EOF when the worker dies
        self.conn = parent_end
        self.conn.send(list(sys.path))
        self.conn.send(init)

    def wait_ready(self, timeout_s: float) -> str | None:
        """None once the worker has built its sources, else what went wrong."""
        try:
            if not self.conn.poll(timeout_s):
                return f"did not start within {timeout_s:g} s"
            return self.conn.recv()
        except (EOFError, OSError):
            return f"exited with code {self.proc.wait()} while starting"

    def kill(self) -> int:
        """Stop the process and reap it (no zombie); returns its exit code. The pipe stays open:
        the pool's thread may be reading it (it sees EOF) and closes it with `close`."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def started(self) -> int:
        """Calls the worker has started since it was born."""
        return CALL_COUNTER.unpack_from(self.counter)[0]

    def close(self) -> int:
        code = self.kill()
        self.conn.close()
        self.counter.close()
        return code


@dataclass
class _Job:
    future: Future
    prompts: list[str]
    responses: list[str]
    fields: list[dict[str, Any]]


@dataclass
class _Slice:
    worker: _Worker
    slot: int
    start: int  # batch index of its first sample
    stop: int
    base: int  # worker.started() when the slice was sent
    seen: int  # worker.started() when last looked at
    last_s: float  # time.monotonic() of the worker's last sign of progress
    calls: int = 0  # outcomes received, sample-major


class _Closed(Exception):
    """The pool was closed under a batch."""


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` samples in at most `parts` contiguous, near-equal, non-empty slices."""
    parts = min(parts, n)
    sizes = [n // parts + (p < n % parts) for p in range(parts)]  # the first n % parts get one more
    cuts = [sum(sizes[:p]) for p in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


class _Batch:
    """The scores of one job as they arrive, and the error policy applied to each failed call."""

    def __init__(self, pool: RewardFunctionPool, job: _Job):
        self.pool, self.job = pool, job
        names = [spec["name"] for spec in pool._specs]
        self.scores = {name: [0.0] * len(job.prompts) for name in names}
        self.skipped = dict.fromkeys(names, 0)
        self.first_error: dict[str, tuple[int, str]] = {}  # per source: its failure of the lowest sample index

    def record(self, index: int, source: int, outcome: float | str) -> None:
        spec = self.pool._specs[source]
        if not isinstance(outcome, str):
            self.scores[spec["name"]][index] = outcome
            return
        what = f"fn {spec['fn']}" if spec["type"] == "function" else f"type {spec['type']}"
        prompt, response = prompt_text(self.job.prompts[index]), self.job.responses[index]
        message = (
            f"reward source {spec['name']!r} ({what}) failed on sample {index} "
            f"(prompt {prompt[:60]!r}, response {response[:60]!r}): {outcome}"
        )
        if spec["on_error"] == "fail":
            if not self.job.future.done():  # the first failure is the one reported; the rest drain
                self.job.future.set_exception(RewardSourceError(message))
            return
        self.skipped[spec["name"]] += 1
        known = self.first_error.get(spec["name"])
        if known is None or index < known[0]:  # slices report out of order
            self.first_error[spec["name"]] = (index, message)

    def result(self) -> SourceScores:
        return SourceScores(self.scores, self.skipped, {k: m for k, (_, m) in self.first_error.items()})


class RewardFunctionPool:
    """Worker processes that score the function and rule reward sources of submitted batches.

    `sources`: reward.sources items of any type but model; `workers`, `timeout_s` (per call, s) and
    `on_error` ("fail" | "skip") as in RewardConfig. Construction validates every source in this
    process (ConfigError: unknown module, bad rule kwargs) and waits until each worker has built
    them too (about 0.1-0.3 s). Use as a context manager or call `close()`.

    A function is called `fn(prompt, response, **fields, **kwargs)` and returns a number (a bool
    counts) or a mapping with a "score"; anything else, a non-finite value, an exception or a
    timeout is a failed call, handled by `on_error`.
    """

    def __init__(
        self,
        sources: Sequence[RewardSourceConfig],
        workers: int = 2,
        timeout_s: float = 10.0,
        on_error: str = "fail",
        *,
        backstop_grace_s: float = 5.0,
        start_timeout_s: float = 60.0,
    ):
        if on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
        if not sources or any(s.type == "model" for s in sources):
            raise ValueError(f"RewardFunctionPool takes function and rule sources, got {[s.type for s in sources]}")
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers} and {timeout_s}")
        self._specs = [source_spec(s, on_error) for s in sources]
        for spec in self._specs:  # ConfigError here, before any process starts
            build_scorer(spec)
            if spec["type"] == "function":
                check_function_kwargs(spec)
        self.on_error, self.timeout_s = on_error, float(timeout_s)
        self._backstop_s = self.timeout_s + backstop_grace_s
        self._start_timeout_s = start_timeout_s
        self._init = {"sources": self._specs, "timeout_s": self.timeout_s}
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker | None] = [None] * workers
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        try:
            self._start_missing_workers()
        except BaseException:
            self._closed = True
            for worker in self._workers:
                if worker is not None:
                    worker.close()
            raise
        self._thread = threading.Thread(target=self._dispatch, name="reward-pool", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (diagnostics and tests)."""
        return [w.proc.pid for w in self._workers if w is not None]

    def submit(
        self, prompts: Sequence[str], responses: Sequence[str], fields: Sequence[Mapping[str, Any]]
    ) -> Future[SourceScores]:
        """Queue a batch and return at once. `.result()` gives its SourceScores, or raises
        RewardSourceError (on_error=fail) or RuntimeError (the pool was closed first)."""
        if not len(prompts) == len(responses) == len(fields):
            raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses and {len(fields)} field rows")
        job = _Job(Future(), list(prompts), list(responses), [dict(f) for f in fields])
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward pool is closed")
            self._jobs.put(job)
        return job.future

    def close(self) -> None:
        """Kill the workers (reaped: no zombies) and fail batches not yet scored. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._kill_all()  # an in-flight batch sees its pipes close and stops
        if threading.current_thread() is not self._thread:  # not from a future's done-callback
            self._thread.join()
        for worker in self._workers:
            if worker is not None:
                worker.close()

    def __enter__(self) -> RewardFunctionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _kill_all(self) -> None:
        for worker in list(self._workers):
            if worker is not None:
                worker.kill()

    def _start_missing_workers(self) -> None:
        """Start a worker in each empty slot (all at once: start-up is mostly waiting)."""
        with self._lock:
            if self._closed:
                raise _Closed
            started = [slot for slot, w in enumerate(self._workers) if w is None]
            for slot in started:
                self._workers[slot] = _Worker(self._init)
        for slot in started:
            error = self._workers[slot].wait_ready(self._start_timeout_s)
            if error is not None:
                self._workers[slot].close()
                self._workers[slot] = None
                if self._closed:
                    raise _Closed
                raise ConfigError(f"reward.sources: a reward worker process could not load them: {error}")

    def _dispatch(self) -> None:
        """The pool's thread: runs the queued batches one after another."""
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                self._start_missing_workers()
                result = self._score(job)
            except BaseException as exc:  # never leave a caller waiting on a batch
                if not job.future.done():
                    job.future.set_exception(RuntimeError(_CLOSED) if self._closed else exc)
                if self._closed:  # pipes closed under it: an OSError here means the same
                    break
                continue
            if not job.future.done():
                job.future.set_result(result)
        while not self._jobs.empty():
            job = self._jobs.get()
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError(_CLOSED))

    def _score(self, job: _Job) -> SourceScores:
        batch = _Batch(self, job)
        stop_on_error = tuple(spec["on_error"] == "fail" for spec in self._specs)
        pending: dict[Connection, _Slice] = {}
        for slot, (start, stop) in enumerate(_split(len(job.prompts), len(self._workers))):
            # Idle workers (the previous batch drained them): their counters stand still.
            worker = self._workers[slot]
            piece = (job.prompts[start:stop], job.responses[start:stop], job.fields[start:stop], stop_on_error)
            part = _Slice(worker, slot, start, stop, worker.started(), worker.started(), time.monotonic())
            try:
                worker.conn.send(piece)
            except OSError:
                self._abandon(part, batch, "its worker process had died")
                continue
            pending[worker.conn] = part
        while pending:
            # Also wake every quarter backstop: a worker's counter can move without a message.
            oldest = min(p.last_s for p in pending.values())
            timeout = min(oldest + self._backstop_s - time.monotonic(), self._backstop_s / 4)
            for conn in wait(list(pending), max(0.0, timeout)):
                self._receive(pending, conn, batch)
            now = time.monotonic()
            for conn, part in list(pending.items()):
                if part.worker.started() != part.seen:  # a call began since: its clock starts now at the latest
                    part.seen, part.last_s = part.worker.started(), now
                if now - part.last_s > self._backstop_s:
                    del pending[conn]
                    reason = (
                        f"exceeded reward.timeout_s={self.timeout_s} s and did not stop (no progress for "
                        f"{self._backstop_s:g} s: the timeout signal could not interrupt it); its worker was killed"
                    )
                    self._abandon(part, batch, reason)
        return batch.result()

    def _receive(self, pending: dict[Connection, _Slice], conn: Connection, batch: _Batch) -> None:
        """Read every message waiting on `conn`."""
        part, sources = pending[conn], len(self._specs)
        for _ in range(_MAX_READS):
            try:
                outcome = conn.recv()
            except (EOFError, OSError):
                del pending[conn]
                if self._closed:
                    raise _Closed from None
                self._abandon(part, batch, f"its worker process died (exit code {part.worker.kill()})")
                return
            if outcome is None:
                del pending[conn]
                return
            part.seen, part.last_s = part.worker.started(), time.monotonic()
            for value in outcome:
                batch.record(part.start + part.calls // sources, part.calls % sources, value)
                part.calls += 1
            if not conn.poll():
                return

    def _abandon(self, part: _Slice, batch: _Batch, reason: str) -> None:
        """Kill a slice's worker (a new one starts with the next batch). Its call in progress failed
        with `reason`; the slice's other calls without a reported outcome (scored but not yet sent,
        or never made) fail with "no score"."""
        if self._closed:
            raise _Closed
        sources, total = len(self._specs), (part.stop - part.start) * len(self._specs)
        current = min(max(part.worker.started() - part.base - 1, part.calls), total - 1)
        part.worker.close()
        with self._lock:
            if self._workers[part.slot] is part.worker:
                self._workers[part.slot] = None
        where = f"sample {part.start + current // sources}'s source {self._specs[current % sources]['name']!r}"
        for call in range(part.calls, total):
            outcome = reason if call == current else f"no score: its worker was killed after {where} failed"
            batch.record(part.start + call // sources, call % sources, outcome)
