"""Running model-written Python where it can reach nothing: `run_python(code, limits)`.

Each call starts `sandbox_init.py` as root; it gives the code new mount, pid, network, IPC and UTS
namespaces, a root of its own (read-only system directories and the interpreter, a size-capped
tmpfs working directory, no home, checkout, /tmp or secrets), an unprivileged uid of its own and
CPU, memory, file-size, process and open-file limits, with a scrubbed environment. This side adds a
wall-clock deadline and caps the output it reads. Namespaces and the uid switch need root
(CAP_SYS_ADMIN); `unavailable_reason()` says why they cannot be had, and the python tool then
refuses to start. Limits are enforced by the kernel, not by trusting root's defaults: RLIMIT_NPROC
binds because the program's uid is not root.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_init.py")
FIRST_UID = 200_000  # programs run as FIRST_UID + a random offset: no real user, no file of theirs
UID_SPAN = 1_000_000


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    """CPU seconds of the program (RLIMIT_CPU): past it the kernel kills it."""
    wall_s: float = 10.0
    """Wall-clock seconds from start to the program's end (sleeping and blocking count)."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS), MiB."""
    file_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE), MiB."""
    disk_mb: int = 64
    """Its whole filesystem (a tmpfs): the working directory's contents, MiB."""
    nproc: int = 16
    """Processes and threads its uid may have at once (RLIMIT_NPROC)."""
    output_bytes: int = 16_384
    """stdout plus stderr kept; past it the program is stopped and the output marked truncated."""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal; None: stopped by this side
    timed_out: bool
    truncated: bool
    cpu_s: float
    uid: int  # the unprivileged uid it ran as (random in FIRST_UID + [0, UID_SPAN): a clash is unlikely)
    cpu_limited: bool = False  # killed for its CPU time (SIGXCPU at the soft limit, SIGKILL at the hard)

    def describe(self) -> str:
        """The result as a tool observation: the output, then how it ended when not cleanly."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip() and self.exit_code != 0:
            parts.append(self.stderr.rstrip("\n"))
        if self.truncated:
            parts.append("[output truncated: the program wrote more than the tool keeps and was stopped]")
        elif self.timed_out:
            parts.append("[error: the program ran past its time limit and was killed]")
        elif self.exit_code is not None and self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:  # a real-time signal
                name = f"signal {-self.exit_code}"
            reason = " (CPU time limit)" if self.cpu_limited else ""
            parts.append(f"[error: the program was killed by {name}{reason}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be built here; the message says why and what would allow it."""


def _python() -> tuple[str, str]:
    """The base interpreter (not the virtualenv, whose site-packages the program never sees)."""
    prefix = os.path.realpath(sys.base_prefix)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for name in (version, "python3"):
        path = os.path.join(prefix, "bin", name)
        if os.path.exists(path):
            return os.path.realpath(path), prefix
    raise SandboxUnavailable(f"no interpreter under {prefix}/bin")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` as a script in a fresh sandbox and returns what it wrote and how it ended.

    Raises SandboxUnavailable when the namespaces cannot be made (not root, a kernel without them).
    """
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the python tool's sandbox needs root (CAP_SYS_ADMIN) to create namespaces and run code as an "
            "unprivileged uid of its own; run the trainer as root (e.g. in its container) or use tools without python"
        )
    python, prefix = _python()
    root = tempfile.mkdtemp(prefix="rlflow-sandbox-")
    status_read, status_write = os.pipe()
    job = {
        "code": code, "root": root, "python": python, "python_prefix": prefix, "status_fd": status_write,
        "uid": FIRST_UID + secrets.randbelow(UID_SPAN), "cpu_s": int(limits.cpu_s), "memory_mb": limits.memory_mb,
        "file_mb": limits.file_mb, "disk_mb": limits.disk_mb, "nproc": limits.nproc, "wall_s": limits.wall_s,
    }
    proc = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LAUNCHER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(status_write,), env={}, start_new_session=True,
        )
        os.close(status_write)
        status_write = -1
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        return _collect(proc, status_read, limits, job["uid"])
    finally:
        if proc is not None and proc.poll() is None:  # this side failed mid-call: nothing may outlive it
            _kill(proc)
            proc.wait()
        if status_write >= 0:
            os.close(status_write)
        os.close(status_read)
        shutil.rmtree(root, ignore_errors=True)


def _collect(proc: subprocess.Popen, status_fd: int, limits: SandboxLimits, uid: int) -> SandboxResult:
    """Reads stdout, stderr and the status line until all close, stopping the launcher at the wall
    deadline or the output cap (its death kills the namespace's init, and with it every process)."""
    deadline = time.monotonic() + limits.wall_s
    chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": [], "status": []}
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
    selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
    selector.register(status_fd, selectors.EVENT_READ, "status")
    kept, timed_out, truncated = 0, False, False
    while selector.get_map():
        left = deadline - time.monotonic()
        if left <= 0 and not (timed_out or truncated):
            timed_out = True
            _kill(proc)
        for key, _ in selector.select(timeout=max(left, 0.05)):
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fileobj)
                continue
            if key.data == "status":
                chunks["status"].append(data)
                continue
            room = max(limits.output_bytes - kept, 0)
            chunks[key.data].append(data[:room])
            kept += min(len(data), room)
            if len(data) > room and not truncated:
                truncated = True
                _kill(proc)
    proc.wait()
    status = [json.loads(line) for line in b"".join(chunks["status"]).decode().splitlines() if line.strip()]
    end = status[-1] if status else {}
    if "setup_error" in end:
        raise SandboxUnavailable(f"the sandbox could not be built: {end['setup_error']}")
    return SandboxResult(
        stdout=b"".join(chunks["stdout"]).decode("utf-8", "replace"),
        stderr=b"".join(chunks["stderr"]).decode("utf-8", "replace"),
        exit_code=end.get("exit"), timed_out=timed_out, truncated=truncated, cpu_s=float(end.get("cpu_s", 0.0)),
        uid=uid, cpu_limited=_cpu_limited(end.get("exit"), float(end.get("cpu_s", 0.0)), limits.cpu_s),
    )


def _cpu_limited(exit_code: int | None, cpu_s: float, limit_s: int) -> bool:
    if exit_code == -signal.SIGXCPU:
        return True
    return exit_code == -signal.SIGKILL and cpu_s >= limit_s - 0.05


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@functools.cache
def unavailable_reason() -> str | None:
    """None where the sandbox works here (tried once per process), else why it does not."""
    try:
        result = run_python("print('ok')")
    except SandboxUnavailable as exc:
        return str(exc)
    if result.stdout.strip() != "ok":
        return f"the sandbox's probe program failed: {result.describe()}"
    return None
