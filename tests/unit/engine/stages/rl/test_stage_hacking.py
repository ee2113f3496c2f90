"""The hacking detector in the RL stage: a scripted collapse of the declared valid share stops the
round, its output is the last checkpoint before the diverged window (whole, kept from pruning),
and a stage killed after the stop finishes at the same checkpoint without training again."""

import os

import pytest

from conftest import RecordingSink, rl_inputs, small_config_tree
from helpers.stage_ctx import make_ctx, run
from rlflow.engine.config.schema import build_config
from rlflow.engine.storage.checkpoint import CheckpointStore


class MarkerSink(RecordingSink):
    """Creates `marker` once step `at` is logged: from the next step on, every answer is invalid."""

    def __init__(self, marker, at):
        super().__init__()
        self.marker, self.at = marker, at

    def log_metrics(self, metrics, step):
        super().log_metrics(metrics, step)
        if step == self.at and "actor/kl" in metrics:
            open(self.marker, "w").close()


def collapse_at_step_7(trained, small_assets, tmp_path, **sections):
    """The RL stage with the valid rule scripted to fail from step 7 on: (inputs, sink, outcome)."""
    sft_dir, rm_dir, norm = trained
    marker = str(tmp_path / "collapse")
    valid_rule = {"name": "valid", "type": "function", "fn": "helpers.reward_fns:valid_until_marker",
                  "weight": 0, "kwargs": {"marker": marker}}
    sections = {
        "rl": {"steps": 12, "rollout_batch": 16, "mini_batch": 8},
        "kl": {"stop_above": None},
        "reward": {"sources": [{"name": "rm", "type": "model"}, valid_rule], "workers": 1, "valid": "valid"},
        "hacking": {"enabled": True, "window": 3, "max_valid_drop": 0.1},
        "gold": {"fn": "helpers.reward_fns:zero"},
    } | sections
    cfg = build_config(small_config_tree(small_assets, tmp_path, **sections), "t")
    inputs = rl_inputs(cfg, sft_dir, rm_dir, norm, critic=rm_dir)
    sink = MarkerSink(marker, at=6)
    return inputs, sink, run(make_ctx(tmp_path, "rl", sink=sink, every=2, keep_last=1), inputs)


def test_a_collapsing_valid_share_stops_the_round_at_the_checkpoint_before_the_window(trained, small_assets, tmp_path):
    checkpoint = {"every_steps": 2, "keep_last": 1}
    inputs, sink, outcome = collapse_at_step_7(trained, small_assets, tmp_path, checkpoint=checkpoint)
    # Steps 1-6 all valid; step 7's window (5-7) averages 2/3, a drop of 1/3 > 0.1: stop at 7. The
    # window starts at step 5, so the candidate is step 4 (committed every 2 steps), not 6.
    assert [s for s, _ in sink.series("actor/pg_loss")] == list(range(1, 8))
    assert [v for _, v in sink.series("hacking/diverged")] == [0.0] * 6 + [1.0]
    assert sink.series("hacking/valid_drop")[-1] == (7, pytest.approx(1 / 3))
    assert outcome.step == 4 and outcome.checkpoint_uri.endswith("step_000004")
    assert outcome.metrics["hacking/stopped_at"] == 7 and outcome.metrics["hacking/window_start"] == 5
    assert outcome.metrics["rl/steps"] == 4
    store = CheckpointStore(f"{tmp_path}/rl")
    assert store.final()["step"] == 4 and os.path.isfile(f"{outcome.checkpoint_uri}/model/config.json")
    assert {4, 7} <= set(store.committed_steps())  # keep_last=1 kept the rollback target

    # Killed after the stop, before final.json: started again, it trains no step and ends at step 4.
    os.remove(f"{tmp_path}/rl/final.json")
    again = RecordingSink()
    resumed = run(make_ctx(tmp_path, "rl", sink=again, every=2, keep_last=1), inputs)
    assert resumed.step == 4 and resumed.resumed_from == 7 and again.series("actor/pg_loss") == []


def test_keep_best_on_the_judge_is_the_rollback_target_when_it_precedes_the_window(trained, small_assets, tmp_path):
    checkpoint = {"every_steps": 2, "keep_last": 1, "keep_best": "reward/valid/mean"}
    _, sink, outcome = collapse_at_step_7(trained, small_assets, tmp_path, checkpoint=checkpoint,
                                          eval={"every_steps": 3, "num_prompts": 16, "batch_size": 16})
    # Evaluated at steps 3 and 6 (valid share 1.0 both: the first stays best) and 7: step 3 is kept
    # whole and, preceding the window (5-7), it is the candidate rather than step 4.
    assert [s for s, _ in sink.series("eval/gold_score")] == [3, 6, 7]
    assert outcome.step == 3 and outcome.metrics["hacking/window_start"] == 5
    assert os.path.isfile(f"{outcome.checkpoint_uri}/model/config.json")
