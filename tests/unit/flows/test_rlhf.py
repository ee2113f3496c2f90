"""The RLHF flow's choice of MLflow store (flows/rlhf.py settle_tracking_uri): a continued run stays
in the store it started in; a new run goes where it is told."""

from conftest import small_config_tree


class ListLogger:
    def __init__(self):
        self.lines = []

    def warning(self, message, *args):
        self.lines.append(message % args)


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
