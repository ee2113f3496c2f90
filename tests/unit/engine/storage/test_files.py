"""The byte-level pieces of checkpoint writing (rlflow.engine.storage.files): safe file names, hashed
streams, atomic local puts and the hashing upload wrapper."""

import array
import datetime
import errno
import hashlib
import io
import json
import os

import pytest

from rlflow.engine.errors import CheckpointError
from rlflow.engine.storage.files import MANIFEST, HashingFile, check_name, hash_stream
from rlflow.engine.storage.files import json_bytes, now_iso, put_local_atomic


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_names_that_could_leave_the_step_or_shadow_the_manifest_are_refused():
    for good in ("model/model.safetensors", "optim/actor.rank00000.safetensors", "a.json"):
        assert check_name(good) == good
    for bad in (MANIFEST, "../x", "model/../../x", "a//b", "./a", "/abs", "a\\b", "", "a/"):
        with pytest.raises(CheckpointError) as info:
            check_name(bad)
        assert str(info.value) == (
            f"invalid checkpoint file name {bad!r}: use a relative path like 'model/model.safetensors'"
            " ('manifest.json' is reserved)"
        )


def test_hash_stream_counts_hashes_and_copies():
    data = os.urandom(1000)
    sink = io.BytesIO()
    assert hash_stream(io.BytesIO(data), sink) == (len(data), sha(data))
    assert sink.getvalue() == data
    assert hash_stream(io.BytesIO(b"")) == (0, sha(b""))
    big = b"x" * (8 * 2**20 + 1)  # two reads of the 8 MiB chunk
    assert hash_stream(io.BytesIO(big)) == (len(big), sha(big))


def test_atomic_put_creates_folders_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a" / "b" / MANIFEST
    put_local_atomic(str(path), b"one")
    put_local_atomic(str(path), b"two")
    assert path.read_bytes() == b"two"
    assert os.listdir(path.parent) == [MANIFEST]


def test_json_bytes_and_timestamps():
    assert json_bytes({"step": 3, "files": {}}) == b'{\n  "step": 3,\n  "files": {}\n}\n'
    assert json.loads(json_bytes([1.5])) == [1.5]
    stamp = datetime.datetime.fromisoformat(now_iso())
    assert stamp.utcoffset() == datetime.timedelta(0) and stamp.microsecond == 0
    assert abs((datetime.datetime.now(datetime.timezone.utc) - stamp).total_seconds()) < 60


def test_a_hashing_file_records_size_and_hash_once_on_close(tmp_path):
    closed = []
    raw = open(tmp_path / "f", "wb")
    f = HashingFile(raw, "model/f", lambda *record: closed.append(record), fsync=True)
    assert f.write(b"abc") == 3
    assert f.write(array.array("i", [1, 2])) == 8  # the raw bytes of a typed array
    f.flush()
    f.close()
    f.close()
    written = (tmp_path / "f").read_bytes()
    assert written == b"abc" + array.array("i", [1, 2]).tobytes()
    assert closed == [("model/f", 11, sha(written))]


def test_a_failed_write_is_discarded_unrecorded_and_a_full_disk_raises_enospc(tmp_path):
    closed = []
    with pytest.raises(RuntimeError):
        with HashingFile(open(tmp_path / "f", "wb"), "f", lambda *r: closed.append(r)) as f:
            f.write(b"partial")
            raise RuntimeError("the writer failed")
    assert f.closed and closed == []
    full = HashingFile(open(tmp_path / "g", "wb"), "g", lambda *r: closed.append(r), disk_full=True)
    with pytest.raises(OSError) as info:
        full.write(b"x")
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, "g")
    full.discard()
    assert closed == [] and (tmp_path / "g").read_bytes() == b""
