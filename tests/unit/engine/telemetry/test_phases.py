"""A step's phases are collected where they are timed, without a dict passed down to them."""

import time

from rlflow.engine.telemetry.phases import add_phases, collect_phases, timed


def _sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


def test_repeated_phases_add_up_and_the_result_passes_through():
    with collect_phases() as phases:
        assert timed("timing_s/gen", lambda: _sleepy(0.02)) == "done"
        timed("timing_s/gen", lambda: _sleepy(0.02))
        timed("timing_s/ref", lambda: None)
        add_phases({"timing_s/update_weights": 1.5, "rollout/sync_gb_per_s": 3.0})
        add_phases({"timing_s/update_weights": 0.5})
    assert set(phases) == {"timing_s/gen", "timing_s/ref", "timing_s/update_weights", "rollout/sync_gb_per_s"}
    assert phases["timing_s/gen"] >= 0.04 and phases["timing_s/ref"] < phases["timing_s/gen"]
    assert phases["timing_s/update_weights"] == 2.0 and phases["rollout/sync_gb_per_s"] == 3.0


def test_outside_a_collection_nothing_is_recorded_and_nested_ones_stay_apart():
    assert timed("timing_s/gen", lambda: 7) == 7  # no collection open: fn only
    add_phases({"timing_s/gen": 1.0})
    with collect_phases() as outer:
        add_phases({"timing_s/a": 1.0})
        with collect_phases() as inner:
            add_phases({"timing_s/b": 2.0})
        add_phases({"timing_s/a": 1.0})
    assert outer == {"timing_s/a": 2.0} and inner == {"timing_s/b": 2.0}
    with collect_phases() as fresh:
        pass
    assert fresh == {}
