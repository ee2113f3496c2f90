"""The deployment's pure parts: a config tree without secret references passes through as a copy,
and the rounds a run has finished are read from its summary."""

import json

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.flows.deployment import resolve_secret_refs, rounds_done


def test_a_tree_without_secret_references_is_copied_unchanged():
    tree = {"a": [1, {"b": "text"}], "c": "prefect-secretive but not a reference"}
    resolved = resolve_secret_refs(tree)
    assert resolved == tree and resolved is not tree and resolved["a"] is not tree["a"]


def test_rounds_done_counts_the_summarys_rounds(small_assets, tmp_path):
    config = build_config(small_config_tree(small_assets, tmp_path, run={"name": "d"}), "t")
    assert rounds_done(config) == 0  # no summary yet
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "summary.json").write_text(json.dumps({"rounds": [{"round": 0}, {"round": 1}]}))
    assert rounds_done(config) == 2
