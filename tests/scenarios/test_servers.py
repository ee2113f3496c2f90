"""`make up` / `make down` / `make status` (flows/servers.py): the session's real MLflow server
(started through servers.start), and a stand-in process for stopping."""

import os
import subprocess
import sys
import urllib.request

import pytest

from conftest import _free_port
import rlflow.flows.servers as servers_module
from rlflow.flows.cli.main import configure_prefect_env
from rlflow.flows.servers import Server, healthy, registered_urls, running_pid, start, status_lines, stop, write_registry


def test_a_started_server_is_found_reported_and_not_started_twice(mlflow_server_process, monkeypatch):
    """The session's MLflow server, started by servers.start as `make up` does."""
    server = mlflow_server_process
    pid = running_pid(server)
    assert pid is not None and server.log_file.exists() and healthy(server)
    assert start(server) == f"mlflow: already running (pid {pid}) at {server.ui_url}"  # no second process
    write_registry(server.state_dir, [server])
    assert registered_urls(server.state_dir) == {"mlflow": server.url}  # the port comes from servers.json
    status = "\n".join(status_lines(server.state_dir))
    assert f"pid {pid}" in status and "healthy" in status and f"MLFLOW_TRACKING_URI={server.url}" in status
    assert "prefect  stopped" in status
    # `rlflow run` reports to the servers `make up` started, unless the environment names others.
    monkeypatch.setattr(servers_module, "STATE_DIR", server.state_dir)
    # setenv first: delenv of an unset variable records nothing to restore, and configure_prefect_env
    # sets it behind monkeypatch's back (it leaked into every later test of the process).
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset-by-the-test")
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    configure_prefect_env()
    assert os.environ["MLFLOW_TRACKING_URI"] == server.url
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")
    configure_prefect_env()
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://elsewhere:5000"


class StandIn(Server):
    """A server process that costs nothing to start (a second MLflow takes ~8 s): Python's HTTP
    server, answering /health from a file, in its own process group with a child process."""

    def command(self):
        root = self.state_dir / "www"
        root.mkdir(exist_ok=True)
        (root / "health").write_text("ok")
        # It keeps a child process: `down` must stop the whole group, not just the leader.
        code = "import subprocess, sys; subprocess.Popen(['sleep', '300']); import http.server, functools; "
        code += f"http.server.ThreadingHTTPServer(('127.0.0.1', {self.port}), "
        code += f"functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(root)!r})).serve_forever()"
        return [sys.executable, "-c", code, "rlflow-stand-in"], {}


def test_stop_ends_the_whole_process_group_and_only_it(tmp_path, mlflow_server):
    server = StandIn("mlflow", _free_port(), tmp_path)
    line = start(server, timeout_s=30)
    pid = running_pid(server)
    assert pid is not None and f"started (pid {pid})" in line
    group = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pid]
    assert len(group) >= 2  # the server and its child
    assert stop(server) == f"mlflow: stopped (pid {pid})"
    assert not healthy(server) and not server.pid_file.exists()
    assert [p for p in group if _alive(int(p))] == []
    assert stop(server) == "mlflow: not running"
    assert urllib.request.urlopen(f"{mlflow_server}/health", timeout=5).status == 200  # another state folder


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_recycled_pid_is_never_signalled(tmp_path):
    """A pid file naming a live process that is not the server (the pid was reused): `down`
    leaves that process alone and only removes the stale file."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = Server("mlflow", _free_port(), tmp_path)
        server.pid_file.write_text(str(bystander.pid))
        assert running_pid(server) is None
        assert stop(server) == "mlflow: not running"
        assert bystander.poll() is None and not server.pid_file.exists()
    finally:
        bystander.kill()


def test_a_port_taken_by_another_server_is_refused(tmp_path, mlflow_server):
    port = int(mlflow_server.rsplit(":", 1)[1])
    server = Server("mlflow", port, tmp_path)
    try:
        with pytest.raises(SystemExit) as info:
            start(server)
    finally:
        stop(server)  # had it started after all, it must not outlive the test
    assert f"port {port} already answers" in str(info.value) and "RLFLOW_MLFLOW_PORT" in str(info.value)
