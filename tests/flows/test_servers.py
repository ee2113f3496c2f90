"""`make up` / `make down` / `make status` (flows/servers.py) against a real MLflow server."""

import os
import subprocess
import sys
import urllib.request

from conftest import _free_port
from rlflow.flows.servers import Server, healthy, registered_urls, running_pid, start, status_lines, stop, write_registry


def test_start_status_stop_touch_only_what_was_started(tmp_path, mlflow_server):
    server = Server("mlflow", _free_port(), tmp_path)
    line = start(server, timeout_s=120)
    try:
        pid = running_pid(server)
        assert pid is not None and f"pid {pid}" in line and server.log_file.exists()
        assert urllib.request.urlopen(f"{server.url}/health", timeout=5).status == 200
        assert start(server).startswith("mlflow: already running")  # idempotent: no second process
        write_registry(tmp_path, [server])
        os.environ["RLFLOW_MLFLOW_PORT"] = str(server.port)
        try:
            assert registered_urls(tmp_path) == {"mlflow": server.url}
            status = "\n".join(status_lines(tmp_path))
            assert f"pid {pid}" in status and "healthy" in status and f"MLFLOW_TRACKING_URI={server.url}" in status
        finally:
            del os.environ["RLFLOW_MLFLOW_PORT"]
    finally:
        assert stop(server) == f"mlflow: stopped (pid {pid})"
    assert not healthy(server) and not server.pid_file.exists()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    # The session's own server (another state folder) was not touched.
    assert urllib.request.urlopen(f"{mlflow_server}/health", timeout=5).status == 200


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
        start(server)
    except SystemExit as exc:
        assert f"port {port} already answers" in str(exc) and "RLFLOW_MLFLOW_PORT" in str(exc)
    else:
        raise AssertionError("a second server on a busy port must be refused")
