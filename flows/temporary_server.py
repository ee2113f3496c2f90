"""Prefect's temporary server for one `rlflow run`, which must not outlive the run.

With no Prefect server configured, Prefect starts a temporary one (uvicorn, a child process) at the
first API call and stops it at exit (atexit). A run killed by SIGKILL or the kernel's OOM killer
runs no atexit handler, and the server stayed up, holding its port and ~300 MB, until someone
found it. `start_temporary_server` starts the same server before the flow (Prefect's client then
uses it: one temporary server per process) and a watchdog process that stops it once the run's
process is gone, however it ended.

    python -m rlflow.flows.temporary_server RUN_PID SERVER_PID SERVER_START_TIME   # the watchdog; started for you
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVER_MARK = b"prefect.server.api.server:create_app"  # in the temporary server's command line
POLL_S = 0.5
GRACE_S = 10.0


def start_temporary_server() -> int:
    """Start Prefect's temporary server now, and its watchdog; returns the server's pid."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance Prefect's client would create and start itself
    server.start()
    pid = server.server_process.pid
    subprocess.Popen(
        [sys.executable, "-m", __spec__.name, str(os.getpid()), str(pid), str(start_time(pid))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C in the terminal is the run's to handle, not the watchdog's
    )
    return pid


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields from the state on (field 3); [] if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_time(fields: list[str]) -> int:
    return int(fields[19]) if len(fields) > 19 else -1


def start_time(pid: int) -> int:
    """The process's start time (clock ticks after boot; -1: none): with the pid, it names one process."""
    return _start_time(_stat(pid))


def is_temporary_server(pid: int, started: int | None = None) -> bool:
    """Whether `pid` is alive and a Prefect temporary server (the one started at `started`, if
    given: pids are recycled, and another run's server could take this one's)."""
    fields = _stat(pid)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    alive = bool(fields) and fields[0] != "Z"
    return alive and SERVER_MARK in cmdline and (started is None or _start_time(fields) == started)


def watch(run_pid: int, server_pid: int, started: int, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> bool:
    """Wait while the run (this process's parent) lives, then stop the server if it still runs:
    SIGTERM, then SIGKILL after `grace_s`. True if it had to stop it."""

    def running() -> bool:
        return is_temporary_server(server_pid, started)

    while os.getppid() == run_pid and running():
        time.sleep(poll_s)
    if not running():  # the run stopped it (a normal exit) or it ended
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(server_pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    if running():
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
    return True


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
