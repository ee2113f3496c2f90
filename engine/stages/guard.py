"""What every training stage's step loop shares besides training: fault points, preemption on
SIGTERM, the hang watchdog, non-finite update accounting and resume timing.

A loop calls ``begin(step)`` before a step, ``end(step, metrics)`` after it, asks
``checkpoint_due`` whether to commit, and calls ``after_checkpoint`` once it has.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

from rlflow.engine.backend import dist
from rlflow.engine.errors import NonFiniteUpdates, StageHung, StagePreempted
from rlflow.engine.faults import armed, fault_point

if TYPE_CHECKING:
    from rlflow.engine.stages.context import StageContext

log = logging.getLogger(__name__)
HUNG_EXIT_CODE = 75  # a hang the stage could not be interrupted from (stuck in native code)
_UNWIND_S = 30.0  # after raising StageHung, how long the stage may take to unwind before the exit


def thread_stacks() -> str:
    """Every thread's Python stack, for a hung stage's log."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def _raise_in_thread(ident: int, exc_type: type[BaseException] | None) -> None:
    """Raise `exc_type` in another thread at its next Python instruction (a C call that never
    returns is not interrupted: the watchdog's exit covers that); None cancels a pending one."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), exc)


class StageGuard:
    """Context manager around a stage's step loop; see the module docstring."""

    def __init__(self, ctx: StageContext, resumed_from: int | None):
        self.stage, self.label, self.limits, self.sink = ctx.stage, ctx.label, ctx.limits, ctx.sink
        self.stop = ctx.stop
        self.resumed_from, self.every_steps = resumed_from, ctx.every_steps
        self.started = time.monotonic()  # the stage's start: resume_s counts model loading and restore
        self.nonfinite_in_row, self.nonfinite_total = 0, 0
        self._preempt_at: float | None = None
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._owner = threading.get_ident()
        self._thread: threading.Thread | None = None
        self._old_handler = None
        self._lock = threading.Lock()  # the watchdog fires only while the guard is still open
        self._fired = False
        self._committing = False  # a checkpoint is being written: not a hang, however long it takes

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> StageGuard:
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.limits.hang_timeout_s is not None or self._old_handler is not None:
            self._thread = threading.Thread(target=self._watch, name=f"rlflow-watchdog-{self.stage}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._lock:
            self._stop.set()
            if self._fired and exc_type is None:  # the step ended just as the watchdog fired
                _raise_in_thread(self._owner, None)
        try:
            if self._thread is not None:
                self._thread.join()
        finally:
            if self._old_handler is not None:
                signal.signal(signal.SIGTERM, self._old_handler)
        if exc_type is None and self.preempted:  # SIGTERM after the last checkpoint: finish next time
            raise StagePreempted(
                f"{self.label}: stopped by SIGTERM after its last step was committed; run the same command again "
                "to finish it"
            )

    def _on_sigterm(self, signum, frame) -> None:
        if self._preempt_at is None:
            self._preempt_at = time.monotonic()
            log.warning("%s: SIGTERM received: checkpointing at the next step boundary, then stopping", self.label)

    # -- the step loop ---------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        self._last_beat = time.monotonic()
        for event in ("step", "sigterm", "hang"):
            fault_point(self.stage, event, step)

    def poisoned(self, step: int) -> bool:
        """Fault injection: this step's loss is to become NaN."""
        return armed(self.stage, "nonfinite", step)

    def record_update(self, skipped: bool, step: int) -> dict[str, float]:
        """Count a skipped (non-finite) update; stop the stage after too many in a row.

        Raises NonFiniteUpdates; the last committed checkpoint is left as it is."""
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
        self.nonfinite_total += int(skipped)
        if skipped:
            log.warning("%s step %d: non-finite loss or gradient norm, update skipped", self.label, step)
        if self.nonfinite_in_row > self.limits.max_nonfinite_skips:
            raise NonFiniteUpdates(
                f"{self.label}: {self.nonfinite_in_row} updates in a row had a non-finite loss or gradient norm "
                f"(safety.max_nonfinite_skips={self.limits.max_nonfinite_skips}) at step {step}; the last committed "
                "checkpoint is intact: lower the learning rate or check the data, then run again"
            )
        return {"train/nonfinite_skips": float(self.nonfinite_total)}

    def end(self, step: int) -> None:
        """After a step: heartbeat; on the first step after a resume, log `checkpoint/resume_s`
        (seconds from the stage's start, models and checkpoint loading included, to this step's end)."""
        self._last_beat = time.monotonic()
        if self.resumed_from is not None and step == self.resumed_from + 1:
            self.sink.log_metrics({"checkpoint/resume_s": time.monotonic() - self.started}, step)

    @property
    def preempted(self) -> bool:
        return self._preempt_at is not None

    @property
    def stop_requested(self) -> bool:
        """A callback raised StopStage (engine/telemetry/progress.py): this step is to be the stage's last."""
        return self.stop is not None and self.stop.reason is not None

    def early_stop_metrics(self) -> dict[str, float]:
        return {"train/early_stop_step": float(self.stop.step)} if self.stop_requested else {}

    def checkpoint_due(self, step: int, last: bool) -> bool:
        """A scheduled checkpoint, the stage's last step, or a preemption (on any rank)."""
        stop = self.preempted
        if dist.world_size() > 1:  # every rank must take the same branch: the save is a collective
            stop = bool(dist.all_reduce_max(int(stop)))
            if stop and self._preempt_at is None:
                self._preempt_at = time.monotonic()
        due = last or step % self.every_steps == 0 or stop
        self._committing = due
        return due

    def suspend(self) -> None:
        """A checkpoint write outside the step loop's schedule (e.g. before a pause) is no hang."""
        self._committing = True

    def after_checkpoint(self, step: int, url: str) -> None:
        self._committing, self._last_beat = False, time.monotonic()
        if self.preempted:
            raise StagePreempted(
                f"{self.label}: stopped by SIGTERM after committing step {step} ({url}); run the same command "
                "again to continue from there"
            )

    # -- watchdog thread -------------------------------------------------------------------------
    def _watch(self) -> None:
        hang = self.limits.hang_timeout_s
        tick = min(1.0, hang / 4) if hang else 1.0
        while not self._stop.wait(tick):
            now = time.monotonic()
            if self._preempt_at is not None and now - self._preempt_at > self.limits.preempt_grace_s:
                log.error(
                    "%s: no step boundary within checkpoint.preempt_grace_s=%.0f after SIGTERM; exiting without "
                    "a new checkpoint (the last committed one is intact)\n%s",
                    self.label,
                    self.limits.preempt_grace_s,
                    thread_stacks(),
                )
                os._exit(StagePreempted.exit_code)
            if hang and not self._committing and now - self._last_beat > hang:
                self._fire_hang(hang)
                return

    def _fire_hang(self, hang: float) -> None:
        message = (
            f"{self.label}: no step finished for {hang:g} s (stage.hang_timeout_s); every thread's stack is in "
            "the log above; a retry resumes from the last committed checkpoint"
        )
        log.error("%s: hang detected; thread stacks:\n%s", self.label, thread_stacks())
        # The async-exception API raises a class, not an instance: a subclass carries the message.
        hung = type("StageHung", (StageHung,), {"__init__": lambda exc: StageHung.__init__(exc, message)})
        with self._lock:
            if self._stop.is_set():  # the guard closed meanwhile: the stage is no longer in its loop
                return
            self._fired = True
            _raise_in_thread(self._owner, hung)
        if not self._stop.wait(_UNWIND_S):
            log.error("%s: the stage did not unwind in %.0f s (stuck in native code): exiting", self.label, _UNWIND_S)
            os._exit(HUNG_EXIT_CODE)
