"""`rlflow run --dry-run` and `rlflow status`: what they print and refuse, without training anything
(`rlflow deploy`'s checks: test_deploy.py)."""

import yaml

from conftest import small_config_tree
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.secrets import redact
from rlflow.flows.cli.main import main


def write_config(path, tree):
    path.write_text(yaml.safe_dump(tree))
    return path


def test_dry_run_prints_the_resolved_config_and_plan_without_a_model(tmp_path, small_assets, capsys):
    tree = small_config_tree(small_assets, tmp_path / "runs", run={"rounds": 2, "name": "dry"})
    tree["model"]["path"] = str(tmp_path / "no-such-model")  # nothing is loaded: no error
    tree["run"]["storage_options"] = {"key": "AKIA-SECRET-1"}
    config = write_config(tmp_path / "c.yaml", tree)
    assert main(["run", str(config), "ppo.steps=7", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "AKIA-SECRET-1" not in out and "storage_options: '***'" in out
    resolved = yaml.safe_load(out.split("# plan:")[0])
    assert resolved["ppo"]["steps"] == 7 and resolved["run"]["name"] == "dry"
    plan = [line.split()[:4] for line in out.splitlines() if line.startswith("  round ")]
    assert plan == [
        ["round", "0", "sft", "40"], ["round", "0", "rm", "1"], ["round", "0", "ppo", "7"], ["round", "0", "eval", "32"],
        ["round", "1", "label", "32"], ["round", "1", "rm", "1"], ["round", "1", "ppo", "7"], ["round", "1", "eval", "32"],
    ]
    assert out.count("[not started]") == 8
    assert not (tmp_path / "runs" / "dry").exists()  # a dry run writes nothing


def test_status_reads_the_run_folder(tmp_path, small_assets, capsys):
    root = tmp_path / "runs"
    tree = small_config_tree(small_assets, root, run={"name": "st", "rounds": 1, "storage_options": {"anon": False}})
    (root / "st").mkdir(parents=True)
    (root / "st" / "config.yaml").write_text(yaml.safe_dump(redact(tree)))  # as the flow writes it
    sft = CheckpointStore(stage_prefix(str(root), "st", 0, "sft"))
    with sft.writer(40) as w:
        w.write_bytes("x", b"x")
    sft.mark_final(40)
    rm = CheckpointStore(stage_prefix(str(root), "st", 0, "rm"))
    with rm.writer(20) as w:
        w.write_bytes("x", b"x")
    (root / "st" / "events.jsonl").write_text('{"run": "st", "round": 0, "stage": "rm", "step": 25, "time": "T"}\n')
    assert main(["status", "st", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "sft" in out and "[done at step 40]" in out and "[at step 20 (committed)]" in out
    assert out.count("[not started]") == 2 and "last logged step: round 0 rm step 25" in out
    assert main(["status", "nope", "--root", str(root)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
