"""The RLHF flow's choice of MLflow store and parent run (flows/rlhf.py settle_tracking_uri,
settle_parent_run): a continued run stays in the store and parent run it started with; a new run, or
a run whose folder was deleted, goes where it is told and gets a parent run of its own."""

import shutil

from conftest import small_config_tree


class ListLogger:
    def __init__(self):
        self.lines = []

    def warning(self, message, *args):
        self.lines.append(message % args)


def test_a_deleted_run_folder_started_again_gets_a_new_parent_run_and_the_old_one_keeps_its_params(
    tmp_path, small_assets
):
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.config.secrets import redacted_dict
    from rlflow.flows.rlhf import PARENT_FILE, settle_parent_run
    from rlflow.tasks.tracking import RunTracker

    root = tmp_path / "runs"
    tracker = RunTracker(f"sqlite:///{tmp_path}/mlflow.db", "exp")
    logger = ListLogger()

    def config(seed):
        return build_config(small_config_tree(small_assets, root, run={"name": "again", "seed": seed}), "t")

    first_cfg = config(1)
    (root / "again").mkdir(parents=True)
    first = settle_parent_run(first_cfg, tracker, redacted_dict(first_cfg), logger)
    assert (root / "again" / PARENT_FILE).read_text().strip() == first
    (root / "again" / "round_0").mkdir()  # its first round began
    assert settle_parent_run(first_cfg, tracker, redacted_dict(first_cfg), logger) == first  # continued

    shutil.rmtree(root / "again")  # the user deletes the run's folder and starts the name again
    (root / "again").mkdir()
    second_cfg = config(2)
    second = settle_parent_run(second_cfg, tracker, redacted_dict(second_cfg), logger)
    assert second != first and logger.lines == []
    assert tracker.client.get_run(second).data.params["run.seed"] == "2"
    assert tracker.client.get_run(first).data.params["run.seed"] == "1"  # the old run is as it was

    (root / "again" / PARENT_FILE).unlink()  # a run begun before runs recorded their parent
    (root / "again" / "round_0").mkdir()
    assert settle_parent_run(second_cfg, tracker, redacted_dict(second_cfg), logger) == first  # by name: oldest
    (root / "again" / PARENT_FILE).write_text("0123456789abcdef\n")  # a parent the store does not have
    third = settle_parent_run(second_cfg, tracker, redacted_dict(second_cfg), logger)
    assert third not in (first, second) and "does not have" in logger.lines[-1]
    assert (root / "again" / PARENT_FILE).read_text().strip() == third


def test_a_continued_run_stays_in_the_mlflow_store_it_started_in(tmp_path, small_assets, monkeypatch):
    from rlflow.engine.config.schema import build_config
    from rlflow.flows.rlhf import settle_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "runs"
    config = build_config(small_config_tree(small_assets, root, run={"name": "kept"}), "t")
    logger = ListLogger()
    first = settle_tracking_uri(config, logger)
    assert first == f"sqlite:///{root.resolve()}/mlflow.db" and logger.lines == []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")  # `make up` since the run started
    assert settle_tracking_uri(config, logger) == first
    assert "keeps its MLflow store" in logger.lines[-1]
    explicit = build_config(small_config_tree(small_assets, root, run={"name": "kept"}, tracking={"uri": "http://x:5000"}), "t")
    assert settle_tracking_uri(explicit, logger) == "http://x:5000" and "is not the store" in logger.lines[-1]
    fresh = build_config(small_config_tree(small_assets, root, run={"name": "new"}), "t")
    assert settle_tracking_uri(fresh, logger) == "http://127.0.0.1:5000"  # a new run goes where it is told
