"""`make up` / `make down` / `make status` (flows/servers.py) against a real MLflow server."""

import os
import subprocess
import sys
import urllib.request

import pytest

from conftest import _free_port
import rlflow.flows.servers as servers_module
from rlflow.flows.cli import configure_prefect_env
from rlflow.flows.servers import Server, healthy, registered_urls, running_pid, start, status_lines, stop, write_registry


def test_start_status_stop_touch_only_what_was_started(tmp_path, mlflow_server, monkeypatch):
    server = Server("mlflow", _free_port(), tmp_path)
    line = start(server, timeout_s=120)
    try:
        pid = running_pid(server)
        assert pid is not None and f"pid {pid}" in line and server.log_file.exists()
        assert urllib.request.urlopen(f"{server.url}/health", timeout=5).status == 200
        assert start(server).startswith("mlflow: already running")  # idempotent: no second process
        write_registry(tmp_path, [server])
        assert registered_urls(tmp_path) == {"mlflow": server.url}  # the port comes from servers.json
        status = "\n".join(status_lines(tmp_path))
        assert f"pid {pid}" in status and "healthy" in status and f"MLFLOW_TRACKING_URI={server.url}" in status
        # `rlflow run` reports to the servers `make up` started, unless the environment names others.
        monkeypatch.setattr(servers_module, "STATE_DIR", tmp_path)
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        configure_prefect_env()
        assert os.environ["MLFLOW_TRACKING_URI"] == server.url
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://elsewhere:5000")
        configure_prefect_env()
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://elsewhere:5000"
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
        with pytest.raises(SystemExit) as info:
            start(server)
    finally:
        stop(server)  # had it started after all, it must not outlive the test
    assert f"port {port} already answers" in str(info.value) and "RLFLOW_MLFLOW_PORT" in str(info.value)
