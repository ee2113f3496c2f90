"""Keep freed memory inside a CPU process instead of handing it back to the OS after every free.

glibc serves every allocation above its mmap threshold (128 KiB to 32 MiB, adaptive) with a fresh
mmap and unmaps it on free, and trims the heap top when it is freed. A training step allocates and
frees gigabytes of activations, gradients, logits and packed decode weights, so each step
page-faults all of it back in, zero-filled by the kernel: at SmolLM2-135M on 2 cores that was ~1.3 s
of a 6.4 s PPO step (bench/NOTES.md). With mmap off and trimming at its maximum, freed blocks stay
in the heap and the next step reuses them; peak RSS is unchanged (6.48 vs 6.46 GB on that step),
but the process holds its peak until it exits. PyTorch's CPU tuning guide gets the same from
jemalloc or tcmalloc; this needs no preloaded library.

Set MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES yourself and this leaves glibc as
you configured it.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's malloc.h
_INT_MAX = 2**31 - 1
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Turn off glibc's mmap for large blocks and heap trimming in this process, once. False where
    it does not apply: not Linux with glibc, or the user set glibc's malloc tunables."""
    global _applied
    if _applied is None:
        _applied = False
        if sys.platform.startswith("linux") and not any(k in os.environ for k in _USER_SETTINGS):
            try:
                libc = ctypes.CDLL("libc.so.6")
                _applied = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
            except (OSError, AttributeError):  # musl and others: no glibc mallopt
                pass
    return _applied
