"""`rlflow export` on a run laid out as the flow leaves it (config.yaml, summary.json, a committed
final PPO step holding the tiny model, its policy registered in a sqlite MLflow store): the
exported directory, its generation config's sampling, its card's lineage and evaluation rows."""

import argparse
import json

import pytest
import yaml

from conftest import small_config_tree
from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import ConfigError
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.flows.cli.export import EVAL_COLUMNS, command_export, lineage_of
from rlflow.tasks.tracking import RunTracker, register_policy

RUN = "exp"
SUMMARY = [
    {"round": 0, "gold_score_before": 0.1, "gold_score_after": 0.3, "kl": 0.5, "rm_accuracy": 0.6, "response_length": 9.0, "seconds": 4.0},
    {"round": 1, "gold_score_before": 0.3, "gold_score_after": 0.45, "kl": 0.75, "rm_accuracy": 0.7, "response_length": 10.0},
    {"round": 2, "gold_score_before": 0.45, "gold_score_after": 0.5, "kl": 0.9, "rm_accuracy": 0.8, "response_length": 11.0},
]  # fmt: skip
CLEAN = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "README.md",
    "tokenizer.json",
    "tokenizer_config.json",
}


def commit_policy(cfg, round_index, model_dir) -> CheckpointStore:
    """The round's PPO stage output: step 3 holding the model under model/, marked final."""
    store = CheckpointStore(stage_prefix(cfg.run.root, cfg.run.name, round_index, "rl"))
    with store.writer(3) as w:
        w.put_dir(str(model_dir), "model")
    store.mark_final(3)
    return store


def register(cfg, round_index, store) -> str:
    tracker = RunTracker(cfg.tracking.uri, cfg.tracking.experiment)
    run_id = tracker.parent_run(cfg.run.name, {"run": {"name": cfg.run.name}})
    tags = {
        "rlflow.checkpoint_uri": store.step_url(3),
        "rlflow.manifest_sha256": store.manifest_sha256(3),
        "rlflow.parent_run_id": run_id,
        "rlflow.data.prompts": f"sha-of-prompts-{round_index}",
    }
    return register_policy(tracker.client, cfg.run.name, round_index, run_id, tags)


@pytest.fixture(scope="module")
def run(small_assets, tmp_path_factory):
    """(root, config) of run `exp` with round 1 of PPO committed and registered (read only: each
    test exports into its own tmp_path)."""
    tmp_path = tmp_path_factory.mktemp("export-run")
    root = tmp_path / "runs"
    tree = small_config_tree(
        small_assets,
        root,
        run={"name": RUN, "rounds": 3},
        sampling={"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12},
        tracking={"uri": f"sqlite:///{tmp_path}/m.db"},
    )
    (root / RUN).mkdir(parents=True)
    (root / RUN / "config.yaml").write_text(yaml.safe_dump(tree))
    (root / RUN / "summary.json").write_text(json.dumps({"run": RUN, "rounds": SUMMARY}))
    cfg = build_config(tree, "t")
    register(cfg, 1, commit_policy(cfg, 1, small_assets / "tiny-model"))
    return root, cfg


def export_args(root, dest, round_index=1, overwrite=False):
    return argparse.Namespace(run=RUN, round=round_index, to=str(dest), root=str(root), overwrite=overwrite)


def test_lineage_is_the_registered_version_of_that_round(run):
    _, cfg = run
    lineage = lineage_of(cfg, 1)
    step = f"{stage_prefix(cfg.run.root, RUN, 1, 'rl')}/step_000003"
    assert lineage["registered_model"] == f"{RUN}-policy version 1"
    assert lineage["checkpoint_uri"] == step and lineage["round"] == "1"
    assert lineage["data.prompts"] == "sha-of-prompts-1" and len(lineage["manifest_sha256"]) == 64
    assert lineage_of(cfg, 0) == {}  # no version registered for round 0


def test_export_writes_a_clean_directory_with_the_runs_sampling_and_card(run, tmp_path, capsys):
    root, cfg = run
    dest = tmp_path / "out" / "policy"
    assert command_export(export_args(root, dest)) == 0
    assert {p.name for p in dest.iterdir()} == CLEAN
    generation = json.loads((dest / "generation_config.json").read_text())
    assert generation["do_sample"] is True
    assert (generation["temperature"], generation["top_p"], generation["max_new_tokens"]) == (0.7, 0.9, 12)
    readme = (dest / "README.md").read_text()
    step = f"{stage_prefix(cfg.run.root, RUN, 1, 'rl')}/step_000003"
    assert f"# {RUN}: round 1 rl policy" in readme and f"| checkpoint | {step} |" in readme
    assert (
        f"| registered_model | {RUN}-policy version 1 |" in readme and "| data.prompts | sha-of-prompts-1 |" in readme
    )
    assert "| " + " | ".join(EVAL_COLUMNS) + " |" in readme  # seconds is not a column
    assert "| 0 | 0.1 | 0.3 | 0.5 | 0.6 | 9 |" in readme and "| 1 | 0.3 | 0.45 | 0.75 | 0.7 | 10 |" in readme
    assert "| 2 | 0.45 |" not in readme  # only the rounds up to the exported one
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"exported round 1 of '{RUN}' (") and "parameters" in printed[0]
    assert printed[1].startswith(f"  -> {dest}: ") and "model.safetensors" in printed[1]


def test_a_round_without_a_final_policy_is_refused(run, tmp_path):
    root, _ = run
    with pytest.raises(ConfigError) as err:
        command_export(export_args(root, tmp_path / "dest", round_index=2))
    assert str(err.value).startswith(f"round 2 of run '{RUN}' has no final policy (")
    assert str(err.value).endswith("see `rlflow status`") and not (tmp_path / "dest").exists()
    with pytest.raises(ConfigError, match=f"no run 'nope' under {root}"):
        command_export(argparse.Namespace(run="nope", round=0, to=str(tmp_path / "d"), root=str(root), overwrite=False))


def test_a_non_empty_destination_needs_overwrite(run, tmp_path):
    root, _ = run
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty"):
        command_export(export_args(root, dest))
    assert [p.name for p in dest.iterdir()] == ["keep.txt"]
    assert command_export(export_args(root, dest, overwrite=True)) == 0
    assert {p.name for p in dest.iterdir()} == CLEAN
