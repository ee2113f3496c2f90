"""checkpoint.mirror against a real (moto) S3 server through s3fs: steps are copied in the
background with the manifest last, an outage neither stops training nor loses unmirrored steps,
and a resume restores lost or damaged primary steps from the mirror (or refuses them). At the end,
CheckpointMirror, make_mirror and MirrorLagSink called directly on local stores."""

import shutil
import socket
import threading
import time
import uuid
from contextlib import suppress

import pytest
import s3fs
import torch

from conftest import RecordingSink, _free_port, small_config_tree
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import CheckpointError
from rlflow.engine.config.execution import CheckpointConfig
from rlflow.engine.storage.mirror import LAG_METRIC, CheckpointMirror, MirrorLagSink, make_mirror
from rlflow.engine.models.loading import load_policy
from rlflow.engine.stages.lifecycle import completed_outcome, latest_resumable
from helpers.stage_ctx import model, run_call
from rlflow.engine.stages.identity import IDENTITY_FORMAT
from rlflow.engine.stages.sft import SFTUpstream
from rlflow.engine.stages.worker import StageCall, make_context

SHARD = "optim/model.rank00000.safetensors"
SECRET = "mirror-secret-never-logged"  # moto accepts any credentials; this one must not reach a log
# One attempt per request in botocore; the mirror's own retries (and backoff) are under test.
FAST_CLIENT = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 20}}


class Crash(RuntimeError):
    """Stands in for a process dying between two steps."""


class HookSink(RecordingSink):
    """Records metrics and runs hooks[step]() once, right after that step's metrics are logged."""

    def __init__(self, hooks=None):
        super().__init__()
        self.hooks = dict(hooks or {})

    def log_metrics(self, metrics, step):
        super().log_metrics(metrics, step)
        if step in self.hooks:
            self.hooks.pop(step)()


class TcpProxy:
    """A threaded TCP forwarder on a fixed 127.0.0.1 port; stop() refuses new connections and cuts
    live ones, as a network outage would, and start() brings it back on the same port."""

    def __init__(self, target_port: int):
        self.target, self.port = target_port, _free_port()
        self._server, self._threads, self._conns = None, [], []
        self._lock = threading.Lock()

    def start(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(64)
        self._server = server
        self._spawn(self._accept, server)

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, []
        with suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        server.close()
        for conn in conns:
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for thread in self._threads:
            thread.join(10)
        self._threads = []

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self, server) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                if self._server is not server:  # stopped while connecting: no connection outlives stop()
                    client.close()
                    upstream.close()
                    return
                self._conns += [client, upstream]
            self._spawn(self._pipe, client, upstream)
            self._spawn(self._pipe, upstream, client)

    @staticmethod
    def _pipe(src, dst) -> None:
        with suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class RecordingStore(CheckpointStore):
    """A mirror store that records the order in which copied files and manifests land."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.landed = []  # (step, file name) in completion order

    def _copy_file(self, source, step, name, entry):
        super()._copy_file(source, step, name, entry)
        self.landed.append((step, name))

    def _put(self, path, data):
        super()._put(path, data)
        step_dir, name = path.rsplit("/", 2)[-2:]
        if name == "manifest.json":
            self.landed.append((int(step_dir.removeprefix("step_")), name))


@pytest.fixture
def mirror_root(s3_bucket):
    """(mirror URL, direct storage options): a fresh prefix of the session bucket per test."""
    url, options = s3_bucket
    return f"{url}/mirror-{uuid.uuid4().hex[:8]}", options


def sft_config(assets, root, mirror_url=None, mirror_options=None, steps=8):
    checkpoint = {"every_steps": 2, "keep_last": 2}
    if mirror_url:
        checkpoint |= {"mirror": mirror_url, "mirror_storage_options": mirror_options}
        checkpoint |= {"mirror_retries": 2, "mirror_backoff_s": 0.02}
    sft = {"max_steps": steps, "eval_every": steps, "log_every": 1, "patience": 100}
    tree = small_config_tree(assets, root, sft=sft, checkpoint=checkpoint)
    tree["run"]["name"] = "m"
    return build_config(tree, "test")


def context(cfg, sink=None):
    url = stage_prefix(cfg.run.root, cfg.run.name, 0, "sft")
    call = StageCall(
        stage="sft", store_url=url, round_index=0, identity="mirror-test", identity_tree={"format": IDENTITY_FORMAT},
        upstream=SFTUpstream(init=model(cfg.model.path)).model_dump(mode="json"),
    )
    return make_context(cfg, call, sink or RecordingSink()), call


def run(cfg, sink=None):
    ctx, call = context(cfg, sink)
    return ctx, run_call(cfg, call, ctx)


def mirror_store(mirror_url, options):
    return CheckpointStore(f"{mirror_url}/m/round_0/sft", options)


def crash_after_mirrored(ctx_box):
    """A hook: once the mirror holds every submitted step, die."""

    def hook():
        assert ctx_box[0].mirror.wait(30)
        raise Crash

    return hook


def wait_until(predicate, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def weights(step_url):
    return load_policy(f"{step_url}/model").state_dict()


def assert_same_weights(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def mirror_records(caplog, text):
    return [r for r in caplog.records if r.name == "rlflow.engine.storage.mirror" and text in r.getMessage()]


def test_steps_and_final_are_mirrored_byte_identical_manifest_last(small_assets, tmp_path, mirror_root):
    url, options = mirror_root
    cfg = sft_config(small_assets, tmp_path, url, options, steps=4)
    sink = RecordingSink()
    ctx, call = context(cfg, sink)
    assert ctx.mirror.replica.url == f"{url}/m/round_0/sft"  # run.root replaced by the mirror URL
    ctx.mirror.replica = recording = RecordingStore(ctx.mirror.replica.url, options)
    outcome = run_call(cfg, call, ctx)

    primary, mirror = ctx.store, mirror_store(url, options)
    assert primary.committed_steps() == mirror.committed_steps() == [2, 4] and outcome.step == 4
    fs = s3fs.S3FileSystem(**options)
    for step in (2, 4):
        files = set(mirror.manifest(step)["files"])
        landed = [name for s, name in recording.landed if s == step]
        assert set(landed) == files | {"manifest.json"} and landed[-1] == "manifest.json"
        for name in files | {"manifest.json"}:
            with open(f"{primary.url}/step_{step:06d}/{name}", "rb") as f:
                assert fs.cat_file(f"{mirror.url}/step_{step:06d}/{name}") == f.read(), name
        mirror.verify(step)
    with open(f"{primary.url}/final.json", "rb") as f:
        assert fs.cat_file(f"{mirror.url}/final.json") == f.read()
    assert mirror.final()["step"] == 4
    assert all(m.get(LAG_METRIC) is not None for _, m in sink.metrics)  # every logged step reports the lag
    assert not ctx.mirror._thread.is_alive()  # the stage's end joined it


def test_outage_mid_run_keeps_training_protects_unmirrored_steps_and_catches_up(
    small_assets, tmp_path, mirror_root, caplog
):
    url, options = mirror_root
    endpoint_port = int(options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1])
    proxy = TcpProxy(endpoint_port)
    proxy.start()
    via_proxy = {
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}"},
        "key": "AKIAMIRRORTEST",
        "secret": SECRET,
        **FAST_CLIENT,
    }
    cfg = sft_config(small_assets, tmp_path, url, via_proxy, steps=12)
    seen = {}

    def outage_starts():
        assert ctx.mirror.wait(30)  # step 2 is on the mirror before it goes away
        proxy.stop()

    def outage_ends():
        seen["primary"] = ctx.store.committed_steps()
        wait_until(lambda: ctx.mirror.failing, "the mirror to notice the outage")
        proxy.start()

    sink = HookSink({3: outage_starts, 9: outage_ends})
    ctx, call = context(cfg, sink)
    try:
        outcome = run_call(cfg, call, ctx)
    finally:
        with suppress(OSError):
            proxy.stop()

    assert outcome.step == 12 and [s for s, _ in sink.series("sft/loss")] == list(range(1, 13))
    lag = dict(sink.series(LAG_METRIC))
    assert [lag[s] for s in (5, 7, 9)] == [1.0, 2.0, 3.0]  # steps 4, 6, 8 committed, none mirrored
    assert seen["primary"] == [4, 6, 8]  # keep_last=2 would have pruned step 4; 2 was mirrored
    mirror = mirror_store(url, options)
    assert ctx.store.committed_steps() == mirror.committed_steps() == [10, 12]
    for step in (10, 12):
        assert mirror.manifest_sha256(step) == ctx.store.manifest_sha256(step)
    assert mirror.final() == ctx.store.final()
    assert ctx.mirror.lag_steps() == 0
    assert len(mirror_records(caplog, "is failing")) == 1  # once per outage, not once per retry
    assert len(mirror_records(caplog, "is back after")) == 1
    assert SECRET not in caplog.text


def test_resume_restores_a_deleted_step_and_a_deleted_stage_from_the_mirror(
    small_assets, tmp_path, mirror_root, caplog
):
    url, options = mirror_root
    reference = run(sft_config(small_assets, tmp_path / "ref"))[1]
    cfg = sft_config(small_assets, tmp_path / "run", url, options)
    stage_dir = tmp_path / "run" / "m" / "round_0" / "sft"

    box = []
    ctx, call = context(cfg, HookSink({5: crash_after_mirrored(box)}))
    box.append(ctx)
    with pytest.raises(Crash):
        run_call(cfg, call, ctx)
    shutil.rmtree(stage_dir / "step_000004")  # the newest step is lost on the primary only

    box.clear()
    sink = HookSink({7: crash_after_mirrored(box)})
    ctx, call = context(cfg, sink)
    box.append(ctx)
    with pytest.raises(Crash):
        run_call(cfg, call, ctx)
    assert [s for s, _ in sink.series("sft/loss")] == [5, 6, 7]  # resumed from the mirror's step 4
    assert mirror_records(caplog, "restored step 4 from the mirror")
    shutil.rmtree(stage_dir)  # the whole primary stage is lost

    ctx, resumed = run(cfg)
    assert resumed.resumed_from == 6 and resumed.step == 8
    assert_same_weights(weights(reference.checkpoint_uri), weights(resumed.checkpoint_uri))

    shutil.rmtree(stage_dir)  # lost again after the stage finished: final.json comes back too
    ctx, again = run(cfg)
    assert again.skipped and again.manifest_sha256 == resumed.manifest_sha256
    assert mirror_records(caplog, "final.json was missing")
    ctx.store.verify(8)
    assert_same_weights(weights(reference.checkpoint_uri), weights(again.checkpoint_uri))


def test_damaged_primary_files_are_restored_or_refused(small_assets, tmp_path, mirror_root, caplog):
    url, options = mirror_root
    cfg = sft_config(small_assets, tmp_path, url, options, steps=4)
    run(cfg)
    fs, mirror = s3fs.S3FileSystem(**options), mirror_store(url, options)
    shard = tmp_path / "m" / "round_0" / "sft" / "step_000004" / SHARD
    good = shard.read_bytes()
    flipped = bytes([good[0] ^ 0xFF]) + good[1:]  # same size, other content

    # A finished stage is checked cheaply (files present with their sizes) each time it is skipped.
    shard.write_bytes(good[: len(good) // 2])  # truncated on the primary only: restored
    assert completed_outcome(context(cfg)[0]).skipped
    assert mirror_records(caplog, f"{SHARD} is damaged")
    assert shard.read_bytes() == good

    shard.write_bytes(good[:10])  # truncated on both: refused, naming the file
    fs.pipe_file(f"{mirror.url}/step_000004/{SHARD}", good[:10])
    with pytest.raises(CheckpointError, match=f"step_000004/{SHARD} is damaged.*mirror has no good copy"):
        completed_outcome(context(cfg)[0])

    # An unfinished stage (no final.json anywhere): the resume step is re-hashed in full.
    (tmp_path / "m" / "round_0" / "sft" / "final.json").unlink()
    fs.rm(f"{mirror.url}/final.json")
    fs.pipe_file(f"{mirror.url}/step_000004/{SHARD}", good)
    shard.write_bytes(flipped)
    assert latest_resumable(context(cfg)[0]) == 4  # altered on the primary only: restored
    assert shard.read_bytes() == good

    shard.write_bytes(flipped)
    fs.rm(f"{mirror.url}/step_000004", recursive=True)  # no mirror copy at all: refused
    with pytest.raises(CheckpointError, match=f"step_000004/{SHARD} is corrupted.*mirror has no good copy"):
        latest_resumable(context(cfg)[0])


# ------------------------------------------------------------------ the mirror called directly, local stores


def committed(store: CheckpointStore, *steps: int) -> CheckpointStore:
    """`store` with a small committed step for each of `steps`."""
    for step in steps:
        with store.writer(step) as w:
            w.write_bytes("model/w.bin", bytes([step]) * 100)
            w.write_bytes(SHARD, b"optimizer %d" % step)
    return store


def local_mirror(tmp_path, keep_last: int, *steps: int) -> CheckpointMirror:
    primary = committed(CheckpointStore(f"{tmp_path}/primary"), *steps)
    return CheckpointMirror(primary, CheckpointStore(f"{tmp_path}/replica"), keep_last, retries=1, backoff_s=0.01)


def test_make_mirror_puts_the_replica_under_the_mirror_url_and_none_without_one(tmp_path):
    primary = CheckpointStore(f"{tmp_path}/runs/r/round_1/ppo")
    assert make_mirror(primary, CheckpointConfig(), "r", 1, "ppo") is None
    cfg = CheckpointConfig(mirror=f"{tmp_path}/copy", keep_last=3, mirror_retries=4, mirror_backoff_s=0.5)
    mirror = make_mirror(primary, cfg, "r", 1, "ppo")
    assert mirror.primary is primary and mirror.replica.url == f"{tmp_path}/copy/r/round_1/ppo"
    assert (mirror.keep_last, mirror.retries, mirror.backoff_s) == (3, 4, 0.5)
    # each retry waits twice as long as the one before, never more than a minute
    assert [mirror._delay(a) for a in range(9)] == [0.5, 1, 2, 4, 8, 16, 32, 60, 60]


def test_submitted_steps_are_copied_byte_identical_and_older_ones_only_within_keep_last(tmp_path):
    for keep_last, copied in ((2, [2, 3]), (1, [3])):
        mirror = local_mirror(tmp_path / f"k{keep_last}", keep_last, 1, 2, 3)
        mirror.submit(3, keep=set())
        assert mirror.wait(30) and mirror.lag_steps() == 0 and not mirror.failing
        assert mirror.replica.committed_steps() == copied, keep_last
        for step in copied:
            assert mirror.replica.manifest_sha256(step) == mirror.primary.manifest_sha256(step)
            mirror.replica.verify(step)
        assert mirror.close() and mirror.close()  # safe twice


def test_repair_restores_a_deleted_primary_step_and_refuses_without_a_good_copy(tmp_path):
    mirror = local_mirror(tmp_path, 2, 1, 2)
    mirror.submit(2)
    assert mirror.wait(30)
    mirror.close()
    assert mirror.repair(2) is False  # whole on the primary: nothing to do
    mirror.primary.delete_step(2)
    assert mirror.repair(2) is True
    mirror.primary.verify(2)
    assert mirror.primary.read_bytes(2, "model/w.bin") == bytes([2]) * 100
    mirror.primary.delete_step(1)
    mirror.replica.delete_step(1)
    with pytest.raises(CheckpointError, match="the mirror has no good copy either"):
        mirror.repair(1)


def test_the_lag_sink_adds_the_mirrors_lag_to_every_step_and_forwards_the_rest(tmp_path):
    mirror = local_mirror(tmp_path, 2)
    recorded = RecordingSink()
    sink = MirrorLagSink(recorded, mirror)
    sink.log_metrics({"sft/loss": 1.5}, 4)
    sink.log_table("samples", [{"a": 1}])
    sink.log_text("uri.txt", "file:///x")
    assert recorded.metrics == [(4, {"sft/loss": 1.5, LAG_METRIC: 0.0})]
    assert (recorded.tables, recorded.texts) == ({"samples": [{"a": 1}]}, {"uri.txt": "file:///x"})
