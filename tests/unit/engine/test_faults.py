"""Fault injection (rlflow.engine.faults): RLFLOW_FAULT arms exactly one point, RLFLOW_FAULT_ONCE
fires it once over all processes, and a matching point kills, signals or does nothing else."""

import os
import signal
import subprocess
import sys

import pytest

from rlflow.engine.faults import EVENTS, FAULT_ENV, FAULT_ONCE_ENV, KILLED_EXIT_CODE, armed, fault_point


@pytest.fixture(autouse=True)
def no_fault(monkeypatch):
    """No fault armed unless the test arms one (the suite may run under a fault variable)."""
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.delenv(FAULT_ONCE_ENV, raising=False)


def test_only_the_named_stage_event_and_step_are_armed(monkeypatch):
    assert not armed("ppo", "update", 3)
    monkeypatch.setenv(FAULT_ENV, "ppo:update:3")
    assert armed("ppo", "update", 3)
    assert not armed("ppo", "update", 2) and not armed("sft", "update", 3) and not armed("ppo", "step", 3)
    fault_point("ppo", "update", 2)  # not this point: returns and nothing happens


def test_fault_once_fires_the_first_time_over_all_processes(tmp_path, monkeypatch):
    marker = tmp_path / "fired"
    monkeypatch.setenv(FAULT_ENV, "sft:step:1")
    monkeypatch.setenv(FAULT_ONCE_ENV, str(marker))
    assert armed("sft", "step", 1) and marker.exists()
    assert not armed("sft", "step", 1)  # a retried stage runs through
    marker.unlink()  # what another process would see before the first one fired
    assert armed("sft", "step", 1)


def test_a_sigterm_point_signals_this_process_and_goes_on(monkeypatch):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        monkeypatch.setenv(FAULT_ENV, "ppo:sigterm:4")
        fault_point("ppo", "sigterm", 4)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a bytecode boundary for the handler to run
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


def test_a_kill_point_ends_the_process_at_once_with_the_sigkill_code():
    code = (
        "import sys\nfrom rlflow.engine.faults import fault_point\nprint('before', flush=True)\n"
        "fault_point('ppo', 'update', 3)\nprint('after', flush=True)\nsys.exit(0)\n"
    )
    env = {**os.environ, FAULT_ENV: "ppo:update:3"}
    env.pop(FAULT_ONCE_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (KILLED_EXIT_CODE, "before\n")


def test_every_event_says_where_it_fires():
    assert {"step", "update", "ckpt_manifest", "sigterm", "hang", "nonfinite"} <= set(EVENTS)
    assert all(isinstance(where, str) and where for where in EVENTS.values())
