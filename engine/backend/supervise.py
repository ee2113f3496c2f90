"""Supervising a distributed job: run the launcher, stream every rank's output, stop the whole
process group on failure, and name the rank that failed.

Which rank failed is decided, most reliable first, by:
0. a rank torchrun's summary lists with a non-SIGTERM exit but no failure record: it died without
   a Python exception (SIGKILL, the OOM killer, os._exit), and its peers' records are consequences.
1. failure records: a rank whose main code runs inside `record_failures()` writes
   `{rank, time_ns, exit code, traceback}` to `$RLFLOW_FAILURE_DIR` when it dies of an exception;
   the earliest record wins, so a rank that fails only because a peer vanished (gloo "Connection
   closed by peer") is not blamed. Works for both launchers (ranks on this node).
2. torchrun's own summary ("Root Cause (first observed failure)"): right when one rank dies first
   by a clear margin, but its timestamps have 1 s resolution, so near-simultaneous failures are
   ordered arbitrarily; it also covers ranks that died without a Python exception (os._exit, a
   signal, the OOM killer).
3. the first rank whose output shows a Python traceback.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from rlflow.engine.backend.launch import DistributedJobError

FAILURE_DIR_ENV = "RLFLOW_FAILURE_DIR"  # where record_failures() writes; set by run_distributed
# torchrun's per-line prefix; the default "[default<local_rank>]:" names the local rank, which is
# not the global rank on nodes other than node 0.
PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
PREFIX_TEMPLATE = "[rank${rank}]:"
_PREFIX = re.compile(r"^\[rank(\d+)\]:")
KEEP_LINES = 40  # per rank, for the error message
SHOWN_LINES = 15  # of the failing rank, in the error message
KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL for the process group
DRAIN_GRACE_S = 5.0  # launcher gone but its pipe still open (orphans): stop reading after this


# ---------------------------------------------------------------------------------------------
# The rank side: whole-line output and failure records


def line_buffered_output() -> None:
    """Make every line a rank prints reach the launcher in one write() call: call once at the
    start of a rank. Under `python -u` (DeepSpeed's launcher; PYTHONUNBUFFERED set by
    run_distributed) print() writes the text and the newline in two calls, so ranks sharing one
    pipe (DeepSpeed) interleave mid-line and torchrun's tailer can read half a line. Line
    buffering writes "text\n" at once; a single write of up to 4 KiB to a pipe is atomic."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]


@contextlib.contextmanager
def record_failures() -> Iterator[None]:
    """Wrap a rank's main code: an exception (or a non-zero SystemExit) leaving it is written to
    `$RLFLOW_FAILURE_DIR/rank<RANK>-<pid>.json` with a ns timestamp and re-raised, so the
    supervisor can tell the first failing rank from peers that failed because it vanished."""
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _write_failure_record(exc, exc.code if isinstance(exc.code, int) else 1)
        raise
    except Exception as exc:
        _write_failure_record(exc, 1)  # what Python exits with after an uncaught exception
        raise


def _write_failure_record(exc: BaseException, exit_code: int) -> None:
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    rank = os.environ.get("RANK", "")
    record = {
        "rank": int(rank) if rank.isdigit() else None,
        "time_ns": time.time_ns(),
        "exit_code": exit_code,
        "host": socket.gethostname(),
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
    }
    with contextlib.suppress(OSError):  # reporting must never hide the real error
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(folder) / f"rank{rank}-{os.getpid()}.json"
        if path.exists():  # nested record_failures(): the innermost, earliest record is the cause
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.rename(path)  # readers see whole records only


def _read_failure_records(folder: str) -> list[dict]:
    records = []
    for path in Path(folder).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: r.get("time_ns", 0))


# ---------------------------------------------------------------------------------------------
# The supervisor side: reading the job's output


@dataclass
class _JobLog:
    """What the supervisor learned from the merged output: last lines per rank (None: lines
    without a rank prefix - the launcher's own, or every line under DeepSpeed's runner) and the
    failures torchrun's summary lists ({global rank: exit code}, its root cause)."""

    lines: dict[int | None, collections.deque[str]] = field(default_factory=dict)
    first_traceback_rank: int | None = None
    summary_failures: dict[int, int] = field(default_factory=dict)
    summary_root: int | None = None
    launcher_rank_exit: int | None = None  # DeepSpeed launch.py: "... exits with return code = N"
    _section: str = ""
    _rank: int | None = None

    def add(self, rank: int | None, text: str) -> None:
        self.lines.setdefault(rank, collections.deque(maxlen=KEEP_LINES)).append(text)
        if rank is not None:
            if self.first_traceback_rank is None and "Traceback (most recent call last)" in text:
                self.first_traceback_rank = rank
            return
        self._parse_launcher_line(text)

    def _parse_launcher_line(self, text: str) -> None:
        if "Root Cause (first observed failure)" in text:
            self._section = "root"
        elif text.strip() == "Failures:":
            self._section = "other"
        elif m := re.match(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank", text):
            self._rank = int(m.group(1))
        elif (m := re.match(r"^\s*exitcode\s*:\s*(-?\d+)", text)) and self._rank is not None:
            self.summary_failures[self._rank] = int(m.group(1))
            if self._section == "root":
                self.summary_root = self._rank
        elif m := re.search(r"exits with return code = (-?\d+)", text):
            self.launcher_rank_exit = int(m.group(1))


def split_rank_prefix(line: str) -> tuple[int | None, str]:
    """ "[rank3]:text" -> (3, "text"); torch.distributed adds its own "[rank3]: " to tracebacks,
    which is dropped too when it repeats the same rank. Lines without a prefix -> (None, line)."""
    m = _PREFIX.match(line)
    if not m:
        return None, line
    rank, text = int(m.group(1)), line[m.end() :]
    return rank, text.removeprefix(f"[rank{rank}]: ")


def _reader(stream: IO[bytes], lines: queue.Queue) -> None:
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
    lines.put(None)


def _launcher_exited(pid: int) -> bool:
    """True once the launcher has exited; it stays un-reaped (a zombie holding the process
    group id) until `_stop_group`, so its group can still be killed by id safely."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped (only if someone else waited for it)
        return True


def _pump(
    proc: subprocess.Popen,
    lines: queue.Queue,
    log: _JobLog,
    on_line: Callable[[int | None, str], None],
    timeout_s: float | None,
) -> bool:
    """Hand every output line (from the reader thread's queue) to `on_line`, in the caller's
    thread, until the output ends; returns False if `timeout_s` ran out first."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    exited_at: float | None = None
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        try:
            line = lines.get(timeout=0.2 if deadline is None else max(0.0, min(0.2, deadline - now)))
        except queue.Empty:
            # Orphaned ranks can keep the pipe open after the launcher died: don't wait for them.
            if exited_at is None and _launcher_exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_GRACE_S:
                return True
            continue
        if line is None:
            return True
        rank, text = split_rank_prefix(line)
        log.add(rank, text)
        on_line(rank, text)


def _stop_group(proc: subprocess.Popen, reader: threading.Thread, grace_s: float = KILL_GRACE_S) -> None:
    """End the launcher and everything in its process group, then reap the launcher: SIGTERM
    first (torchrun and DeepSpeed's launcher forward it to their ranks), SIGKILL after `grace_s`,
    and SIGKILL for any member left once the launcher is gone (orphaned ranks)."""
    if not _launcher_exited(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while not _launcher_exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    # The launcher is un-reaped here (or still running), so the group id cannot have been reused.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # A process outside the group (one that started its own session) may still hold the pipe:
    # closing it under the reader's blocked readline would wait for that process, so leave it.
    reader.join(timeout=1.0)
    if proc.stdout is not None and not reader.is_alive():
        proc.stdout.close()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """In the main thread with SIGTERM at its default action, make SIGTERM raise SystemExit(143)
    instead of ending the process on the spot, so the job's process group is killed on the way
    out. Elsewhere (a worker thread, or a handler someone else installed) nothing changes."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def unwind(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_distributed(
    cmd: list[str],
    env: dict[str, str],
    on_line: Callable[[int | None, str], None],
    timeout_s: float | None = None,
    preempt_grace_s: float = KILL_GRACE_S,
) -> None:
    """Run a launcher command (see build_launch_command) in its own process session, calling
    `on_line(global_rank or None, text)` for every line of its merged stdout/stderr as it comes.

    Ranks are known from torchrun's "[rank<N>]:" prefixes. DeepSpeed's runner adds no prefix, so
    under it every line arrives with rank None (the event lines of rank 0 still start with their
    own marker); the failing rank is then known only from failure records (see module docstring).
    Raises DistributedJobError on a non-zero exit or after `timeout_s` seconds; on any exit from
    this call - error, KeyboardInterrupt, SIGTERM (main thread), an exception from `on_line` -
    the whole process group is killed and reaped first. After a SIGTERM the ranks get
    `preempt_grace_s` to checkpoint before SIGKILL (torchrun itself allows its ranks ~30 s).
    """
    log = _JobLog()
    with tempfile.TemporaryDirectory(prefix="rlflow-failures-") as failure_dir, _sigterm_unwinds():
        child_env = {
            **env,
            FAILURE_DIR_ENV: failure_dir,
            PREFIX_TEMPLATE_ENV: PREFIX_TEMPLATE,
            # Lines must not wait in a buffer: torchrun's own output goes to a pipe, its ranks' to
            # files it tails. (Ranks also call line_buffered_output() for whole-line writes.)
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            cmd, env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True, name="rlflow-job-output")
        try:
            reader.start()
            finished = _pump(proc, lines, log, on_line, timeout_s)
        finally:
            stopping = sys.exc_info()[1]
            preempted = isinstance(stopping, SystemExit) and stopping.code == 128 + signal.SIGTERM
            _stop_group(proc, reader, preempt_grace_s if preempted else KILL_GRACE_S)
        if not finished:
            tail = [f"[rank {r}] {t}" for r in sorted(log.lines, key=str) for t in list(log.lines[r])[-5:]]
            message = f"distributed job timed out after {timeout_s:g} s and was killed; each rank's last lines:\n"
            raise DistributedJobError(message + _indent(tail), tail=tail)
        if proc.returncode != 0:
            raise _job_failure(proc.returncode, log, _read_failure_records(failure_dir))


def _last_lines(log: _JobLog, rank: int | None, records: list[dict]) -> list[str]:
    """The failing rank's last lines; its failure record's traceback when that never reached the
    output (DeepSpeed's runner: nothing is attributed; or the rank was killed in its teardown,
    before Python printed the traceback)."""
    if rank is None:
        fallback = log.lines.get(None) or (max(log.lines.values(), key=len) if log.lines else [])
        return list(fallback)[-SHOWN_LINES:]
    own = list(log.lines.get(rank, ()))
    record = next((r for r in records if r.get("rank") == rank), None)
    recorded = str(record.get("traceback", "")).rstrip("\n").splitlines() if record else []
    if not recorded or recorded[-1] in own:
        return own[-SHOWN_LINES:]
    header = [f"--- traceback from rank {rank}'s failure record (host {record.get('host')}):"]
    return own[-5:] + header + recorded[-SHOWN_LINES:]


def _indent(lines: list[str]) -> str:
    return "\n".join(f"  | {line}" for line in lines) if lines else "  | (no output)"


def _job_failure(returncode: int, log: _JobLog, records: list[dict]) -> DistributedJobError:
    """Pick the failing rank: one that died without a Python exception, then records, then
    torchrun's summary, then the first traceback."""
    first = records[0] if records else None
    recorded = {r.get("rank") for r in records}
    # A rank killed outright (SIGKILL, the OOM killer, os._exit) leaves no record; its peers then
    # fail in their next collective ("connection reset by peer") and do leave records - those are
    # consequences. -15 is torchrun's own SIGTERM to the survivors.
    hard = sorted(r for r, c in log.summary_failures.items() if r not in recorded and c != -signal.SIGTERM)
    if hard:
        rank, code = hard[0], log.summary_failures[hard[0]]
        how = " (died without a Python exception: killed, out of memory, or os._exit)"
    elif first is not None and first.get("rank") is not None:
        rank = int(first["rank"])
        # The record's code, not torchrun's: a rank killed during a slow teardown after its error
        # shows -15 (SIGTERM) there, which hides what happened.
        code = int(first.get("exit_code", 1))
        error = str(first.get("error", "")).strip().splitlines() or [""]
        how = f" ({error[0][:300]})"
    elif log.summary_root is not None:
        rank, how = log.summary_root, ""
        code = log.summary_failures[rank]
    else:
        rank, how = log.first_traceback_rank, ""
        code = log.summary_failures.get(rank) if rank is not None else None
        code = code if code is not None else (log.launcher_rank_exit or returncode)
    if code < 0:
        with contextlib.suppress(ValueError):
            how += f" (signal {signal.Signals(-code).name})"
    who = f"rank {rank}" if rank is not None else "a rank (unknown which)"
    message = f"distributed job failed: {who} exited with code {code}{how}; its last log lines:\n"
    tail = _last_lines(log, rank, records)
    return DistributedJobError(message + _indent(tail), rank=rank, exit_code=code, tail=tail)
