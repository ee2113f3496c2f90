"""Byte-level pieces of checkpoint writing: hashed streaming writes, atomic local puts, JSON bytes.

Kept apart from ``checkpoint`` (the store and its commit protocol) so each stays one idea.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

from rlflow.engine.errors import CheckpointError
from rlflow.engine.faults import die

MANIFEST = "manifest.json"
_CHUNK = 8 * 1024 * 1024


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def check_name(name: str) -> str:
    """Reject names that could escape the step directory or shadow the manifest."""
    parts = name.split("/")
    if name == MANIFEST or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise CheckpointError(
            f"invalid checkpoint file name {name!r}: use a relative path like "
            f"'model/model.safetensors' ('{MANIFEST}' is reserved)"
        )
    return name


def hash_stream(f: BinaryIO, sink: BinaryIO | None = None) -> tuple[int, str]:
    """Return (size, sha256) of a stream, copying it into ``sink`` on the way if given."""
    sha, size = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        sha.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return size, sha.hexdigest()


def put_local_atomic(path: str, data: bytes) -> None:
    """Write a small local file so readers see either nothing or all of it, even after a crash."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # a leftover tmp after a crash is ignored debris
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class HashingFile:
    """Write-only file wrapper that hashes and counts bytes as they stream to storage."""

    def __init__(
        self,
        raw: BinaryIO,
        name: str,
        on_close: Callable[[str, int, str], None],
        fsync: bool = False,
        die_midway: bool = False,
        disk_full: bool = False,
    ):
        self._raw, self.name, self._on_close, self._fsync = raw, name, on_close, fsync
        self._sha, self._size, self.closed, self._die_midway = hashlib.sha256(), 0, False, die_midway
        self._disk_full = disk_full

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")  # hash the raw bytes of e.g. typed arrays
        if self._disk_full:  # fault injection: the device is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        if self._die_midway:  # fault injection: a torn file on storage, then death
            self._raw.write(view[: view.nbytes // 2])
            self._raw.flush()
            die()
        self._raw.write(view)
        self._sha.update(view)
        self._size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        """Finish the upload, then record size and hash (only if the upload succeeded)."""
        if self.closed:
            return
        self.closed = True
        if self._fsync:  # on disk before the manifest that vouches for it (power loss)
            self._raw.flush()
            os.fsync(self._raw.fileno())
        self._raw.close()
        self._on_close(self.name, self._size, self._sha.hexdigest())

    def discard(self) -> None:
        """Close without recording the file; the aborting writer deletes whatever was stored."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(Exception):  # the failure being handled may be this file's
                self._raw.close()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        (self.close if exc_type is None else self.discard)()
