"""keep_freed_memory (engine/backend/cpu_memory.py) in a fresh process: after it, a large block freed and
allocated again, step after step, stops page-faulting once the heap holds enough freed blocks
(torch's 64-byte-aligned requests do not fit a freed block of their own size exactly, so glibc
takes a few rounds to coalesce them: measured, the last faulting round was round 5 or 11 of 40,
varying from process to process, so a fixed 8-round warm-up failed on CI); without it, every
round trip faults the block back in."""

import json
import subprocess
import sys

SCRIPT = r"""
import json, resource, sys
import torch
if sys.argv[1] == "keep":
    from rlflow.engine.backend.cpu_memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.set_num_threads(1)
per_round = []
for _ in range(ROUNDS):
    before = faults()
    torch.ones(64 * 2**20).sum()  # 256 MiB: allocate, touch, free
    per_round.append(faults() - before)
print(json.dumps(per_round))
"""
ROUNDS = 40


def faults_per_round(mode: str) -> list[int]:
    script = SCRIPT.replace("ROUNDS", str(ROUNDS))
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    pages = 64 * 2**20 * 4 // 4096  # one 256 MiB block, in 4 KiB pages
    system = faults_per_round("system")
    assert min(system) > pages * 0.9, system  # glibc: an mmap per round, each faulted in again
    keep = faults_per_round("keep")
    faulting = [i for i, n in enumerate(keep) if n > pages // 10]
    # Half the rounds is 2x the slowest settling measured; after it, not one round faults.
    assert faulting and max(faulting) < ROUNDS // 2, keep
    assert sum(keep[ROUNDS // 2 :]) < pages // 10, keep


def test_a_users_glibc_settings_are_left_alone():
    import os

    from rlflow.engine.backend import cpu_memory

    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="1000000")
    code = "from rlflow.engine.backend.cpu_memory import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
    assert cpu_memory._USER_SETTINGS  # the names it checks, for the docstring's claim


def _fresh(cpu_memory, monkeypatch) -> None:
    """As in a process that never called keep_freed_memory, without glibc settings of the user's
    (setenv first so that monkeypatch removes what the test sets, and restores what was there)."""
    monkeypatch.setattr(cpu_memory, "_applied", None)
    for name in cpu_memory._USER_SETTINGS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_in_this_process_it_applies_on_linux_glibc_once_and_then_keeps_its_answer(monkeypatch):
    import platform

    from rlflow.engine.backend import cpu_memory

    _fresh(cpu_memory, monkeypatch)
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    first = cpu_memory.keep_freed_memory()
    assert first is glibc
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")  # too late: the settings are in force already
    assert cpu_memory.keep_freed_memory() is first


def test_in_this_process_a_users_setting_makes_it_a_no_op_for_good(monkeypatch):
    from rlflow.engine.backend import cpu_memory

    _fresh(cpu_memory, monkeypatch)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    assert cpu_memory.keep_freed_memory() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert cpu_memory.keep_freed_memory() is False  # decided once per process
