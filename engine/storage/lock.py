"""A lock that keeps two processes off one run directory: ``{run_dir}/.lock`` = {host, pid, started}."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from rlflow.engine.storage.checkpoint import LOCK
from rlflow.engine.storage.files import json_bytes, now_iso
from rlflow.engine.errors import CheckpointError


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists but belongs to another user
    return True


class RunLock:
    """Marks a run directory as in use via ``{run_dir}/.lock`` = {host, pid, started}.

    A dead process's lock on this host is taken over; a live one, or one from another host
    (whose pid cannot be checked), raises CheckpointError.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/") or url
        self._fs, path = url_to_fs(self.url, **(storage_options or {}))
        self._path, self.lock_url = f"{path.rstrip('/')}/{LOCK}", f"{self.url}/{LOCK}"

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()

    def _read(self) -> dict[str, Any] | None:
        self._fs.invalidate_cache(self._path)
        try:
            holder = json.loads(self._fs.cat_file(self._path))
            # pid <= 0 would make os.kill signal a whole process group.
            if isinstance(holder["host"], str) and type(holder["pid"]) is int and holder["pid"] > 0:
                return holder
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError):
            pass
        raise CheckpointError(
            f"lock file {self.lock_url} is unreadable; delete it if no other process is running '{self.url}'"
        )

    def _create(self) -> bool:
        """Write our lock unless one appeared meanwhile; return whether we now hold it."""
        data = json_bytes({"host": socket.gethostname(), "pid": os.getpid(), "started": now_iso()})
        if not isinstance(self._fs, LocalFileSystem):  # no exclusive create here; race accepted
            self._fs.pipe_file(self._path, data)
            return True
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        tmp = f"{self._path}.tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, self._path)  # exclusive, and readers never see a half-written lock
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    @staticmethod
    def _is_ours(holder: dict[str, Any]) -> bool:
        return holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()

    def acquire(self) -> RunLock:
        """Take the lock, replacing a stale one; raise CheckpointError if another run holds it."""
        for _ in range(3):  # retries cover replacing a stale lock and losing a creation race
            holder = self._read()
            if self._create() if holder is None else self._is_ours(holder):
                return self
            if holder is None:
                continue  # lost a creation race: look at the winner's lock
            if holder["host"] != socket.gethostname() or _pid_alive(holder["pid"]):
                raise CheckpointError(
                    f"run '{self.url}' is already being run by pid {holder['pid']} on host "
                    f"{holder['host']} (started {holder.get('started', '?')}); wait for it or "
                    f"delete {self.lock_url} if that process is gone"
                )
            with contextlib.suppress(FileNotFoundError):  # stale: its process is dead
                self._fs.rm(self._path)
        raise CheckpointError(f"could not acquire {self.lock_url}: others keep replacing it")

    def release(self) -> None:
        """Delete the lock if it is still ours; another process's lock is left alone."""
        with contextlib.suppress(CheckpointError, FileNotFoundError):  # unreadable: not ours
            holder = self._read()
            if holder is not None and self._is_ours(holder):
                self._fs.rm(self._path)
