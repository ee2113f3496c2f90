"""Prefect's temporary server does not outlive a killed `rlflow run` (flows/temporary_server.py):
a real temporary server, started as `rlflow run` starts it, in a process then SIGKILLed."""

import os
import signal
import subprocess
import sys
import time

from rlflow.flows.temporary_server import is_temporary_server, start_time, watch

RUN = """
import os, sys, time
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
from rlflow.flows.temporary_server import start_temporary_server
print(start_temporary_server(), flush=True)
time.sleep(600)
"""


def test_the_temporary_server_stops_when_its_run_is_killed(tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"))
    env.pop("PREFECT_API_URL", None)
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE, text=True, env=env)
    server = None
    try:
        server = int(run.stdout.readline())
        started = start_time(server)
        assert is_temporary_server(server, started) and not is_temporary_server(server, started + 1)
        run.send_signal(signal.SIGKILL)  # as the OOM killer does: no atexit handler runs
        run.wait()
        deadline = time.monotonic() + 60
        while is_temporary_server(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not is_temporary_server(server), "the temporary Prefect server outlived its killed run"
    finally:
        run.kill()
        if server is not None and is_temporary_server(server):
            os.kill(server, signal.SIGKILL)


def test_the_watchdog_leaves_a_server_that_is_already_gone(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not is_temporary_server(gone.pid)
    assert start_time(gone.pid) == -1 and start_time(os.getpid()) > 0
    assert watch(os.getpid(), gone.pid, -1, poll_s=0.01) is False  # nothing signalled
    assert not is_temporary_server(os.getpid())  # a live process that is not the server
