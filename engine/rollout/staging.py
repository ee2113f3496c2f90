"""Shared memory between a trainer and a rollout replica on its host: an anonymous memfd.

Nothing is named in /dev/shm (nothing leaks when the trainer is SIGKILLed, no 64 MB Docker limit).
The replica opens it as /proc/<trainer pid>/fd/<fd>, which only the trainer's user may open.

Layout: a report region of REPORT_BYTES, where the replica answers (a length-prefixed
JSON object: its dtype, the fingerprint of the weights it loaded), then `slots` regions of
`slot_bytes`, so packing bucket i+1 can overlap the replica loading bucket i.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

import numpy as np
import torch

REPORT_BYTES = 4096
_LENGTH = struct.Struct("<Q")


class Staging:
    def __init__(self, slot_bytes: int, slots: int = 2, report_bytes: int = REPORT_BYTES):
        self.slot_bytes, self.slots, self.report_bytes = slot_bytes, slots, report_bytes
        self.nbytes = report_bytes + slot_bytes * slots
        self.fd = os.memfd_create("rlflow-weight-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self.map = mmap.mmap(self.fd, self.nbytes)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)

    @property
    def path(self) -> str:
        """Where another process of this user on this host opens it."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def slot_offset(self, index: int) -> int:
        return self.report_bytes + (index % self.slots) * self.slot_bytes

    def read_report(self) -> dict[str, Any]:
        return read_report(self.buffer)

    def close(self) -> None:
        self.buffer = None
        os.close(self.fd)


def write_report(buffer: torch.Tensor, report: dict[str, Any]) -> None:
    data = json.dumps(report).encode()
    if _LENGTH.size + len(data) > REPORT_BYTES:
        raise ValueError(f"a replica report of {len(data)} bytes does not fit {REPORT_BYTES}")
    head = buffer[: _LENGTH.size + len(data)].numpy()
    head[: _LENGTH.size] = 0  # a reader meanwhile sees no report rather than a torn one
    head[_LENGTH.size :] = np.frombuffer(data, dtype=np.uint8)
    head[: _LENGTH.size] = np.frombuffer(_LENGTH.pack(len(data)), dtype=np.uint8)


def read_report(buffer: torch.Tensor) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(bytes(buffer[: _LENGTH.size].numpy()))
    if not length:
        return {}
    if length > REPORT_BYTES - _LENGTH.size:
        raise ValueError(f"a replica report claims {length} bytes; the region holds {REPORT_BYTES}")
    return json.loads(bytes(buffer[_LENGTH.size : _LENGTH.size + length].numpy()))
