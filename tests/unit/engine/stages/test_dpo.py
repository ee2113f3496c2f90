"""DPO: the stage on the tiny demo model (learning, metrics, the final checkpoint as a causal LM,
micro-batch independence, resume in-process and after a kill); the pure loss by hand: test_dpo_loss.py."""

import json
import math
import random
import shutil
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from conftest import RecordingSink, assert_weights_agree, small_config_tree
from helpers.stage_ctx import inputs, make_call, make_ctx, model, run
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.config.execution import StageConfig
from rlflow.engine.stages.dpo import DPOUpstream, sequence_logps
from rlflow.engine.stages.inputs import LabelsInput
from rlflow.engine.errors import DataError
from rlflow.engine.faults import KILLED_EXIT_CODE
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.data.batching import encode_pair

LOG2 = math.log(2.0)
TRAIN_METRICS = (
    "dpo/loss",
    "dpo/rewards/chosen",
    "dpo/rewards/rejected",
    "dpo/rewards/accuracy",
    "dpo/rewards/margin",
    "dpo/lr",
    "dpo/grad_norm",
)


# -- the stage on the tiny demo model ----------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on the shared 2-core test machines two threads per process oversubscribe
    the CPU and make the tiny model's many small ops ~10x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def dpo_data(small_assets, tmp_path_factory):
    """64 training and 32 held-out pairs of the demo preferences: 4 steps an epoch at batch 16."""
    root = tmp_path_factory.mktemp("dpo-data")
    for name, n in (("preferences", 64), ("preferences_eval", 32)):
        lines = (small_assets / "data" / f"{name}.jsonl").read_text().splitlines()[:n]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def dpo_tree(small_assets, dpo_data, root, **dpo):
    tree = small_config_tree(
        small_assets,
        root,
        dpo={"batch_size": 16, "epochs": 2, "lr": 1e-3, "warmup_steps": 0, "log_every": 1} | dpo,
        checkpoint={"every_steps": 2, "keep_last": 2, "consolidate_every": 2},
        run={"threads": 1},
    )
    tree["data"] |= {k: str(dpo_data / f"{k}.jsonl") for k in ("preferences", "preferences_eval")}
    return tree


def dpo_ctx(root, identity="dpo-1", sink=None, engine=None):
    return make_ctx(root, "dpo", identity, 2, sink, keep_last=2, consolidate_every=2, runtime=Runtime(engine))


def dpo(cfg, ctx, labels=None, include_offline=True):
    """The DPO stage from the untrained tiny model, both the start and the reference; `labels`: a
    file of online pairs besides (dpo.include_offline) data.preferences."""
    start = model(cfg.model.path)
    cfg = cfg.model_copy(update={"dpo": cfg.dpo.model_copy(update={"include_offline": include_offline})})
    online = None if labels is None else LabelsInput(identity="online", train=labels)
    return run(ctx, inputs(cfg, "dpo", DPOUpstream(init=start, reference=start, labels=online)))


@contextmanager
def library_thread_drawing_random_numbers():
    """What a Prefect, MLflow or botocore thread does with its retry jitter while a stage trains in
    the same process: draw from Python's and NumPy's global generators at times nobody controls."""
    stop = threading.Event()

    def draw():
        while not stop.wait(0.001):
            random.random(), np.random.rand()

    thread = threading.Thread(target=draw, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="module")
def first_run(small_assets, dpo_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-run")
    cfg = build_config(dpo_tree(small_assets, dpo_data, root), "t")
    sink = RecordingSink()
    with library_thread_drawing_random_numbers():  # the resume tests compare checkpoints with this run's
        return cfg, root, sink, dpo(cfg, dpo_ctx(root, sink=sink))


def test_stage_learns_the_preferences(first_run):
    cfg, root, sink, outcome = first_run
    assert [s for s, _ in sink.series("dpo/loss")] == list(range(1, 9))  # 2 epochs x 64 pairs / 16
    for _, metrics in sink.metrics:
        if "dpo/loss" in metrics:
            assert set(TRAIN_METRICS) <= set(metrics)
    losses = [v for _, v in sink.series("dpo/loss")]
    assert losses[0] == pytest.approx(LOG2, abs=1e-4)  # the policy starts as its reference
    assert sum(losses[-3:]) / 3 < losses[0] - 0.08
    accuracy = [v for _, v in sink.series("dpo/rewards/accuracy")]
    assert sum(accuracy[-3:]) / 3 > max(0.75, sum(accuracy[:3]) / 3 + 0.2)
    assert all(v > 0 for _, v in sink.series("dpo/rewards/margin")[-3:])
    assert 0.0 <= outcome.metrics["dpo/eval_accuracy"] <= 1.0 and outcome.metrics["dpo/eval_margin"] > 0
    assert outcome.metrics["dpo/pairs"] == 64 and outcome.step == 8
    assert CheckpointStore(f"{root}/dpo").committed_steps() == [6, 8]


def test_final_checkpoint_is_a_causal_lm_with_its_tokenizer(first_run):
    cfg, root, _, outcome = first_run
    policy = load_policy(f"{outcome.checkpoint_uri}/model")
    assert policy.config.model_type == "llama" and hasattr(policy, "lm_head")
    load_tokenizer(f"{outcome.checkpoint_uri}/model")
    before = load_policy(cfg.model.path).state_dict()
    moved = [k for k, v in policy.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert len(moved) > len(before) // 2
    again = dpo(cfg, dpo_ctx(root))  # finished: nothing runs twice
    assert again.skipped and again.manifest_sha256 == outcome.manifest_sha256


@pytest.mark.parametrize(
    "engine",
    [EngineConfig(micro_batch_size=3), EngineConfig(packing=True, max_tokens_per_microbatch=160)],
    ids=["rows", "packed-tokens"],
)
def test_micro_batches_do_not_change_the_update(first_run, engine, tmp_path):
    """The pair is the loss unit, normalised over the whole batch: micro-batches of 3 pairs (the
    last one short), or packed token-budget ones, give the one-batch update."""
    cfg, _, sink, outcome = first_run
    cut_sink = RecordingSink()
    cut = dpo(cfg, dpo_ctx(tmp_path, sink=cut_sink, engine=engine))
    assert len(cut_sink.series("dpo/loss")) == 8
    for (_, a), (_, b) in zip(sink.series("dpo/loss"), cut_sink.series("dpo/loss")):
        assert b == pytest.approx(a, abs=1e-5)
    weights = lambda o: load_policy(f"{o.checkpoint_uri}/model").state_dict()
    assert_weights_agree(weights(outcome), weights(cut), 1e-5)


def test_packed_sequence_logps_equal_padded(first_run, small_assets):
    cfg = first_run[0]
    tokenizer, model = load_tokenizer(cfg.model.path), load_policy(cfg.model.path)
    pairs = [json.loads(line) for line in (small_assets / "data" / "preferences.jsonl").read_text().splitlines()[:3]]
    rows = [encode_pair(tokenizer, p["prompt"], p[k], 64) for p in pairs for k in ("chosen", "rejected")]
    with torch.no_grad():
        padded = sequence_logps(model, rows, tokenizer.pad_token_id)
        packed = sequence_logps(model, rows, tokenizer.pad_token_id, packed=True)
        alone = torch.cat([sequence_logps(model, [r], tokenizer.pad_token_id) for r in rows])
    assert padded.shape == (6,) and (padded < 0).all()
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-4)
    torch.testing.assert_close(alone, padded, rtol=0, atol=1e-4)


def test_lora_dpo_trains_adapters_only_and_its_checkpoint_loads_as_a_causal_lm(small_assets, dpo_data, tmp_path):
    tree = dpo_tree(small_assets, dpo_data, tmp_path, epochs=1, lr=1e-2)
    cfg = build_config(tree | {"model": tree["model"] | {"lora": {"r": 4}}}, "t")
    sink = RecordingSink()
    outcome = dpo(cfg, dpo_ctx(tmp_path, sink=sink))
    losses = [v for _, v in sink.series("dpo/loss")]
    assert len(losses) == 4 and losses[0] == pytest.approx(LOG2, abs=1e-4)
    merged = load_policy(f"{outcome.checkpoint_uri}/model").state_dict()  # the base with adapters merged in
    base = load_policy(cfg.model.path).state_dict()
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not adapted
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


def test_rpo_adds_the_chosen_nll_and_keeps_chosen_answers_likely(first_run, small_assets, dpo_data, tmp_path):
    _, _, plain_sink, _ = first_run
    cfg = build_config(dpo_tree(small_assets, dpo_data, tmp_path, rpo_alpha=0.5), "t")
    sink = RecordingSink()
    dpo(cfg, dpo_ctx(tmp_path, sink=sink))
    (_, loss), (_, nll) = sink.series("dpo/loss")[0], sink.series("dpo/nll")[0]
    assert nll > 1.0  # the untrained model: several nats per token
    assert loss == pytest.approx(LOG2 + 0.5 * nll, abs=1e-4)  # step 1: policy == reference, DPO term log 2
    assert sink.series("dpo/nll")[0] == pytest.approx(plain_sink.series("dpo/nll")[0], abs=1e-6)  # same batch
    # Plain DPO lowers the chosen answers' likelihood along with the rejected ones'; RPO keeps it higher.
    last = lambda s: s.series("dpo/logps/chosen")[-1][1]
    assert last(sink) > last(plain_sink) + 1.0


def test_no_pairs_is_a_clear_error(first_run, tmp_path):
    cfg = first_run[0]
    with pytest.raises(DataError, match="no preference pairs.*include_offline is false"):
        dpo(cfg, dpo_ctx(tmp_path), include_offline=False)


def test_online_pairs_alone_train(first_run, dpo_data, tmp_path):
    cfg = first_run[0]
    outcome = dpo(cfg, dpo_ctx(tmp_path), str(dpo_data / "preferences.jsonl"), include_offline=False)
    assert outcome.metrics["dpo/pairs"] == 64


def test_resumed_stage_ends_exactly_like_an_uninterrupted_one(first_run, tmp_path, monkeypatch, caplog):
    cfg, root, sink, outcome = first_run
    shutil.copytree(root / "dpo", tmp_path / "dpo")
    store = CheckpointStore(f"{tmp_path}/dpo")
    # As if killed right after committing step 6: the later step and the final marker are gone.
    shutil.rmtree(tmp_path / "dpo" / "step_000008")
    (tmp_path / "dpo" / "final.json").unlink()
    resumed_sink = RecordingSink()
    resumed = dpo(cfg, dpo_ctx(tmp_path, sink=resumed_sink))
    assert resumed.resumed_from == 6 and [s for s, _ in resumed_sink.series("dpo/loss")] == [7, 8]
    reference = {s: m for s, m in sink.metrics}
    for step, metrics in resumed_sink.metrics:
        for key in (k for k in metrics if k.startswith("dpo/")):
            assert metrics[key] == reference[step][key], (step, key)
    assert files(store) == files(CheckpointStore(f"{root}/dpo"))  # weights, Adam state, schedule, RNG
    assert resumed.metrics == outcome.metrics
    # Killed between the last checkpoint and the final marker: nothing to train, the same outcome.
    # (Recomputed reference values that differ from the checkpoint's, e.g. on other hardware, are reported.)
    (tmp_path / "dpo" / "final.json").unlink()
    monkeypatch.setattr("rlflow.engine.stages.dpo.logps_sha256", lambda logps: "other")
    again = dpo(cfg, dpo_ctx(tmp_path))
    assert again.resumed_from == 8 and again.metrics == outcome.metrics  # train metrics from the checkpoint
    assert "reference log-probs recomputed on resume differ" in caplog.text


def files(store: CheckpointStore) -> dict[str, str]:
    final = store.final()["step"]
    store.verify(final)
    return {name: entry["sha256"] for name, entry in store.manifest(final)["files"].items()}


@pytest.mark.skipif(
    "dpo" not in StageConfig.model_fields,
    reason="engine/config/schema.py StageConfig has no `dpo` StagePolicy: the worker's make_context reads stage.policy('dpo')",
)
def test_worker_killed_mid_stage_resumes_to_the_uninterrupted_checkpoint(first_run, small_assets, dpo_data, tmp_path):
    """The real thing: `python -m rlflow.engine.stages.worker` killed after step 5's update (last commit:
    step 4), then run again, ends with the same files as the uninterrupted in-process run (both on
    one thread) and logs the same metrics at every step."""
    from helpers.stage_worker import finish_worker, start_worker

    _, ref_root, ref_sink, _ = first_run
    start = str(small_assets / "tiny-model")
    call = make_call(tmp_path, "dpo", DPOUpstream(init=model(start), reference=model(start)))
    tree = dpo_tree(small_assets, dpo_data, tmp_path)
    rc, killed_metrics, err = finish_worker(start_worker(tmp_path, tree, call, "update:5"))
    assert rc == KILLED_EXIT_CODE, err
    assert CheckpointStore(call.store_url).committed_steps() == [2, 4]
    rc, resumed_metrics, err = finish_worker(start_worker(tmp_path, tree, call, None))
    assert rc == 0, err
    assert json.loads((tmp_path / "outcome.json").read_text())["resumed_from"] == 4
    reference = dict(ref_sink.metrics)
    for step, metrics in killed_metrics + resumed_metrics:
        for key in (k for k in metrics if k.startswith("dpo/")):
            assert metrics[key] == reference[step][key], (step, key)
    assert {s for s, _ in resumed_metrics} >= {5, 6, 7, 8}
    assert files(CheckpointStore(call.store_url)) == files(CheckpointStore(f"{ref_root}/dpo"))
