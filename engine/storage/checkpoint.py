"""Committed, verifiable checkpoints on any fsspec filesystem (local paths, file://, s3://).

A store is rooted at a stage prefix; step ``n`` lives in ``{prefix}/step_{n:06d}/`` and counts
as committed once its ``manifest.json`` (size and sha256 of every file) exists and parses. It is
written LAST because object stores have no atomic rename: a crash at any earlier point leaves a
directory that every reader ignores. (``run_lock.RunLock`` keeps two runs off one tree.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any, BinaryIO

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from rlflow.engine.errors import CheckpointError
from rlflow.engine.storage.files import (
    MANIFEST,
    HashingFile,
    check_name,
    hash_stream,
    json_bytes,
    now_iso,
    put_local_atomic,
)
from rlflow.engine.faults import armed

FINAL, LOCK = "final.json", ".lock"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
STEP_URI = re.compile(r"^(?P<prefix>.+)/step_(?P<step>\d{6})/?$")  # a committed step's URL


def stage_prefix(root: str, run: str, round_index: int, stage: str) -> str:
    """Return the store URL of one stage of one round: ``{root}/{run}/round_{r}/{stage}``."""
    if not run or not stage or "/" in run + stage:
        raise CheckpointError(f"invalid run/stage names {run!r}/{stage!r}: need names without '/'")
    return f"{root.rstrip('/')}/{run}/round_{round_index}/{stage}"


class StepWriter:
    """Collects one step's files and commits them; use ``with store.writer(step) as w:``."""

    def __init__(self, store: CheckpointStore, step: int):
        self._store, self.step = store, step
        self.meta, self._files, self._open, self._state = {}, {}, [], "new"

    def __enter__(self) -> StepWriter:
        # Overwriting drops the old manifest first, so old and new files are never committed mixed.
        self._store.delete_step(self.step)
        self._state = "open"
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._state == "open" and exc_type is None:
                self.commit()
        except OSError as error:
            self._raise_if_disk_full(error)
            raise
        finally:
            if self._state == "open":  # the block or the commit failed: nothing is committed
                self._abort()
        if isinstance(exc, OSError):
            self._raise_if_disk_full(exc)

    def _raise_if_disk_full(self, error: OSError) -> None:
        """A full disk is for the user to fix: one line naming the step instead of an OSError."""
        if error.errno == errno.ENOSPC:
            what = f" (file {error.filename})" if error.filename else ""
            raise CheckpointError(
                f"no space left on device while writing checkpoint {self._store.step_url(self.step)}{what}; the"
                " step was not committed and earlier steps are intact: free space (or lower checkpoint.keep_last)"
                " and rerun to resume from the last committed step"
            ) from None

    def _require_open(self) -> None:
        if self._state != "open":
            raise CheckpointError(
                f"writer for {self._store.step_url(self.step)} is {self._state}; "
                "write inside 'with store.writer(step) as w:' before it commits"
            )

    def _record(self, name: str, size: int, sha256: str) -> None:
        self._files[name] = {"size": size, "sha256": sha256}
        self._open = [f for f in self._open if not f.closed]

    def open(self, name: str, mode: str = "wb") -> HashingFile:
        """Open ``name`` for streaming writes; its size and sha256 are recorded on close."""
        if mode != "wb":
            raise ValueError(f"checkpoint files are written with mode 'wb', got {mode!r}")
        self._require_open()
        path = self._store._step_path(self.step, check_name(name))
        if self._store._local:  # local filesystems need parent directories; object stores do not
            os.makedirs(os.path.dirname(path), exist_ok=True)
        raw, local = self._store._fs.open(path, "wb"), self._store._local
        faults = self._store._die_midway(self.step), self._store._disk_full(self.step)
        self._open.append(HashingFile(raw, name, self._record, local, *faults))
        return self._open[-1]

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.open(name) as f:
            f.write(data)

    def write_json(self, name: str, obj: Any) -> None:
        self.write_bytes(name, json_bytes(obj))

    def adopt(self, name: str, record: dict[str, Any]) -> None:
        """Count a file another process wrote into this step (``CheckpointStore.put_shard``)."""
        self._require_open()
        self._record(check_name(name), int(record["size"]), str(record["sha256"]))

    def put_dir(self, local_dir: str, prefix: str = "") -> list[str]:
        """Upload every file under ``local_dir`` (recursively) as ``{prefix}/{relpath}``."""
        if not os.path.isdir(local_dir):
            raise CheckpointError(f"cannot checkpoint {local_dir!r}: it is not a directory")
        written, prefix = [], prefix.strip("/")
        for root, dirs, files in os.walk(local_dir):
            dirs.sort()  # a deterministic upload order makes failures reproducible
            for fname in sorted(files):
                rel = os.path.relpath(os.path.join(root, fname), local_dir).replace(os.sep, "/")
                name = f"{prefix}/{rel}" if prefix else rel
                with open(os.path.join(root, fname), "rb") as src, self.open(name) as dst:
                    hash_stream(src, dst)
                written.append(name)
        return written

    def commit(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the manifest (the commit point) and return it. Runs by itself on clean exit."""
        self._require_open()
        self.meta.update(meta or {})
        for f in list(self._open):
            f.close()  # an unclosed handle may still hold buffered, unuploaded bytes
        files = dict(sorted(self._files.items()))
        manifest = {"step": self.step, "files": files, "meta": self.meta, "created": now_iso()}
        data = json_bytes(manifest)  # serialise first: unserialisable meta fails before writing
        self._store._put(self._store._step_path(self.step, MANIFEST), data)
        self._state = "committed"
        return manifest

    def _abort(self) -> None:
        """Forget the step: discard open uploads and delete the partial directory, best effort."""
        self._state = "aborted"
        for f in self._open:
            f.discard()
        with contextlib.suppress(Exception):
            self._store._rm(self._store._step_path(self.step), recursive=True)


class CheckpointStore:
    """Steps of one stage under one URL prefix; see the module docstring for the layout."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self._url = url.rstrip("/") or url
        self._fs, path = url_to_fs(self._url, **(storage_options or {}))
        self._path = path.rstrip("/") or path
        self._local = isinstance(self._fs, LocalFileSystem)

    @property
    def url(self) -> str:
        return self._url

    def _die_midway(self, step: int) -> bool:
        """RLFLOW_FAULT "<stage>:ckpt_inside:<step>" (a stage store's URL ends with its stage)."""
        return armed(self._url.rsplit("/", 1)[-1], "ckpt_inside", step)

    def _disk_full(self, step: int) -> bool:
        """RLFLOW_FAULT "<stage>:disk_full:<step>": the step's first file write raises ENOSPC."""
        return armed(self._url.rsplit("/", 1)[-1], "disk_full", step)

    def step_url(self, step: int) -> str:
        return f"{self._url}/step_{step:06d}"

    def _step_path(self, step: int, name: str = "") -> str:
        return f"{self._path}/step_{step:06d}" + (f"/{name}" if name else "")

    def _put(self, path: str, data: bytes) -> None:
        if self._local:
            put_local_atomic(path, data)
        else:
            self._fs.pipe_file(path, data)  # a single PUT is all-or-nothing on object stores

    def _cat(self, path: str) -> bytes | None:
        """Read a whole file, or None if absent; never served from a stale listing cache."""
        self._fs.invalidate_cache(path)
        try:
            return self._fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _rm(self, path: str, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(path, recursive=recursive)

    # In-flight records: what a step that has not committed needs to be rerun exactly (its tools'
    # outputs), JSON beside the steps under inflight/, part of no checkpoint; their owner removes them.

    def write_inflight(self, name: str, obj: Any) -> None:
        self._put(f"{self._path}/inflight/{name}", json.dumps(obj).encode())

    def read_inflight(self, name: str) -> Any | None:
        data = self._cat(f"{self._path}/inflight/{name}")
        return None if data is None else json.loads(data)

    def inflight_names(self) -> list[str]:
        self._fs.invalidate_cache(f"{self._path}/inflight")
        try:
            return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in self._fs.ls(f"{self._path}/inflight", detail=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_inflight(self, name: str) -> None:
        self._rm(f"{self._path}/inflight/{name}")

    def _step_dirs(self) -> list[int]:
        """Step numbers that have a directory, committed or not."""
        self._fs.invalidate_cache(self._path)  # see steps written by other processes
        try:
            entries = self._fs.ls(self._path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = (_STEP_RE.match(e.rstrip("/").rsplit("/", 1)[-1]) for e in entries)
        return sorted({int(m.group(1)) for m in found if m})

    def delete_step(self, step: int) -> None:
        """Delete a step (pruning, a rollback, a rewrite), manifest first, so a half-deleted step
        is never seen as committed."""
        self._rm(self._step_path(step, MANIFEST))
        self._rm(self._step_path(step), recursive=True)

    def _load_manifest(self, step: int) -> tuple[bytes, dict[str, Any]] | None:
        """Return (raw bytes, manifest), or None when the step is not committed."""
        raw = self._cat(self._step_path(step, MANIFEST))
        try:
            manifest = json.loads(raw)
            ok = manifest["step"] == step and isinstance(manifest["files"], dict)
        except (TypeError, ValueError, KeyError):  # absent, torn or hand-edited: commits nothing
            return None
        return (raw, manifest) if ok else None

    def _require_manifest(self, step: int) -> tuple[bytes, dict[str, Any]]:
        loaded = self._load_manifest(step)
        if loaded is None:
            raise CheckpointError(
                f"checkpoint {self.step_url(step)} is uncommitted or partial (no valid "
                f"{MANIFEST}); committed steps in {self._url}: {self.committed_steps() or 'none'}"
            )
        return loaded

    def _require_file(self, step: int, name: str) -> dict[str, Any]:
        files = self._require_manifest(step)[1]["files"]
        if name not in files:
            raise CheckpointError(f"{self.step_url(step)} has no file {name!r} in its manifest")
        return files[name]

    def put_shard(self, step: int, name: str, data: bytes) -> dict[str, Any]:
        """Write one file of an open step from another rank; return the record the committing
        rank adopts into the manifest. Uncommitted until that manifest exists, like any file."""
        path = self._step_path(step, check_name(name))
        if self._local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        faults = self._die_midway(step), self._disk_full(step)
        with HashingFile(self._fs.open(path, "wb"), name, lambda *_: None, self._local, *faults) as f:
            f.write(data)
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def committed_steps(self) -> list[int]:
        return [n for n in self._step_dirs() if self._load_manifest(n) is not None]

    def latest(self) -> int | None:
        return (self.committed_steps() or [None])[-1]

    def manifest(self, step: int) -> dict[str, Any]:
        return self._require_manifest(step)[1]

    def manifest_sha256(self, step: int) -> str:
        """sha256 of the manifest bytes: identifies exactly what a step contains."""
        return hashlib.sha256(self._require_manifest(step)[0]).hexdigest()

    def writer(self, step: int) -> StepWriter:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        return StepWriter(self, step)

    def open(self, step: int, name: str, mode: str = "rb") -> BinaryIO:
        """Open a committed file for reading (not hash-checked; ``verify`` does that)."""
        if mode not in ("rb", "r"):
            raise ValueError(f"checkpoint files are read with mode 'rb' or 'r', got {mode!r}")
        self._require_file(step, name)
        path = self._step_path(step, name)
        self._fs.invalidate_cache(path)  # a size cached before a rewrite would truncate reads
        return self._fs.open(path, mode)

    def read_bytes(self, step: int, name: str) -> bytes:
        """Read a committed file whole, checked against the manifest's size and sha256."""
        sink = io.BytesIO()
        self._stream_checked(step, name, self._require_file(step, name), sink)
        return sink.getvalue()

    def read_json(self, step: int, name: str) -> Any:
        return json.loads(self.read_bytes(step, name))

    def _stream_checked(self, step: int, name: str, entry: dict, sink: BinaryIO | None = None):
        """Hash a stored file against its manifest entry, copying it into ``sink`` if given."""
        path, where = self._step_path(step, name), f"{self.step_url(step)}/{name}"
        self._fs.invalidate_cache(path)  # a size cached before a rewrite would truncate reads
        try:
            f = self._fs.open(path, "rb")
        except FileNotFoundError:  # only the source's absence: a sink's errors are the sink's
            raise CheckpointError(f"{where} is listed in the manifest but missing") from None
        with f:
            size, sha = hash_stream(f, sink)
        if (size, sha) != (entry["size"], entry["sha256"]):
            raise CheckpointError(
                f"{where} is corrupted: size {size} sha256 {sha[:12]}..., "
                f"manifest says {entry['size']} {entry['sha256'][:12]}..."
            )

    def check_sizes(self, step: int) -> None:
        """A cheap check (one listing, no reads): every manifest file exists with its size; raise
        CheckpointError naming the first that does not."""
        root = self._step_path(step)
        self._fs.invalidate_cache(root)
        try:
            listed = self._fs.find(root, detail=True)
        except FileNotFoundError:
            listed = {}
        sizes = {p.rstrip("/")[len(root.rstrip("/")) + 1 :]: info.get("size") for p, info in listed.items()}
        for name, entry in self._require_manifest(step)[1]["files"].items():
            if sizes.get(name) != entry["size"]:
                where = f"{self.step_url(step)}/{name}"
                found = "missing" if name not in sizes else f"{sizes[name]} bytes, manifest says {entry['size']}"
                raise CheckpointError(f"{where} is damaged ({found})")

    def verify(self, step: int) -> None:
        """Re-hash every file against the manifest; raise CheckpointError naming a bad one."""
        for name, entry in self._require_manifest(step)[1]["files"].items():
            self._stream_checked(step, name, entry)

    def copy_step_from(
        self, source: CheckpointStore, step: int, retry: Callable[[Callable[[], Any]], Any] | None = None
    ) -> None:
        """Make ``step`` here a byte-identical copy of ``source``'s committed step.

        Files first, each hashed against the source's manifest on the way (a mismatch raises
        CheckpointError naming the source's file), the source's manifest bytes last, so the copy
        commits only once whole. ``retry(fn)`` runs each storage operation and may repeat it.
        """
        retry = retry or (lambda fn: fn())
        raw, manifest = source._require_manifest(step)
        retry(lambda: self.delete_step(step))  # never old and new files under one manifest
        for name, entry in manifest["files"].items():
            retry(lambda name=name, entry=entry: self._copy_file(source, step, name, entry))
        retry(lambda: self._put(self._step_path(step, MANIFEST), raw))

    def _copy_file(self, source: CheckpointStore, step: int, name: str, entry: dict[str, Any]) -> None:
        path = self._step_path(step, check_name(name))
        if self._local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with HashingFile(self._fs.open(path, "wb"), name, lambda *_: None, self._local) as sink:
            source._stream_checked(step, name, entry, sink)

    def copy_final_from(self, source: CheckpointStore) -> dict[str, Any]:
        """Copy ``source``'s final.json here byte for byte and return its record; its step must
        already be committed here with the same manifest (else CheckpointError)."""
        record = source.final()
        if record is None:
            raise CheckpointError(f"{source.url}/{FINAL} does not exist")
        if self.manifest_sha256(record["step"]) != record["manifest_sha256"]:
            raise CheckpointError(f"{self.step_url(record['step'])} is not the step {source.url}/{FINAL} names")
        self._put(f"{self._path}/{FINAL}", source._cat(f"{source._path}/{FINAL}"))
        return record

    def local_dir(self, step: int, cache_dir: str | None = None) -> str:
        """Return a local directory holding the step's files (e.g. for ``from_pretrained``).

        Local stores return the step directory itself. Remote steps are downloaded, sha256-
        checked, into ``cache_dir`` (default: $RLFLOW_CACHE_DIR or ~/.cache/rlflow/checkpoints),
        reused while the manifest is unchanged.
        """
        raw, manifest = self._require_manifest(step)
        if self._local:
            return self._step_path(step)
        # Keyed by manifest hash: a step rewritten under the same number is a new directory.
        cache_dir = cache_dir or os.environ.get("RLFLOW_CACHE_DIR") or os.path.expanduser("~/.cache/rlflow/checkpoints")
        dest = os.path.join(cache_dir, f"step_{step:06d}-{hashlib.sha256(raw).hexdigest()[:16]}")
        if os.path.isfile(os.path.join(dest, MANIFEST)):
            return dest  # complete: the directory only appears by the rename below
        tmp = f"{dest}.tmp-{uuid.uuid4().hex}"
        try:
            for name, entry in manifest["files"].items():
                local_path = os.path.join(tmp, *name.split("/"))
                os.makedirs(os.path.dirname(local_path), exist_ok=True)
                with open(local_path, "wb") as sink:
                    self._stream_checked(step, name, entry, sink)
            put_local_atomic(os.path.join(tmp, MANIFEST), raw)
            try:
                os.replace(tmp, dest)
            except OSError:  # fine if a concurrent caller (another rank) finished it first
                if not os.path.isfile(os.path.join(dest, MANIFEST)):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def prune(self, keep_last: int, protect: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """Delete old steps; return the step numbers whose directories were removed.

        Keeps the newest ``keep_last`` committed steps, ``protect`` and the final step. Uncommitted
        dirs older than the latest committed step (crashed writers' debris) go too; newer ones
        may belong to a running writer, so they stay.
        """
        committed = self.committed_steps()
        if not committed:
            return []
        final = self.final()
        keep = set(committed[max(0, len(committed) - keep_last) :]) | set(protect)
        keep |= {final["step"]} if final else set()
        removed = [n for n in committed if n not in keep]
        for n in removed:
            self.delete_step(n)
        debris = [n for n in self._step_dirs() if n < committed[-1] and n not in committed]
        for n in debris:
            self._rm(self._step_path(n), recursive=True)
        return sorted(removed + debris)

    def mark_final(self, step: int, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Record ``step`` as this stage's output in ``{prefix}/final.json``; return the record."""
        record = {**(meta or {}), "step": step, "manifest_sha256": self.manifest_sha256(step)}
        self._put(f"{self._path}/{FINAL}", json_bytes(record))
        return record

    def final(self) -> dict[str, Any] | None:
        """Return the final.json record, None if the stage has none; raise if it dangles."""
        where = f"{self._url}/{FINAL}"
        raw = self._cat(f"{self._path}/{FINAL}")
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            loaded = self._load_manifest(record["step"])
        except (ValueError, TypeError, KeyError):  # torn, or "step" is no integer
            record, loaded = {}, None
        if loaded is None:
            raise CheckpointError(
                f"{where} points to step {record.get('step')!r}, which is not "
                f"committed; delete {where} and rerun the stage"
            )
        if record.get("manifest_sha256") != hashlib.sha256(loaded[0]).hexdigest():
            raise CheckpointError(
                f"{where} points to step {record['step']}, whose manifest "
                f"changed since; delete {where} and rerun the stage"
            )
        return record


def model_location(uri_or_path: str, storage_options: dict[str, Any], prefix: str = "model") -> str:
    """A committed step URI -> a local dir with its model; anything else is a model path as is."""
    match = STEP_URI.match(uri_or_path)
    if not match:
        return uri_or_path
    store = CheckpointStore(match["prefix"], storage_options)
    return f"{store.local_dir(int(match['step']))}/{prefix}"
