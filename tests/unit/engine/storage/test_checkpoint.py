"""Tests for rlflow.engine.storage.checkpoint: commit protocol, reads, verify, prune, final marker, and the
store and RunLock on S3 (RunLock on a local disk: test_lock.py)."""

import hashlib
import json
import os

import pytest

from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.storage.lock import RunLock
from rlflow.engine.errors import CheckpointError

WEIGHTS = bytes(range(256)) * 64


def _commit(store, step, payload=b"x", **meta):
    with store.writer(step) as w:
        w.write_bytes("model/weights.bin", payload)
        w.meta.update(meta)


@pytest.fixture(params=["path", "file_url", "relative"])
def store(request, tmp_path, monkeypatch):
    """A local store addressed as an absolute path, a file:// URL and a relative path."""
    if request.param == "path":
        return CheckpointStore(str(tmp_path / "run" / "round_0" / "ppo"))
    if request.param == "file_url":
        return CheckpointStore(f"file://{tmp_path}/run/round_0/ppo/")
    monkeypatch.chdir(tmp_path)
    return CheckpointStore("runs/run/round_0/ppo")


@pytest.fixture
def local(tmp_path):
    return CheckpointStore(str(tmp_path / "ppo"))


def test_stage_prefix():
    assert stage_prefix("runs/", "myrun", 0, "ppo") == "runs/myrun/round_0/ppo"
    assert stage_prefix("s3://b/x", "r", 2, "sft") == "s3://b/x/r/round_2/sft"
    with pytest.raises(CheckpointError):
        stage_prefix("runs", "a/b", 0, "ppo")


def test_commit_and_read_back(store, tmp_path):
    src = tmp_path / "hf_out"
    (src / "tok").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "tok" / "vocab.txt").write_text("hello")
    with store.writer(3) as w:
        with w.open("model/weights.bin", "wb") as f:
            f.write(WEIGHTS[:1000])
            f.write(memoryview(WEIGHTS[1000:]))
        w.write_json("state.json", {"lr": 0.1})
        assert w.put_dir(str(src), prefix="hf") == ["hf/config.json", "hf/tok/vocab.txt"]
        w.meta["kl"] = 0.5

    assert store.committed_steps() == [3] and store.latest() == 3
    m = store.manifest(3)
    assert m["step"] == 3 and m["meta"] == {"kl": 0.5} and "created" in m
    assert m["files"]["model/weights.bin"] == {"size": len(WEIGHTS), "sha256": hashlib.sha256(WEIGHTS).hexdigest()}
    assert set(m["files"]) == {"model/weights.bin", "state.json", "hf/config.json", "hf/tok/vocab.txt"}
    assert store.read_bytes(3, "model/weights.bin") == WEIGHTS
    assert store.read_json(3, "state.json") == {"lr": 0.1}
    with store.open(3, "hf/tok/vocab.txt") as f:
        assert f.read() == b"hello"
    store.verify(3)
    raw = open(os.path.join(store.local_dir(3), "manifest.json"), "rb").read()
    assert store.manifest_sha256(3) == hashlib.sha256(raw).hexdigest()
    assert os.path.isfile(os.path.join(store.local_dir(3), "hf", "config.json"))
    assert store.step_url(3) == store.url + "/step_000003"
    with pytest.raises(CheckpointError, match="no file 'nope'"):
        store.read_bytes(3, "nope")


def test_commit_meta_and_overwrite(local):
    with local.writer(1) as w:
        w.write_bytes("old.bin", b"old")
        w.write_bytes("same.bin", b"v1")
    with local.writer(1) as w:
        w.write_bytes("same.bin", b"v2")
        w.commit({"round": 1})
    assert local.manifest(1)["meta"] == {"round": 1}
    assert set(local.manifest(1)["files"]) == {"same.bin"}
    assert not os.path.exists(os.path.join(local.local_dir(1), "old.bin"))
    assert local.read_bytes(1, "same.bin") == b"v2"


def test_bad_names_are_refused(local):
    with pytest.raises(CheckpointError):
        with local.writer(1) as w:
            w.write_bytes("../escape", b"x")
    with pytest.raises(CheckpointError):
        with local.writer(1) as w:
            w.write_bytes("manifest.json", b"x")
    assert local.committed_steps() == []


def test_failed_writer_commits_nothing(local):
    _commit(local, 1)
    with pytest.raises(RuntimeError, match="boom"):
        with local.writer(2) as w:
            w.write_bytes("model/weights.bin", b"partial")
            raise RuntimeError("boom")
    assert local.committed_steps() == [1] and local.latest() == 1
    assert not os.path.exists(local.local_dir(1).replace("step_000001", "step_000002"))
    with pytest.raises(CheckpointError, match=r"step_000002 is uncommitted or partial"):
        local.manifest(2)


def test_files_without_manifest_are_invisible(local, tmp_path):
    partial = tmp_path / "ppo" / "step_000005" / "model"
    partial.mkdir(parents=True)
    (partial / "weights.bin").write_bytes(b"abc")
    garbled = tmp_path / "ppo" / "step_000006"
    garbled.mkdir()
    (garbled / "manifest.json").write_text('{"step": 6, "fi')  # torn manifest
    assert local.committed_steps() == [] and local.latest() is None
    for step in (5, 6):
        with pytest.raises(CheckpointError, match=f"{local.url}/step_00000{step} is uncommitted"):
            local.manifest(step)
    with pytest.raises(CheckpointError, match="uncommitted"):
        local.open(5, "model/weights.bin")
    with pytest.raises(CheckpointError, match="uncommitted"):
        local.local_dir(5)


def test_corrupted_file_fails_verify(local):
    _commit(local, 1, payload=b"good bytes")
    path = os.path.join(local.local_dir(1), "model", "weights.bin")
    with open(path, "wb") as f:
        f.write(b"evil bytes")  # same size, different content
    with pytest.raises(CheckpointError, match="model/weights.bin is corrupted"):
        local.verify(1)
    with pytest.raises(CheckpointError, match="corrupted"):
        local.read_bytes(1, "model/weights.bin")
    os.remove(path)
    with pytest.raises(CheckpointError, match="model/weights.bin is listed in the manifest but missing"):
        local.verify(1)


def test_prune_keeps_last_protected_and_final(local, tmp_path):
    for step in (1, 2, 3, 5, 6):
        _commit(local, step)
    for step in (4, 7):  # crashed-writer debris (4) and a possibly in-flight writer (7)
        d = tmp_path / "ppo" / f"step_{step:06d}"
        d.mkdir()
        (d / "weights.bin").write_bytes(b"partial")
    local.mark_final(2)
    assert local.prune(keep_last=2, protect={3}) == [1, 4]
    assert local.committed_steps() == [2, 3, 5, 6]
    assert sorted(os.listdir(tmp_path / "ppo")) == [
        "final.json",
        "step_000002",
        "step_000003",
        "step_000005",
        "step_000006",
        "step_000007",
    ]


def test_mark_final_and_final(local):
    assert local.final() is None
    with pytest.raises(CheckpointError, match="uncommitted"):
        local.mark_final(1)
    _commit(local, 1)
    rec = local.mark_final(1, {"reward": 0.7})
    assert local.final() == rec == {"step": 1, "manifest_sha256": local.manifest_sha256(1), "reward": 0.7}
    os.remove(os.path.join(local.local_dir(1), "manifest.json"))
    with pytest.raises(CheckpointError, match="points to step 1, which is not committed"):
        local.final()


def test_second_store_sees_commits(store):
    other = CheckpointStore(store.url)
    assert other.committed_steps() == []
    _commit(store, 1)
    assert other.committed_steps() == [1] and other.latest() == 1


# --- S3 (moto) -------------------------------------------------------------------------------


def test_s3_store(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    url = f"{bucket}/run/round_0/ppo"
    store = CheckpointStore(url, options)
    # A separate filesystem instance has its own listing cache, like another process would.
    other = CheckpointStore(url, {**options, "skip_instance_cache": True})
    _commit(store, 1, payload=WEIGHTS + b"\x01")
    assert other.committed_steps() == [1]
    other._fs.ls(other._path)  # a listing cached by any code path must not hide new commits
    for step in (2, 3):
        _commit(store, step, payload=WEIGHTS + bytes([step]))
    with pytest.raises(RuntimeError):
        with store.writer(4) as w:
            w.write_bytes("model/weights.bin", b"partial")
            raise RuntimeError("crash")
    assert other.committed_steps() == [1, 2, 3] and other.latest() == 3
    with pytest.raises(CheckpointError, match="uncommitted"):
        other.read_bytes(4, "model/weights.bin")
    assert other.read_bytes(3, "model/weights.bin") == WEIGHTS + b"\x03"
    other.verify(3)

    cache = str(tmp_path / "cache")
    d = store.local_dir(3, cache_dir=cache)
    assert open(os.path.join(d, "model", "weights.bin"), "rb").read() == WEIGHTS + b"\x03"
    assert store.local_dir(3, cache_dir=cache) == d  # cache hit
    assert open(os.path.join(store.local_dir(1), "model", "weights.bin"), "rb").read() == WEIGHTS + b"\x01"

    store.mark_final(1)
    assert store.prune(keep_last=1) == [2]
    assert other.committed_steps() == [1, 3] and other.final()["step"] == 1

    lock = RunLock(f"{bucket}/run", options)
    with lock:
        assert json.loads(lock._fs.cat_file(lock._path))["pid"] == os.getpid()
    assert not lock._fs.exists(lock._path)
    lock._fs.pipe_file(lock._path, json.dumps({"host": "elsewhere", "pid": 7, "started": "t"}).encode())
    with pytest.raises(CheckpointError, match="already being run by pid 7 on host elsewhere"):
        lock.acquire()
