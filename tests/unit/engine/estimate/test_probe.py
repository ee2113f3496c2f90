"""The probe's statistics: step-time percentiles without the warm-up step, tokens/s, trend slopes."""

import numpy as np
import pytest

from rlflow.engine.estimate.probe import ProbeReport, ProbeStep, least_squares_slope


def _step(i: int, seconds: float, reward: float, kl: float) -> ProbeStep:
    return ProbeStep(i, seconds, 100, 160, reward, kl, {"timing_s/gen": seconds / 2, "timing_s/step": seconds})


def test_slope_is_the_least_squares_fit():
    xs, ys = [1.0, 2.0, 3.0, 4.0, 5.0], [0.1, 0.35, 0.2, 0.6, 0.7]
    assert least_squares_slope(xs, ys) == pytest.approx(np.polyfit(xs, ys, 1)[0])
    assert least_squares_slope([1.0], [3.0]) == 0.0


def test_report_times_all_but_the_warm_up_step():
    seconds = [9.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    steps = tuple(_step(i + 1, s, 0.1 * i, 0.01 * i) for i, s in enumerate(seconds))
    report = ProbeReport(steps, 1.0, 100, 350, None, 7)
    stats = report.step_seconds()
    assert stats == {"mean": pytest.approx(5.5), "p50": pytest.approx(5.5), "p90": 9.0}
    assert report.tokens_per_second() == {"generated": pytest.approx(1000 / 55), "processed": pytest.approx(1600 / 55)}
    assert report.phase_seconds()["timing_s/gen"] == pytest.approx(2.75)
    assert report.trends() == {"reward_per_step": pytest.approx(0.1), "kl_per_step": pytest.approx(0.01)}
    assert report.peak_rss_above_baseline == 250
    single = ProbeReport(steps[:1], 1.0, 0, 0, None, 7)
    assert single.step_seconds()["mean"] == 9.0  # one step: it is all there is


def test_the_peak_is_this_processs_own_not_its_parents():
    """ru_maxrss survives execve: a probe started by a big process would report the parent's size."""
    import subprocess
    import sys

    held = bytearray(1 << 30)
    held[:: 4096] = b"\1" * len(held[:: 4096])  # 1 GiB resident in this (the parent) process
    code = "from rlflow.engine.estimate.probe import peak_resident_bytes as p; print(p())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 10 << 20 < child < 512 << 20  # the child's own imports, not the parent's gigabyte
    del held
