"""The worker side of the reward pool (engine/rewards/pool.py): a fresh interpreter that builds
each function or rule source's scorer once, then scores slices of batches, each call limited to
reward.timeout_s by SIGALRM, counting started calls in a shared mapping the parent's backstop reads.
"""

from __future__ import annotations

import inspect
import math
import mmap
import numbers
import signal
import struct
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable, Mapping

from rlflow.engine.errors import ConfigError
from rlflow.engine.rewards.rules import make_rule
from rlflow.engine.rewards.user_functions import load_function

if TYPE_CHECKING:
    from rlflow.engine.config.methods import RewardSourceConfig
_FLUSH_S = 0.02  # a worker sends its outcomes at most this often (and at the end of a slice)
CALL_COUNTER = struct.Struct("q")  # calls a worker has started, in its shared mapping


def source_spec(source: RewardSourceConfig, on_error: str) -> dict[str, Any]:
    """What a worker needs of a source, with its effective error policy (its own, else the pool's)."""
    policy = source.error_policy(on_error)
    spec = {"name": source.name, "type": source.type, "fn": source.fn, "kwargs": dict(source.kwargs)}
    return spec | {"on_error": policy}


def build_scorer(spec: Mapping[str, Any]) -> Callable[[str, str, Mapping[str, Any]], Any]:
    """The source's scorer `(prompt, response, fields) -> value`; ConfigError if it cannot be built."""
    if spec["type"] != "function":
        return make_rule(spec["type"], spec["kwargs"], spec["name"])
    fn = load_function(spec["fn"], f"reward.sources[{spec['name']}].fn")
    kwargs = spec["kwargs"]
    return lambda prompt, response, fields: fn(prompt, response, **fields, **kwargs)


def check_function_kwargs(spec: Mapping[str, Any]) -> None:
    """A kwarg the function does not take fails now rather than on every sample."""
    fn = load_function(spec["fn"], f"reward.sources[{spec['name']}].fn")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the first call will tell
        return
    try:
        signature.bind_partial("prompt", "response", **spec["kwargs"])
    except TypeError as exc:
        raise ConfigError(
            f"reward.sources[{spec['name']}].kwargs: {spec['fn']}{signature} does not accept them ({exc})"
        ) from None


_alarm_armed = False  # the handler raises only while a call runs: a late alarm after it is ignored


class _CallTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so that a function's `except Exception` lets it through."""


def _on_alarm(signum: int, frame: Any) -> None:
    if _alarm_armed:
        raise _CallTimeout


def _as_score(value: Any) -> float | str:
    """A finite float, or the text saying what is wrong with the value."""
    if isinstance(value, Mapping):
        if "score" not in value:
            return f"returned a mapping without a 'score' key (keys: {', '.join(map(str, value))})"
        value = value["score"]
    if not isinstance(value, numbers.Real):
        return f"returned {value!r:.60} ({type(value).__name__}), not a number"
    value = float(value)
    return value if math.isfinite(value) else f"returned {value}"


def _call(scorer: Callable[..., Any], prompt: str, response: str, fields: Mapping[str, Any], timeout_s: float):
    global _alarm_armed
    timed_out = f"exceeded reward.timeout_s={timeout_s} s"
    start = time.monotonic()
    try:
        try:
            _alarm_armed = True
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = scorer(prompt, response, fields)
        finally:
            _alarm_armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _CallTimeout:
        return timed_out
    except BaseException as exc:  # SystemExit too: one sample's failure must not end the worker
        return f"raised {type(exc).__name__}: {str(exc)[:500]}"
    if time.monotonic() - start > timeout_s:  # it caught the alarm itself and carried on
        return timed_out
    return _as_score(value)


def _score_slice(conn: Connection, counter: mmap.mmap, scorers: list, timeout_s: float, job: tuple) -> None:
    prompts, responses, fields, stop_on_error = job  # stop_on_error: per scorer
    started = CALL_COUNTER.unpack_from(counter)[0]
    chunk, sent_s = [], time.monotonic()
    for prompt, response, extra in zip(prompts, responses, fields):
        for scorer, stop in zip(scorers, stop_on_error):
            if chunk and time.monotonic() - sent_s >= _FLUSH_S:
                conn.send(chunk)
                chunk, sent_s = [], time.monotonic()
            started += 1
            CALL_COUNTER.pack_into(counter, 0, started)
            chunk.append(_call(scorer, prompt, response, extra, timeout_s))
            if stop and isinstance(chunk[-1], str):
                conn.send(chunk)
                return
    conn.send(chunk)


def worker_main(conn: Connection, counter_fd: int) -> None:
    """A worker process's loop (started by `_Worker`, not meant to be called otherwise)."""
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the parent decides, and a
    # worker dying under an in-flight batch would turn a clean preemption into reward failures.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        init = conn.recv()
        try:
            scorers = [build_scorer(spec) for spec in init["sources"]]
        except BaseException as exc:
            conn.send(f"{type(exc).__name__}: {exc}")
            return
        conn.send(None)
        counter = mmap.mmap(counter_fd, CALL_COUNTER.size)
        signal.signal(signal.SIGALRM, _on_alarm)
        while (job := conn.recv()) is not None:
            _score_slice(conn, counter, scorers, init["timeout_s"], job)
            conn.send(None)
    except (EOFError, OSError):  # the parent closed the pool or exited
        return
