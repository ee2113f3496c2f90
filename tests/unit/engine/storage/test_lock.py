"""Tests for rlflow.engine.storage.lock: RunLock taken and released, refused while a live process (here
or on another host) holds it, and taken over from a dead one (on S3: test_checkpoint.py::test_s3_store)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from rlflow.engine.storage.lock import RunLock
from rlflow.engine.errors import CheckpointError


def _write_lock(run_dir, pid, host=None):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, ".lock"), "w") as f:
        json.dump({"host": host or socket.gethostname(), "pid": pid, "started": "2026-01-01T00:00:00+00:00"}, f)


def test_runlock_acquire_release(tmp_path):
    run_dir = str(tmp_path / "myrun")
    with RunLock(run_dir) as lock:
        holder = json.loads(open(os.path.join(run_dir, ".lock")).read())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
        lock.acquire()  # re-acquiring our own lock is a no-op
    assert not os.path.exists(os.path.join(run_dir, ".lock"))


def test_runlock_held_by_live_child(tmp_path):
    run_dir = str(tmp_path / "myrun")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, time
        from rlflow.engine.storage.lock import RunLock
        RunLock({run_dir!r}).acquire()
        print("locked", flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        expected = (
            f"run '{run_dir}' is already being run by pid {child.pid} on host {socket.gethostname()} "
            rf"\(started .*\); wait for it or delete {run_dir}/.lock if that process is gone"
        )
        with pytest.raises(CheckpointError, match=expected):
            RunLock(run_dir).acquire()
    finally:
        child.kill()
        child.wait()


def test_runlock_live_pid_and_other_host(tmp_path):
    run_dir = str(tmp_path / "myrun")
    _write_lock(run_dir, os.getppid())
    with pytest.raises(CheckpointError, match=f"by pid {os.getppid()} on host"):
        RunLock(run_dir).acquire()
    _write_lock(run_dir, 1, host="some-other-host")
    with pytest.raises(CheckpointError, match="on host some-other-host"):
        RunLock(run_dir).acquire()
    RunLock(run_dir).release()  # not ours: must stay
    assert os.path.exists(os.path.join(run_dir, ".lock"))


def test_runlock_stale_is_taken_over(tmp_path):
    run_dir = str(tmp_path / "myrun")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(run_dir, dead.pid)
    with RunLock(run_dir):
        assert json.loads(open(os.path.join(run_dir, ".lock")).read())["pid"] == os.getpid()
    assert not os.path.exists(os.path.join(run_dir, ".lock"))
