"""A second copy of every committed checkpoint step (``checkpoint.mirror``), kept in the background.

After a stage commits a step to its primary store, rank 0 hands the step number to
``CheckpointMirror.submit``; a thread copies it to the mirror store at the same relative layout
(files first, the manifest LAST, so the mirror's copy is committed only once whole, like any
step), then the stage's final.json once its step is there. Copies retry with exponential backoff.
A mirror outage never stops training: it is warned about once, the steps the mirror lacks stay
on the primary (``protected``: keep_last spares them) and are copied when it is back, newest
first, since the newest step is what a recovery needs; older ones that keep_last would have
pruned by then are skipped. The mirror itself keeps ``keep_last`` steps (plus its final step and
the steps the stage protects, e.g. keep_best).

On resume, ``repair`` verifies a primary step against its manifest (sha256 of every file) and
copies it back from the mirror when it is gone or damaged; ``repair_final`` does the same for a
finished stage's final.json and step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.execution import CheckpointConfig
from rlflow.engine.errors import CheckpointError
from rlflow.engine.telemetry.metrics import MetricsSink

log = logging.getLogger(__name__)
T = TypeVar("T")

LAG_METRIC = "checkpoint/mirror_lag_steps"
MAX_BACKOFF_S = 60.0  # cap of the exponential backoff between attempts
FINISH_WAIT_S = 300.0  # how long a stage's end waits for the mirror to catch up before going on
_JOIN_S = 30.0  # how long close() waits for a copy in flight; the daemon thread stops after it


def make_mirror(
    primary: CheckpointStore, cfg: CheckpointConfig, run_name: str, round_index: int, stage: str
) -> CheckpointMirror | None:
    """The mirror of one stage's store, or None without ``checkpoint.mirror``. Its URL is the
    primary's with run.root replaced by the mirror URL: ``{mirror}/{run}/round_{r}/{stage}``."""
    if not cfg.mirror:
        return None
    replica = CheckpointStore(stage_prefix(cfg.mirror, run_name, round_index, stage), cfg.mirror_storage_options)
    return CheckpointMirror(primary, replica, cfg.keep_last, cfg.mirror_retries, cfg.mirror_backoff_s)


class _Closed(Exception):
    """Raised inside the thread at its next storage operation once ``close`` was called."""


def _manifest_sha(store: CheckpointStore, step: int) -> str | None:
    """sha256 of a step's manifest, None when the step is not committed there."""
    try:
        return store.manifest_sha256(step)
    except CheckpointError:
        return None


def _brief(exc: BaseException) -> str:
    """An error in one line for the log. Storage options are never part of it: no call gets them."""
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


class CheckpointMirror:
    """Copies one stage store's committed steps to a replica store; see the module docstring.

    The training thread calls ``submit``/``submit_final``/``protected``/``lag_steps``/``close``;
    one background thread (started by the first submit, on rank 0 only) does the copying.
    """

    def __init__(
        self,
        primary: CheckpointStore,
        replica: CheckpointStore,
        keep_last: int,
        retries: int = 8,
        backoff_s: float = 1.0,
        finish_wait_s: float = FINISH_WAIT_S,
    ):
        self.primary, self.replica = primary, replica
        self.keep_last, self.retries, self.backoff_s, self.finish_wait_s = keep_last, retries, backoff_s, finish_wait_s
        self._cond = threading.Condition()  # guards the fields below; notified whenever they change
        self._stop = threading.Event()
        self._pending: set[int] = set()  # committed on the primary, wanted on the mirror, not there yet
        self._keep: set[int] | None = None  # what the last save protects (keep_best); None: no save yet
        self._final: int | None = None  # step whose final.json is to be copied once the step is there
        self._retry_at = 0.0  # time.monotonic() before which the thread does not try again
        self._failures = 0  # consecutive failed attempts (for the backoff)
        self._outage_since: float | None = None  # set while the mirror fails: warn once per outage
        self._reconciled = False
        self._thread: threading.Thread | None = None

    # -- training side ---------------------------------------------------------------------------
    def submit(self, step: int, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Queue a step just committed on the primary; ``keep``: steps the stage protects."""
        with self._cond:
            self._pending.add(step)
            self._keep = set(keep)
            self._retry_at = 0.0  # new work is tried at once, even during an outage's backoff
            self._cond.notify_all()
        self._start()

    def submit_final(self, step: int) -> None:
        """Queue the stage's final.json (already written on the primary) and its step."""
        with self._cond:
            self._pending.add(step)  # copied unless the mirror already holds it byte for byte
            self._final, self._retry_at = step, 0.0
            self._cond.notify_all()
        self._start()

    def protected(self) -> set[int]:
        """Steps a prune of the primary must spare: not yet on the mirror, or protected by the stage.
        (During a long outage the primary grows by a step per checkpoint: the newest step on two
        stores is the promise; `checkpoint/mirror_lag_steps` shows the debt.)"""
        with self._cond:
            return self._pending | (self._keep or set())

    @property
    def saved(self) -> bool:
        """Whether a save in this process submitted a step (so ``protected`` knows the stage's own)."""
        with self._cond:
            return self._keep is not None

    def lag_steps(self) -> int:
        """Committed primary steps the mirror does not hold yet (the ``checkpoint/mirror_lag_steps`` metric)."""
        with self._cond:
            return len(self._pending)

    @property
    def failing(self) -> bool:
        """Whether the mirror's last attempt failed (an outage in progress)."""
        with self._cond:
            return self._outage_since is not None

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds until everything submitted is mirrored; True if it is."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout=timeout_s)

    def close(self, wait_s: float = 0.0) -> bool:
        """Wait up to ``wait_s`` seconds for the mirror to catch up, then stop the thread; return
        whether it caught up. A file copy in flight is waited for up to 30 s; the (daemon) thread
        ends right after it, leaving an uncommitted step on the mirror. Safe to call twice."""
        if self._stop.is_set():
            with self._cond:
                return self._idle()
        caught_up = self.wait(wait_s)
        if not caught_up:
            with self._cond:
                left = f"{len(self._pending)} step(s)" + (" and final.json" if self._final is not None else "")
            log.warning(
                "checkpoint mirror %s: %s still not copied after %.0f s; going on without them "
                "(they stay on the primary; a resumed run copies them)",
                self.replica.url,
                left,
                wait_s,
            )
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(_JOIN_S)
        return caught_up

    def _idle(self) -> bool:
        return not self._pending and self._final is None

    def _start(self) -> None:
        with self._cond:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="rlflow-checkpoint-mirror", daemon=True)
                self._thread.start()

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._next_attempt():
            try:
                self._work_once()
            except _Closed:
                return
            except Exception as exc:  # an outage (or any storage error) never ends the thread
                self._failed(exc)
            else:
                self._succeeded()

    def _next_attempt(self) -> bool:
        """Block until there is work and its backoff has passed; False once closed."""
        with self._cond:
            while not self._stop.is_set():
                delay = self._retry_at - time.monotonic()
                if not self._idle() and delay <= 0:
                    return True
                self._cond.wait(delay if not self._idle() else None)
            return False

    def _work_once(self) -> None:
        """Copy the newest pending step, or else the final.json; raise if the mirror fails."""
        if not self._reconciled:
            self._reconcile()
        with self._cond:
            step, final = max(self._pending, default=None), self._final
        if step is not None:
            self._mirror_step(step)
        elif final is not None:
            try:
                self._retrying(lambda: self.replica.copy_final_from(self.primary))
            except CheckpointError as exc:  # its step could not be mirrored: a copy would dangle
                log.error("checkpoint mirror %s: final.json not copied: %s", self.replica.url, exc)
            with self._cond:
                if self._final == final:
                    self._final = None
                self._cond.notify_all()

    def _reconcile(self) -> None:
        """Queue the primary's committed steps the mirror lacks: a previous process may have ended
        (crashed, failed) before its copies were done."""
        for step in self._retrying(self.primary.committed_steps):
            if self._retrying(lambda s=step: _manifest_sha(self.replica, s)) != _manifest_sha(self.primary, step):
                with self._cond:
                    self._pending.add(step)
        self._reconciled = True

    def _mirror_step(self, step: int) -> None:
        sha = self._retrying(lambda: _manifest_sha(self.primary, step))
        if sha is None:  # pruned or deleted on the primary meanwhile: nothing left to copy
            self._done(step, mirrored=False)
            return
        if self._retrying(lambda: _manifest_sha(self.replica, step)) != sha:
            try:
                self.replica.copy_step_from(self.primary, step, self._retrying)
            except CheckpointError as exc:  # the primary's copy is damaged or went away: retrying cannot help
                if _manifest_sha(self.primary, step) is not None:
                    log.error("checkpoint mirror %s: step %d not copied: %s", self.replica.url, step, exc)
                self._done(step, mirrored=False)
                return
        self._done(step, mirrored=True)
        self._retrying(lambda: self.replica.prune(self.keep_last, protect=self.protected()))

    def _done(self, step: int, mirrored: bool) -> None:
        """Take `step` off the queue. Once it is mirrored, older queued steps that keep_last would
        prune on the primary anyway are skipped: the mirror already holds a newer one."""
        window = set(self._retrying(self.primary.committed_steps)[-self.keep_last :]) if mirrored else None
        with self._cond:
            self._pending.discard(step)
            if window is not None:
                wanted = window | (self._keep or set()) | ({self._final} if self._final is not None else set())
                self._pending = {s for s in self._pending if s > step or s in wanted}
            self._cond.notify_all()

    def _delay(self, attempt: int) -> float:
        """Seconds before retry number ``attempt + 1``: backoff_s doubled per attempt, capped at 60."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** min(attempt, 32))

    def _retrying(self, fn: Callable[[], T]) -> T:
        """Run one storage operation, retrying it ``retries`` times with exponential backoff.
        CheckpointError is about content, not connectivity: it is never retried. After ``close``
        it raises _Closed instead, so a step copy stops at the next file."""
        for attempt in range(self.retries + 1):
            if self._stop.is_set():
                raise _Closed
            try:
                return fn()
            except CheckpointError:
                raise
            except Exception:  # network and storage errors of any client library
                if attempt == self.retries:
                    raise
                self._stop.wait(self._delay(attempt))
        raise AssertionError("unreachable")

    def _failed(self, exc: Exception) -> None:
        """An attempt failed after its retries: back off further, warn once per outage."""
        with self._cond:
            self._failures += 1
            self._retry_at = time.monotonic() + self._delay(self.retries + self._failures - 1)
            first, lag = self._outage_since is None, len(self._pending)
            if first:
                self._outage_since = time.monotonic()
        if first:
            log.warning(
                "checkpoint mirror %s is failing (%s); training goes on, %d step(s) wait on the primary and are "
                "copied when it is back (retrying with backoff up to %.0f s)",
                self.replica.url,
                _brief(exc),
                lag,
                MAX_BACKOFF_S,
            )
        else:
            log.debug("checkpoint mirror %s still failing: %s", self.replica.url, _brief(exc))

    def _succeeded(self) -> None:
        with self._cond:
            since, self._outage_since, self._failures = self._outage_since, None, 0
            lag = len(self._pending)
        if since is not None:
            log.warning(
                "checkpoint mirror %s is back after %.0f s; %d step(s) left to copy",
                self.replica.url,
                time.monotonic() - since,
                lag,
            )

    # -- restore side (rank 0, before training) --------------------------------------------------
    def mirrored_steps(self) -> list[int]:
        """Committed steps on the mirror; [] with a warning when it cannot be read (an outage
        never stops a stage from starting)."""
        try:
            return self.replica.committed_steps()
        except Exception as exc:  # unreachable or unreadable: the primary alone decides
            log.warning(
                "checkpoint mirror %s cannot be listed (%s); resuming from the primary only",
                self.replica.url,
                _brief(exc),
            )
            return []

    def repair(self, step: int, quick: bool = False) -> bool:
        """Make the primary's copy of ``step`` whole: verify every file's sha256 (`quick`: only that
        each exists with its size); when the step is gone or damaged, verify the mirror's copy and
        copy it back (manifest last).

        Returns True when the step was restored; raises CheckpointError naming the damaged file
        when the mirror has no good copy."""
        try:
            (self.primary.check_sizes if quick else self.primary.verify)(step)
            return False
        except CheckpointError as exc:
            damage = str(exc)
        primary_sha = _manifest_sha(self.primary, step)
        try:
            self.replica.verify(step)
            if primary_sha not in (None, self.replica.manifest_sha256(step)):
                raise CheckpointError(f"{self.replica.step_url(step)} holds another version of that step")
            self.primary.copy_step_from(self.replica, step)
        except Exception as exc:  # damaged, absent or unreachable: the primary's damage stands
            raise CheckpointError(f"{damage}; the mirror has no good copy either ({_brief(exc)})") from None
        log.warning("%s; restored step %d from the mirror %s", damage, step, self.replica.step_url(step))
        return True

    def repair_final(self) -> None:
        """Before a stage counts as finished: check the primary's final.json and its step (files
        present with their sizes; resuming re-hashes them in full), and restore them from the
        mirror when they are missing or damaged (e.g. the stage directory was deleted). Without a
        usable mirror copy nothing changes here."""
        try:
            record = self.primary.final()
        except CheckpointError:  # final.json names a step that is gone: the mirror may have both
            record = None
        if record is not None:  # every later flow run passes here: hashing a 70B step each time is too slow
            self.repair(record["step"], quick=True)
            return
        try:
            mirrored = self.replica.final()
        except Exception as exc:  # unreachable, or a dangling final.json there: nothing to restore
            log.warning("checkpoint mirror %s: final.json cannot be read (%s)", self.replica.url, _brief(exc))
            return
        if mirrored is None:
            return
        self.repair(mirrored["step"])
        self.primary.copy_final_from(self.replica)
        log.warning(
            "%s/final.json was missing or dangling; restored it (step %d) from the mirror %s",
            self.primary.url,
            mirrored["step"],
            self.replica.url,
        )


class MirrorLagSink:
    """Forwards to ``sink``, adding the mirror's lag to every logged step's metrics (so the stage
    loops report it without knowing about the mirror)."""

    def __init__(self, sink: MetricsSink, mirror: CheckpointMirror):
        self.sink, self.mirror = sink, mirror

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.sink.log_metrics({**metrics, LAG_METRIC: float(self.mirror.lag_steps())}, step)

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        self.sink.log_table(name, rows)

    def log_text(self, name: str, text: str) -> None:
        self.sink.log_text(name, text)
