"""The python tool's sandbox against the attacks it exists for. Each is run for real (namespaces,
rlimits, an unprivileged uid), and each must come back as a clean error observation while this
process, standing in for the trainer, carries on."""

import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlflow.engine.envs import sandbox
from rlflow.engine.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the sandbox needs root; test_refuses_without_root covers this case")

# The wall-clock limit is generous where another limit is under test: on a loaded machine a second of
# CPU can take many seconds of wall time.
QUICK = SandboxLimits(cpu_s=1, wall_s=60.0, memory_mb=256, nproc=8, output_bytes=4096)


def processes_of(uid: int) -> list[int]:
    """Pids on this machine running as `uid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            owner = entry.stat().st_uid if entry.name.isdigit() else -1
        except FileNotFoundError:
            continue
        if owner == uid:
            pids.append(int(entry.name))
    return pids


@needs_root
def test_a_script_runs_as_an_unprivileged_uid_in_its_own_folder():
    result = run_python("import os\nprint(6 * 7, os.getuid() != 0, os.getcwd(), sorted(os.listdir('/work')))")
    assert result.exit_code == 0 and not result.timed_out and not result.truncated
    assert result.stdout.split() == ["42", "True", "/work", "['main.py']"]
    assert result.describe() == "42 True /work ['main.py']"


@needs_root
def test_an_infinite_loop_is_killed_at_its_cpu_limit():
    result = run_python("while True:\n    pass", QUICK)
    assert result.exit_code in (-24, -9) and not result.timed_out  # SIGXCPU at the soft limit, SIGKILL at the hard
    assert "CPU time limit" in result.describe()


@needs_root
def test_a_sleeping_program_is_killed_at_its_wall_clock_limit():
    start = time.monotonic()
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_s=1.0))
    assert 0.9 < time.monotonic() - start < 15.0
    assert result.timed_out and result.exit_code is None
    assert result.describe() == "[error: the program ran past its time limit and was killed]"


@needs_root
def test_a_memory_bomb_is_stopped():
    # CPU time to spare: on a loaded machine the page faults can use up a 1 s CPU limit first, and the
    # kernel's SIGXCPU would end it before the memory limit does.
    limits = SandboxLimits(cpu_s=20, wall_s=60.0, memory_mb=256, nproc=8, output_bytes=4096)
    result = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", limits)
    assert result.exit_code == 1 and "MemoryError" in result.stderr
    assert result.describe().endswith("MemoryError\n[exit code 1]")


@needs_root
def test_a_fork_bomb_is_contained_and_leaves_nothing_behind():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = run_python(bomb, SandboxLimits(cpu_s=2, wall_s=2.0, nproc=8))
    assert result.timed_out or (result.exit_code is not None and result.exit_code < 0)
    assert sandbox.FIRST_UID <= result.uid < sandbox.FIRST_UID + sandbox.UID_SPAN
    deadline = time.monotonic() + 10
    while processes_of(result.uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(result.uid) == []


@needs_root
def test_a_socket_to_this_machine_cannot_connect():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)", QUICK)
        assert result.exit_code == 1 and "Network is unreachable" in result.stderr
        assert select.select([listener], [], [], 0)[0] == []  # nothing reached the listener
    finally:
        listener.close()


@needs_root
def test_nothing_outside_its_folder_can_be_written(tmp_path):
    targets = ["/etc/passwd", "/usr/x", "/x", "/tmp/x", "/proc/x", str(tmp_path / "x"), "/dev/shm/x"]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n        open(path, 'a').write('x')\n        print('WROTE', path)\n"
        "    except OSError as exc:\n        print('refused', type(exc).__name__)\n"
        "open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())"
    )
    result = run_python(code, QUICK)
    lines = result.stdout.splitlines()
    assert "WROTE" not in result.stdout and len(lines) == len(targets) + 1 and lines[-1] == "ok"
    assert list(tmp_path.iterdir()) == []


@needs_root
def test_no_secret_is_readable(monkeypatch, tmp_path):
    monkeypatch.setenv("RLFLOW_SECRETS", '{"tracking": {"token": "s3cr3t-value"}}')
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-s3cr3t-value")
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("aws_secret_access_key = aws-s3cr3t-value\n")
    code = (
        "import os\nprint(sorted(os.environ))\n"
        f"for path in ['/proc/{os.getpid()}/environ', '/proc/1/environ', os.path.expanduser('~/.aws/credentials'),"
        f" '/root/.aws/credentials', {str(home / '.aws' / 'credentials')!r}]:\n"
        "    try:\n        print('READ', path, open(path, 'rb').read()[:80])\n"
        "    except OSError as exc:\n        print('refused', type(exc).__name__)\n"
    )
    result = run_python(code, QUICK)
    assert result.exit_code == 0, result.describe()
    assert result.stdout.splitlines()[0] == "['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING', 'TMPDIR']"
    assert "s3cr3t" not in result.stdout + result.stderr
    assert "READ" not in result.stdout.replace("READ /proc/1/environ", "")  # pid 1 is the sandbox's own init


@needs_root
def test_a_million_lines_are_truncated_at_the_output_cap():
    result = run_python("for i in range(10**6):\n    print(i)", QUICK)
    assert result.truncated and len(result.stdout) + len(result.stderr) <= QUICK.output_bytes
    assert result.stdout.startswith("0\n1\n2\n")
    assert result.describe().endswith("[output truncated: the program wrote more than the tool keeps and was stopped]")


@needs_root
def test_a_caller_killed_mid_call_leaves_no_process_behind():
    uid_offset = 4242 + os.getpid() % 1000
    caller = subprocess.Popen([sys.executable, "-c", (
        "from rlflow.engine.envs import sandbox\n"
        f"sandbox.secrets.randbelow = lambda n: {uid_offset}\n"
        "sandbox.run_python('import time\\ntime.sleep(600)', sandbox.SandboxLimits(wall_s=600))")])
    uid = sandbox.FIRST_UID + uid_offset
    deadline = time.monotonic() + 60
    while not processes_of(uid) and time.monotonic() < deadline:  # the program is running
        time.sleep(0.05)
    assert processes_of(uid)
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(uid) == []


@needs_root
def test_this_process_is_unharmed_and_the_sandbox_still_works():
    run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)", QUICK)
    assert run_python("print('still here')").stdout == "still here\n"
    assert sandbox.unavailable_reason() is None


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match=r"^the python tool's sandbox needs root \(CAP_SYS_ADMIN\)") as err:
        run_python("print(1)")
    assert "\n" not in str(err.value)

