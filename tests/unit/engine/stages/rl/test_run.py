"""The RL-run entry point on the small demo task: what `RLRun.open` builds from an inputs record
(models, objective, prompts, controller, reward pool), that a resumed stage's state goes in before
the reward pool starts, that `step` is one RL step and `close` leaves no process behind."""

import os

import pytest

from conftest import rl_inputs, small_config_tree
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import ConfigError
from rlflow.engine.stages.rl.experience import Objective
from rlflow.engine.stages.rl.run import RLRun

RULE = {"name": "len", "type": "length", "kwargs": {"target": 3}, "weight": 0.5}


def config(small_assets, tmp_path, **sections):
    return build_config(small_config_tree(small_assets, tmp_path, **sections), "t")


def test_open_builds_what_a_step_needs_and_a_step_trains(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = config(small_assets, tmp_path, reward={"sources": [{"name": "rm", "type": "model"}, RULE], "workers": 1})
    inputs = rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir)
    with RLRun.open(Runtime(), inputs, round_index=1) as run:
        assert run.objective == Objective.of(inputs) and run.round_index == 1
        assert run.models.critic is not None and run.models.scoring.score_norm == norm
        assert len(run.prompts.token_ids) > 0 and len(run.eval_prompts.token_ids) == cfg.eval.num_prompts
        assert run.controller.value == cfg.kl.coef and set(run.engines) == {"model", "critic"}
        pids = run.pool.pids
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        before = {k: v.clone() for k, v in run.models.actor.model.state_dict().items()}
        metrics = run.step(1)
        assert metrics["reward/len/mean"] >= 0 and "actor/pg_loss" in metrics and "timing_s/step" in metrics
        after = run.models.actor.model.state_dict()
        assert any(not (before[k] == after[k]).all() for k in before)
        assert run.evaluate().metrics["eval/gold_score"] >= 0
    assert not any(_alive(p) for p in pids)  # closed: the reward pool's workers are gone


def test_a_restore_happens_before_the_reward_pool_starts(trained, small_assets, tmp_path):
    sft_dir, rm_dir, norm = trained
    cfg = config(small_assets, tmp_path, reward={"sources": [{"name": "rm", "type": "model"}, RULE], "workers": 1})
    seen = []

    def restore(run):
        seen.append(run.pool)
        run.controller.load_state_dict({"value": 0.5})

    with RLRun.open(Runtime(), rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir), restore=restore) as run:
        assert seen == [None] and run.pool is not None and run.controller.value == 0.5


def test_a_reward_source_that_cannot_be_built_leaves_no_pool_running(trained, small_assets, tmp_path, monkeypatch):
    import rlflow.engine.stages.rl.run as run_module

    sft_dir, rm_dir, norm = trained
    cfg = config(small_assets, tmp_path, reward={"sources": [{"name": "rm", "type": "model"}, RULE], "workers": 1})
    started = []
    real = run_module.start_reward_pool
    monkeypatch.setattr(run_module, "start_reward_pool", lambda reward: started.append(real(reward)) or started[-1])

    def fail(*args, **kwargs):
        raise ConfigError("reward.sources[x].path: no such model")

    monkeypatch.setattr(run_module, "build_reward_source", fail)
    with pytest.raises(ConfigError, match="no such model"):
        RLRun.open(Runtime(), rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir))
    assert not any(_alive(p) for p in started[0].pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (killed, not reaped) is not alive either
        return f.read().split(")")[-1].split()[0] != "Z"
