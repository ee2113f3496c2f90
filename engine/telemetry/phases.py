"""Wall-clock phases of one step (timing_s/gen, /ref, /update_actor, ...), collected without a
dict passed down through every function of the step.

`collect_phases()` opens one step's collection; `timed(key, fn)` (or `with phase(key):`) anywhere
below it, in the same thread, adds fn's (the block's) seconds to that key (a phase repeats per chunk
and micro-batch, so its seconds add up); `add_phases` adds figures measured elsewhere (the rollout
worker's). With no collection open, `timed` only calls fn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
_OPEN: ContextVar[dict[str, float] | None] = ContextVar("rlflow_step_phases", default=None)


@contextmanager
def collect_phases() -> Iterator[dict[str, float]]:
    """The step's phases, filled in while the block runs: {"timing_s/<phase>": seconds}. Nested
    collections are separate: the inner one's phases do not reach the outer one."""
    phases: dict[str, float] = {}
    token = _OPEN.set(phases)
    try:
        yield phases
    finally:
        _OPEN.reset(token)


@contextmanager
def phase(key: str) -> Iterator[None]:
    """The block's wall seconds added to the open collection's `key` (even when it raises)."""
    started = time.monotonic()
    try:
        yield
    finally:
        add_phases({key: time.monotonic() - started})


def timed(key: str, fn: Callable[[], T]) -> T:
    """fn(), its wall seconds added to the open collection's `key`."""
    started = time.monotonic()
    out = fn()
    add_phases({key: time.monotonic() - started})
    return out


def add_phases(values: Mapping[str, float]) -> None:
    """Add these seconds (or other per-step figures) to the open collection, key by key."""
    phases = _OPEN.get()
    if phases is not None:
        for key, value in values.items():
            phases[key] = phases.get(key, 0.0) + value
