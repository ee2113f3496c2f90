"""The RL stage's guards while training: the KL circuit breaker (a breach result with a committed checkpoint,
then a continued stage), reward-source failures (fail, pause, fallback rule) and rollbacks."""

import dataclasses

import pytest

from conftest import RecordingSink, rl_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.stages.breaker import BREACH_KL, BREACH_REWARD, RLGuards, RLSafety, roll_back
from rlflow.engine.stages.context import StageOverrides
from rlflow.engine.storage.checkpoint import CheckpointStore
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.base import FunctionRef
from rlflow.engine.errors import CheckpointError, RewardSourceError
from rlflow.engine.rewards.sources import RewardSource
from rlflow.engine.rewards.sources import FALLBACK_METRIC

RULE = "rlflow.engine.tasksets.demo:gold_score"


def run_rl(trained, small_assets, tmp_path, guards, sink=None, every=10, steps=4):
    """The RL stage with `guards`' settings as config keys (kl.pause_*, reward.on_failure and
    fallback_rule) and its overrides as an operator's (the context's)."""
    sft_dir, rm_dir, norm = trained
    kl = {"stop_above": None, "controller": "fixed", "coef": 0.05}
    kl |= {"pause_above": guards.max_kl, "pause_patience": guards.kl_patience}
    reward = {"on_failure": guards.on_failure, "fallback_rule": guards.fallback_rule}
    tree = small_config_tree(small_assets, tmp_path, rl={"steps": steps, "actor_lr": 1e-3}, kl=kl, reward=reward)
    cfg = build_config(tree, "t")
    ctx = make_ctx(tmp_path, "rl", sink=sink or RecordingSink(), every=every, overrides=guards.overrides)
    outcome = run(ctx, rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir))
    return outcome, ctx.store


def test_kl_breach_commits_its_step_and_a_higher_max_kl_continues_to_the_end(trained, small_assets, tmp_path):
    # Step 1 samples from the reference itself (KL 0); every later step is above 1e-6.
    sink = RecordingSink()
    guards = RLGuards(max_kl=1e-6, kl_patience=2)
    outcome, store = run_rl(trained, small_assets, tmp_path, guards, sink)
    breach = outcome.breach
    assert breach is not None and breach.reason == BREACH_KL and breach.step == 3 and outcome.step == 3
    assert breach.metrics["actor/kl"] > 1e-6 and breach.metrics["safety/max_kl"] == 1e-6
    assert "kl.pause_above=1e-06" in breach.message and "kl.pause_patience=2" in breach.message
    assert store.committed_steps() == [3] and store.final() is None  # not finished: no final.json
    assert outcome.checkpoint_uri == store.step_url(3) and outcome.manifest_sha256 == store.manifest_sha256(3)
    meta = store.manifest(3)["meta"]
    assert meta["guards"]["breach"] == BREACH_KL and meta["consolidated"]  # whole model dirs to look at
    assert [v for _, v in sink.series("safety/kl_above_max_steps")] == [0.0, 1.0, 2.0]

    # Continue (what the flow does after the operator's answer): resumes at 3, new limit and coefficient.
    sink = RecordingSink()
    overrides = StageOverrides(max_kl=100.0, kl_coef=0.2, from_step=3)
    done, _ = run_rl(trained, small_assets, tmp_path, dataclasses.replace(guards, overrides=overrides), sink)
    assert done.breach is None and done.resumed_from == 3 and done.step == 4
    assert store.final()["step"] == 4
    assert [s for s, _ in sink.series("actor/pg_loss")] == [4]
    assert sink.series("actor/kl_coef") == [(4, 0.2)] and sink.series("safety/kl_above_max_steps") == [(4, 0.0)]
    assert store.manifest(4)["meta"]["guards"]["max_kl_override"] == 100.0  # a later resume keeps it


def _safety(guards, saved=None, resume=None):
    class Controller:
        value = 0.05

        def load_state_dict(self, state):
            self.value = state["value"]

    controller = Controller()
    reward = RewardSource([], guards.fallback_rule)  # no reward model is called here
    return RLSafety(guards, "t", saved, resume, controller, reward), controller


def test_overrides_outlive_their_flow_run_but_not_a_changed_config():
    saved = _safety(RLGuards(max_kl=0.1, overrides=StageOverrides(max_kl=0.5)))[0].state_dict()
    assert _safety(RLGuards(max_kl=0.1), saved, resume=5)[0].max_kl == 0.5  # kept across a resume
    assert _safety(RLGuards(max_kl=0.3), saved, resume=5)[0].max_kl == 0.3  # the config changed since: it wins
    # kl_coef applies when resuming at (or before) the step it was given for, not from a later checkpoint.
    assert _safety(RLGuards(overrides=StageOverrides(kl_coef=0.4, from_step=5)), None, 5)[1].value == 0.4
    assert _safety(RLGuards(overrides=StageOverrides(kl_coef=0.4, from_step=5)), None, 7)[1].value == 0.05
    # A breach checkpoint restarts the breaker's count; any other checkpoint keeps it.
    tripped = {**saved, "kl_above": 3}
    assert _safety(RLGuards(max_kl=0.1), {**tripped, "breach": BREACH_KL}, 5)[0].state.kl_above == 0
    assert _safety(RLGuards(max_kl=0.1), tripped, 5)[0].state.kl_above == 3
    metrics = {"actor/kl": float("nan")}
    assert _safety(RLGuards(max_kl=0.1, kl_patience=1))[0].observe(1, metrics, False).reason == BREACH_KL


def test_reward_failure_fail_stops_the_stage_with_its_checkpoint_intact(trained, small_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_FAULT", "rl:reward_error:2")
    with pytest.raises(RewardSourceError, match=r"round 0 rl step 2: .*reward.on_failure=fail"):
        run_rl(trained, small_assets, tmp_path, RLGuards(on_failure="fail"), every=1, steps=3)
    store = CheckpointStore(f"{tmp_path}/rl")
    assert store.committed_steps() == [1] and store.final() is None


def test_reward_failure_pause_commits_the_last_completed_step(trained, small_assets, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLOW_FAULT", "rl:reward_error:2")
    outcome, store = run_rl(trained, small_assets, tmp_path, RLGuards(on_failure="pause"), steps=3)
    breach = outcome.breach
    assert breach.reason == BREACH_REWARD and breach.step == 1 and breach.metrics["reward/failed_step"] == 2
    assert store.committed_steps() == [1] and store.final() is None  # step 1 was not due, the pause committed it
    monkeypatch.delenv("RLFLOW_FAULT")  # the reward source is back: continuing retries step 2 with it
    done, _ = run_rl(trained, small_assets, tmp_path, RLGuards(on_failure="pause"), steps=3)
    assert done.breach is None and done.resumed_from == 1 and store.final()["step"] == 3


def test_fallback_rule_scores_the_rest_of_the_stage_and_survives_a_resume(trained, small_assets, tmp_path, monkeypatch):
    from rlflow.tasks.stages import StageResult, guard_tags

    # The KL breaker trips at step 2, after the switch to the rule: a resume follows.
    rule = FunctionRef(fn=RULE)
    guards = RLGuards(max_kl=1e-6, kl_patience=1, on_failure="fallback_rule", fallback_rule=rule)
    sink = RecordingSink()
    monkeypatch.setenv("RLFLOW_FAULT", "rl:reward_error:2")
    paused, store = run_rl(trained, small_assets, tmp_path, guards, sink, steps=3)
    assert paused.breach.reason == BREACH_KL and paused.breach.step == 2
    result = StageResult(**dict(paused), mlflow_run_id="r")
    assert result.breach == paused.breach
    assert StageResult.model_validate_json(result.model_dump_json()) == result  # Prefect persists JSON
    fallback = store.manifest(2)["meta"]["guards"]["fallback"]
    assert fallback["fn"] == RULE and fallback["std"] > 0  # the rule's frozen normalisation
    monkeypatch.delenv("RLFLOW_FAULT")
    overrides = StageOverrides(max_kl=100.0, from_step=2)
    done, _ = run_rl(trained, small_assets, tmp_path, dataclasses.replace(guards, overrides=overrides), sink, steps=3)
    assert done.breach is None and done.resumed_from == 2 and done.metrics[FALLBACK_METRIC] == 1.0
    assert sink.series(FALLBACK_METRIC) == [(1, 0.0), (2, 1.0), (3, 1.0)]  # step 3 ran after the resume: still the rule
    config = build_config({"reward": {"on_failure": "fallback_rule", "fallback_rule": {"fn": RULE}}}, "t")
    assert guard_tags(config, paused) == {"rlflow.breach": "kl at step 2", "rlflow.reward_fallback": RULE}
    assert guard_tags(config, done) == {"rlflow.reward_fallback": RULE}  # the MLflow child run's tags


def test_roll_back_deletes_only_later_steps_on_both_stores(tmp_path):
    store, replica = CheckpointStore(f"{tmp_path}/primary"), CheckpointStore(f"{tmp_path}/mirror")
    for target in (store, replica):
        for step in (2, 4, 6):
            with target.writer(step) as writer:
                writer.write_bytes("x.bin", b"x")
    with pytest.raises(CheckpointError, match=r"step 5 .* not a committed step"):
        roll_back(store, 5, replica)
    assert roll_back(store, 4, replica) == [6]
    assert store.committed_steps() == replica.committed_steps() == [2, 4]
    store.mark_final(4)
    with pytest.raises(CheckpointError, match="already finished"):
        roll_back(store, 2)


def test_a_rule_that_scores_everything_alike_keeps_a_unit_scale():
    import torch

    from rlflow.engine.data.records import PromptRecord
    from rlflow.engine.rewards.sources import RewardSource

    source = RewardSource([], FunctionRef(fn="helpers.reward_fns:constant_rule"))
    assert source.activate_fallback() == "helpers.reward_fns:constant_rule"
    scores = source.final_scores(torch.zeros(4, 0), [PromptRecord("p", {})] * 4, ["a", "b", "c", "d"])
    assert torch.equal(scores, torch.zeros(4)) and source.fallback.std == 1.0


def test_non_finite_reward_model_scores_are_a_reward_source_failure(trained):
    import torch

    from rlflow.engine.models.loading import load_scalar_model, scalar_head
    from rlflow.engine.rewards.sources import LearnedSource, RewardSource
    from rlflow.engine.rollout.generate import RolloutBatch

    _, rm_dir, score_norm = trained
    model = load_scalar_model(rm_dir).eval()
    batch = RolloutBatch(
        input_ids=torch.tensor([[5, 6, 7, 8], [5, 6, 9, 10]]),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        response_mask=torch.ones(2, 2),
        prompt_width=2,
        response_texts=("a", "b"),
    )
    source = RewardSource([LearnedSource("rm", 1.0, model, score_norm)], None)
    source.model_scores(batch, 2, step=3)
    source.settle()  # finite scores: no failure
    with torch.no_grad():
        scalar_head(model).weight.fill_(float("nan"))  # what an overflowing reward model returns
    source.model_scores(batch, 2, step=4)
    with pytest.raises(RewardSourceError, match=r"2 non-finite score\(s\) of 2 at step 4"):
        source.settle()
