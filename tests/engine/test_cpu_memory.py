"""keep_freed_memory (engine/cpu_memory.py) in a fresh process: after it, a large block freed and
allocated again, step after step, stops page-faulting once the heap holds enough freed blocks
(torch's 64-byte-aligned requests do not fit a freed block of their own size exactly, so glibc
takes a few rounds to coalesce them); without it, every round trip faults the block back in."""

import json
import subprocess
import sys

SCRIPT = r"""
import json, resource, sys
import torch
if sys.argv[1] == "keep":
    from rlflow.engine.cpu_memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()  # idempotent
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.set_num_threads(1)
for _ in range(8):  # the heap settles (measured: after 4 rounds, at 4 blocks)
    torch.ones(64 * 2**20).sum()  # 256 MiB: allocate, touch, free
before = faults()
for _ in range(5):
    torch.ones(64 * 2**20).sum()
print(json.dumps({"faults": faults() - before}))
"""


def faults(mode: str, env: dict | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])["faults"]


def test_freed_blocks_are_reused_without_page_faults():
    pages = 64 * 2**20 * 4 // 4096  # one 256 MiB block, in 4 KiB pages
    assert faults("system") > 4 * pages  # glibc: five mmaps, each faulted in again
    assert faults("keep") < pages // 10


def test_a_users_glibc_settings_are_left_alone():
    import os

    from rlflow.engine import cpu_memory

    env = dict(os.environ, MALLOC_TRIM_THRESHOLD_="1000000")
    code = "from rlflow.engine.cpu_memory import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
    assert cpu_memory._USER_SETTINGS  # the names it checks, for the docstring's claim
