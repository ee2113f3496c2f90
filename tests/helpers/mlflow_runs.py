"""A run's MLflow records written as the flow writes them, into a real local sqlite store: the parent
run (tagged with the run name, the config as params) and one child run per (round, stage) with its
metric histories and a chosen wall time, through tasks/tracking.py's RunTracker."""

from rlflow.tasks.tracking import RunTracker

# round -> stage -> (seconds, {metric key: [(step, value), ...]})
RoundRuns = dict[int, dict[str, tuple[float, dict[str, list[tuple[int, float]]]]]]


def tracker_at(tmp_path, experiment: str = "rlflow") -> RunTracker:
    return RunTracker(f"sqlite:///{tmp_path}/m.db", experiment)


def record_run(tracker: RunTracker, name: str, rounds: RoundRuns, config_tree: dict | None = None) -> str:
    """The parent run of `name` and its children; returns the parent's run id."""
    parent = tracker.parent_run(name, config_tree or {"run": {"name": name}})
    for round_index, stages in rounds.items():
        for stage, (seconds, metrics) in stages.items():
            child = tracker.child_run(parent, round_index, stage)
            sink = tracker.sink(child)
            for key, points in metrics.items():
                for step, value in points:
                    sink.log_metrics({key: value}, step)
            start = tracker.client.get_run(child).info.start_time
            tracker.client.set_terminated(child, "FINISHED", end_time=start + int(seconds * 1000))
    tracker.finish(parent)
    return parent


def eval_metrics(before: float, after: float, rm_score: float, kl: float) -> dict[str, list[tuple[int, float]]]:
    """An eval child's metrics: "before" at step 0, "after" at step 1."""
    return {
        "eval/gold_score": [(0, before), (1, after)],
        "eval/rm_score": [(0, rm_score - 1.0), (1, rm_score)],
        "eval/kl": [(0, 0.0), (1, kl)],
    }
