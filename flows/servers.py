"""Local Prefect and MLflow servers for one machine: `make up`, `make down`, `make status`.

Each server runs as a background process in its own session, with its pid, log and data under
`.rlflow/` of the working directory; `servers.json` there records where each listens, and
`rlflow run` reports to servers it finds healthy in it (unless PREFECT_API_URL or
MLFLOW_TRACKING_URI say otherwise). `down` stops exactly the processes `up` started: a pid is
only signalled while its command line is still the server's (pids are recycled).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

STATE_DIR = Path(os.environ.get("RLFLOW_STATE_DIR", ".rlflow"))
BIN = Path(sys.executable).parent
ENV_VARS = {"prefect": "PREFECT_API_URL", "mlflow": "MLFLOW_TRACKING_URI"}


@dataclass(frozen=True)
class Server:
    name: str  # "prefect" or "mlflow"
    port: int
    state_dir: Path

    @property
    def url(self) -> str:
        """What clients set: PREFECT_API_URL (with /api) or MLFLOW_TRACKING_URI."""
        base = f"http://127.0.0.1:{self.port}"
        return f"{base}/api" if self.name == "prefect" else base

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / f"{self.name}.log"

    def command(self) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment of the server process."""
        data = (self.state_dir / self.name).absolute()
        if self.name == "prefect":
            env = {
                "PREFECT_HOME": str(data),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{data}/prefect.db",
            }
            return [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)], env
        # One worker and no job runner: the defaults take 3.4 GB of memory (MACHINE-NOTES).
        argv = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        argv += [
            "--backend-store-uri",
            f"sqlite:///{data}/mlflow.db",
            "--artifacts-destination",
            str(data / "artifacts"),
        ]
        return argv, {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def servers(state_dir: Path | None = None) -> list[Server]:
    """The servers of `state_dir`: on the ports `up` recorded in servers.json, else on the ports
    the environment asks for (RLFLOW_PREFECT_PORT, RLFLOW_MLFLOW_PORT; 4200 and 5000)."""
    state_dir = state_dir or STATE_DIR
    recorded = _read_registry(state_dir)
    env = {"prefect": "RLFLOW_PREFECT_PORT", "mlflow": "RLFLOW_MLFLOW_PORT"}
    defaults = {"prefect": 4200, "mlflow": 5000}
    return [
        Server(name, int(recorded.get(name, {}).get("port") or os.environ.get(var, defaults[name])), state_dir)
        for name, var in env.items()
    ]


def _read_registry(state_dir: Path) -> dict[str, dict]:
    """servers.json's {name: {"url", "port"}}; anything else in it (a hand edit, an older format)
    is ignored: the ports then come from the environment."""
    try:
        registry = json.loads((state_dir / "servers.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(registry, dict):
        return {}
    return {name: entry for name, entry in registry.items() if isinstance(entry, dict)}


def healthy(server: Server, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(server.health_url, timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def running_pid(server: Server) -> int | None:
    """The pid in the pid file if that process is alive and is still this server."""
    try:
        pid = int(server.pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    expected = server.command()[0][:3]
    return pid if all(part.encode() in cmdline for part in expected) else None


def launch(server: Server) -> str | subprocess.Popen:
    """Start `server` in the background unless it already runs (then a status line)."""
    server.state_dir.mkdir(parents=True, exist_ok=True)
    pid = running_pid(server)
    if pid is not None:
        return f"{server.name}: already running (pid {pid}) at {server.ui_url}"
    if healthy(server):
        raise SystemExit(
            f"{server.name}: port {server.port} already answers, but not from a server `make up` started;"
            f" stop it or choose another port: RLFLOW_{server.name.upper()}_PORT=<port> make up"
        )
    argv, extra_env = server.command()
    (server.state_dir / server.name).mkdir(parents=True, exist_ok=True)
    with open(server.log_file, "ab") as log:
        proc = subprocess.Popen(
            argv, env=dict(os.environ, **extra_env), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    server.pid_file.write_text(str(proc.pid))
    return proc


def start(server: Server, timeout_s: float = 120.0) -> str:
    """Start `server` unless it already runs and wait until it is healthy; a status line."""
    launched = launch(server)
    return launched if isinstance(launched, str) else _wait_healthy(server, launched, timeout_s)


def _wait_healthy(server: Server, proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not healthy(server):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(server)
            tail = server.log_file.read_text(errors="replace")[-1500:]
            raise SystemExit(f"{server.name}: did not become healthy (log {server.log_file}):\n{tail}")
        time.sleep(0.5)
    return f"{server.name}: started (pid {proc.pid}) at {server.ui_url}; log {server.log_file}"


def stop(server: Server, grace_s: float = 15.0) -> str:
    """Stop the server `start` started (its whole process group: SIGTERM, up to `grace_s` for every
    member to exit, then SIGKILL); a stale pid file is removed. Returns once the group is gone, so
    its ports and files are free."""
    pid = running_pid(server)
    server.pid_file.unlink(missing_ok=True)
    if pid is None:
        return f"{server.name}: not running"
    os.killpg(pid, signal.SIGTERM)
    if not _wait_group_gone(pid, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        _wait_group_gone(pid, 10.0)
    return f"{server.name}: stopped (pid {pid})"


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _group_members(pgid):  # the leader is one of them (and is reaped there if it is our child)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid and _alive(int(entry)):
                    members.append(int(entry))
    return members


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reaps it if it is our child (a test starting and stopping)
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def write_registry(state_dir: Path, entries: list[Server]) -> None:
    registry = {server.name: {"url": server.url, "port": server.port} for server in entries}
    (state_dir / "servers.json").write_text(json.dumps(registry, indent=2))


def registered_urls(state_dir: Path | None = None) -> dict[str, str]:
    """{"prefect": PREFECT_API_URL, "mlflow": MLFLOW_TRACKING_URI} of the servers `make up`
    started here that answer now; {} if none."""
    return {s.name: s.url for s in servers(state_dir) if running_pid(s) and healthy(s)}


def status_lines(state_dir: Path | None = None) -> list[str]:
    lines = []
    for server in servers(state_dir):
        pid = running_pid(server)
        if pid is None:
            lines.append(f"{server.name:8} stopped")
            continue
        health = "healthy" if healthy(server) else "NOT answering"
        lines.append(f"{server.name:8} pid {pid:<7} {health:13} UI {server.ui_url}  log {server.log_file}")
    urls = registered_urls(state_dir)
    if urls:
        lines.append("rlflow run reports to them; other shells:")
        lines += [f"  export {var}={urls[name]}" for name, var in ENV_VARS.items() if name in urls]
    return lines


def up(state_dir: Path) -> list[str]:
    """Start both servers at once (Prefect takes ~15 s to answer, MLflow ~6 s); if one fails,
    the other is stopped too."""
    entries = servers(state_dir)
    launched = [(server, launch(server)) for server in entries]
    lines = []
    try:
        for server, proc in launched:
            lines.append(proc if isinstance(proc, str) else _wait_healthy(server, proc, 120.0))
    except SystemExit:
        for server in entries:
            stop(server)
        raise
    write_registry(state_dir, entries)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlflow-servers", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("up", "down", "status"))
    action = parser.parse_args(argv).action
    if action == "up":
        print("\n".join(up(STATE_DIR)))
    elif action == "down":
        for server in servers(STATE_DIR):
            print(stop(server))
        (STATE_DIR / "servers.json").unlink(missing_ok=True)
    print("\n".join(status_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
