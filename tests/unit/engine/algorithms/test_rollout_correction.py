"""Tests for rlflow.engine.algorithms.rollout_correction: importance weights between the sampler and
the trainer, truncated (tis) and masked (mis), per token and per sequence, and their metrics,
against hand arithmetic."""

import math

import pytest
import torch

from rlflow.engine.algorithms import rollout_correction as rc

T = torch.tensor
LN = math.log


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0.0)


# Row 0: trainer/sampler ratios 2, 1/4, 1 on three tokens; row 1: 1.5 on one token, then padding.
BEHAVIOUR = T([[-1.0, -1.0, -2.0], [-0.5, -7.0, -7.0]])
OLD = BEHAVIOUR + T([[LN(2.0), LN(0.25), 0.0], [LN(1.5), 3.0, -3.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def test_raw_weights_per_token_and_per_sequence_by_hand():
    close(rc.raw_importance_weights(OLD, BEHAVIOUR, MASK, "token"), [[2.0, 0.25, 1.0], [1.5, 1.0, 1.0]])
    # sequence: the product over the row's tokens (2 x 1/4 x 1 = 0.5), on each of them; 1 on padding
    close(rc.raw_importance_weights(OLD, BEHAVIOUR, MASK, "sequence"), [[0.5, 0.5, 0.5], [1.5, 1.0, 1.0]])
    with pytest.raises(ValueError, match="'row'.*token, sequence"):
        rc.raw_importance_weights(OLD, BEHAVIOUR, MASK, "row")


def test_truncated_and_masked_weights_by_hand():
    raw = rc.raw_importance_weights(OLD, BEHAVIOUR, MASK, "token")
    close(rc.importance_weights(raw, "none", 1.8), torch.ones(2, 3))
    close(rc.importance_weights(raw, "tis", 1.8), [[1.8, 0.25, 1.0], [1.5, 1.0, 1.0]])
    # mis, cap 3: keep [1/3, 3]; 1/4 falls outside
    close(rc.importance_weights(raw, "mis", 3.0), [[2.0, 0.0, 1.0], [1.5, 1.0, 1.0]])
    # cap 1.8: 2 is outside too
    close(rc.importance_weights(raw, "mis", 1.8), [[0.0, 0.0, 1.0], [1.5, 1.0, 1.0]])


def test_bad_mode_and_cap_are_refused():
    raw = torch.ones(1, 2)
    with pytest.raises(ValueError) as info:
        rc.importance_weights(raw, "icepop", 2.0)
    assert "'none', 'tis', 'mis'" in str(info.value)
    with pytest.raises(ValueError, match="> 1"):
        rc.importance_weights(raw, "tis", 1.0)


def test_metrics_by_hand():
    raw = rc.raw_importance_weights(OLD, BEHAVIOUR, MASK, "token")
    weights = rc.importance_weights(raw, "mis", 3.0)
    m = rc.correction_metrics(OLD, BEHAVIOUR, MASK, raw, weights)
    # k3 of KL(behaviour || old) with r = old / behaviour: r - 1 - log r, over the 4 real tokens
    k3 = [r - 1 - LN(r) for r in (2.0, 0.25, 1.0, 1.5)]
    close(m["rollout/mismatch_kl"], sum(k3) / 4)
    close(m["rollout/is_weight_mean"], (2.0 + 0.25 + 1.0 + 1.5) / 4)
    close(m["rollout/is_weight_max"], 2.0)  # the padding's ratios (e^3) are not counted
    close(m["rollout/masked_fraction"], 1 / 4)
    close(m["rollout/capped_fraction"], 0.0)
    truncated = rc.correction_metrics(OLD, BEHAVIOUR, MASK, raw, rc.importance_weights(raw, "tis", 1.8))
    close(truncated["rollout/capped_fraction"], 1 / 4)
    close(truncated["rollout/masked_fraction"], 0.0)


def test_identical_policies_give_weights_one_and_zero_gap():
    raw = rc.raw_importance_weights(BEHAVIOUR, BEHAVIOUR, MASK, "sequence")
    close(raw, torch.ones(2, 3))
    m = rc.correction_metrics(BEHAVIOUR, BEHAVIOUR, MASK, raw, rc.importance_weights(raw, "tis", 2.0))
    assert float(m["rollout/mismatch_kl"]) == 0.0 and float(m["rollout/is_weight_max"]) == 1.0


def test_all_masked_rows_give_finite_metrics():
    mask = torch.zeros(2, 3)
    raw = rc.raw_importance_weights(OLD, BEHAVIOUR, mask, "token")
    m = rc.correction_metrics(OLD, BEHAVIOUR, mask, raw, rc.importance_weights(raw, "mis", 2.0))
    assert all(math.isfinite(float(v)) for v in m.values())
    assert float(m["rollout/is_weight_max"]) == 0.0 and float(m["rollout/masked_fraction"]) == 0.0


def test_extreme_log_ratios_stay_finite():
    raw = rc.raw_importance_weights(T([[0.0]]), T([[-1e4]]), T([[1.0]]), "token")
    assert torch.isfinite(raw).all() and float(rc.importance_weights(raw, "tis", 2.0)) == 2.0
