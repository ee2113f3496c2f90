"""The records that cross process boundaries (a rank's outcome file, a task's persisted result):
one typed JSON round trip, with NaN metrics kept and nothing changed after they are built."""

import math

import pytest
from pydantic import ValidationError

from rlflow.engine.stages.context import Breach, StageContext, StageOutcome
from rlflow.engine.storage.checkpoint import CheckpointStore


def _outcome(**fields):
    base = dict(stage="ppo", round_index=1, step=7, checkpoint_uri="runs/t/round_1/ppo/step_000007")
    return StageOutcome(**base, manifest_sha256="ab" * 32, metrics={"actor/kl": 0.5}, **fields)


def test_an_outcome_with_a_breach_and_odd_metrics_survives_json_exactly():
    breach = Breach(reason="kl", step=7, metrics={"actor/kl": math.inf, "actor/kl_coef": math.nan}, message="m")
    outcome = _outcome(breach=breach, changed_keys=("rl.clip_ratio",), resumed_from=4)
    back = StageOutcome.model_validate_json(outcome.model_dump_json())
    assert back.breach.metrics["actor/kl"] == math.inf and math.isnan(back.breach.metrics["actor/kl_coef"])
    assert back.changed_keys == ("rl.clip_ratio",) and isinstance(back.changed_keys, tuple)
    assert (back.step, back.resumed_from, back.breach.reason) == (7, 4, "kl")


def test_records_are_frozen_and_refuse_unknown_fields():
    outcome = _outcome()
    with pytest.raises(ValidationError):
        outcome.step = 8
    with pytest.raises(ValidationError, match="stepz"):
        _outcome(stepz=3)
    with pytest.raises(ValidationError, match="metrics"):
        _outcome(breach={"reason": "kl", "step": 1, "metrics": {"kl": "high"}, "message": ""})


def test_a_context_is_labelled_by_round_and_stage(tmp_path):
    ctx = StageContext(CheckpointStore(str(tmp_path)), "rm", 2, 0, "id", {})
    assert ctx.label == "round 2 rm" and ctx.mirror is None
