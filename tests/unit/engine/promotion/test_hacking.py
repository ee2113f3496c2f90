"""The reward-hacking detector on synthetic per-step traces: each check's stop point and window,
the window changes by hand, checks without data skipped, and the rollback step."""

import pytest

from rlflow.engine.promotion.hacking import DetectorLimits, candidate_step, detect_divergence, window_changes

LIMITS = DetectorLimits(window=3, min_judge_drop=0.0, max_valid_drop=0.1, max_spread_ratio=2.0)


def trace(proxy, judge=None, valid=None, spread=None):
    n = len(proxy)
    columns = [judge or [None] * n, valid or [None] * n, spread or [None] * n]
    return [[i + 1, proxy[i], *(c[i] for c in columns)] for i in range(n)]


def first_divergence(history, limits=LIMITS):
    """The detector as the RL stage runs it: once per step, on the steps so far."""
    for n in range(1, len(history) + 1):
        if (found := detect_divergence(history[:n], limits)) is not None:
            return found
    return None


def test_window_changes_are_the_last_windows_means_against_the_first_by_hand():
    history = trace([0, 1, 2, 3, 4, 5], judge=[1, 1, 1, 0.5, 0.5, 0.2], valid=[1, 1, 0.7, 1, 0.4, 0.4],
                    spread=[0.1, 0.1, 0.1, 0.3, 0.3, 0.3])
    changes = window_changes(history, 3)
    assert changes["hacking/proxy_gain"] == pytest.approx(4 - 1)
    assert changes["hacking/judge_gain"] == pytest.approx(0.4 - 1)
    # Steps 4-6's judge: mean 0.4, sample variance (0.01 + 0.01 + 0.04) / 2 = 0.03; steps 1-3's: 0.
    assert changes["hacking/judge_gain_stderr"] == pytest.approx((0.03 / 3) ** 0.5)
    assert changes["hacking/valid_drop"] == pytest.approx(0.9 - 0.6)
    assert changes["hacking/spread_ratio"] == pytest.approx(3.0)
    assert window_changes(history[:5], 3) == {}  # two whole windows first


def test_a_valid_share_that_falls_stops_at_the_first_window_beyond_the_limit():
    valid = [1.0] * 8 + [0.8] * 6  # steps 9+ lose a fifth of their valid answers
    found = first_divergence(trace([0.0] * 14, valid=valid))
    # Step 9's window (7-9) averages 0.933: within 0.1. Step 10's (8-10) 0.867: beyond.
    assert (found.step, found.window_start, found.signal) == (10, 8, "valid_drop")
    assert "valid share fell 0.133 (max 0.1), steps 8-10 against steps 1-3" in found.message
    assert candidate_step([2, 4, 6, 8, 10], found.window_start) == 6  # the window's own steps are out
    assert candidate_step([8, 10], found.window_start) is None


def test_a_rising_proxy_with_a_falling_judge_diverges_and_a_judge_that_follows_does_not():
    proxy = [0.1 * i for i in range(10)]
    falling = [0.5] * 5 + [0.4] * 5
    found = first_divergence(trace(proxy, judge=falling))
    # Step 6's window (0.5, 0.5, 0.4) fell 0.033, within twice its standard error (0.067); step 8's
    # (0.4, 0.4, 0.4) fell 0.1 with none.
    assert (found.step, found.window_start, found.signal) == (8, 6, "proxy_vs_judge")
    noisy = [0.5, 0.3, 0.7, 0.4, 0.6, 0.45, 0.35, 0.55, 0.4, 0.5]  # wobbles around 0.47: no fall
    assert first_divergence(trace(proxy, judge=noisy)) is None
    assert first_divergence(trace(proxy, judge=[0.5 + 0.01 * i for i in range(10)])) is None
    # A tolerance: the judge may fall up to min_judge_drop.
    tolerant = DetectorLimits(3, min_judge_drop=0.2, max_valid_drop=None, max_spread_ratio=None)
    assert first_divergence(trace(proxy, judge=falling), tolerant) is None
    # A falling proxy is not reward hacking, whatever the judge does.
    assert first_divergence(trace(proxy[::-1], judge=falling)) is None


def test_a_growing_ensemble_spread_diverges_past_its_ratio():
    found = first_divergence(trace([0.0] * 9, spread=[0.05] * 3 + [0.08] * 3 + [0.12] * 3))
    assert (found.step, found.signal) == (8, "spread")  # (0.08 + 0.12 + 0.12) / 3 / 0.05 = 2.13


def test_checks_without_their_signal_or_their_limit_are_skipped():
    history = trace([0.1 * i for i in range(10)], valid=[1.0] * 5 + [0.0] * 5)
    assert first_divergence(history, DetectorLimits(3, 0.0, None, 2.0)) is None  # no judge, no spread
    assert first_divergence(history).signal == "valid_drop"
    assert first_divergence(trace([0.0] * 10)) is None
