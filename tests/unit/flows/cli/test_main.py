"""`rlflow run --dry-run` and `rlflow status`: what they print and refuse, without training anything
(`rlflow deploy`'s checks: test_deploy.py)."""

import yaml

from conftest import small_config_tree
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.config.schema import build_config
from rlflow.engine.config.secrets import redact
from rlflow.engine.stages.inputs import ModelInput
from rlflow.engine.stages.reward_model import RewardModelUpstream
from rlflow.engine.stages.sft import SFTUpstream
from rlflow.flows.plan import StoreReader
from rlflow.flows.cli.main import main


def write_config(path, tree):
    path.write_text(yaml.safe_dump(tree))
    return path


def test_dry_run_prints_the_resolved_config_and_plan_and_writes_nothing(tmp_path, small_assets, capsys):
    tree = small_config_tree(small_assets, tmp_path / "runs", run={"rounds": 2, "name": "dry"})
    tree["run"]["storage_options"] = {"key": "AKIA-SECRET-1"}
    config = write_config(tmp_path / "c.yaml", tree)
    assert main(["run", str(config), "--dry-run", "rl.steps=7"]) == 0  # overrides after the flag too
    out = capsys.readouterr().out
    assert "AKIA-SECRET-1" not in out and "storage_options: '***'" in out
    resolved = yaml.safe_load(out.split("# plan:")[0])
    assert resolved["rl"]["steps"] == 7 and resolved["run"]["name"] == "dry"
    plan = [line.split()[:4] for line in out.splitlines() if line.startswith("  round ")]
    assert plan == [
        ["round", "0", "sft", "40"], ["round", "0", "rm", "1"], ["round", "0", "rl", "7"],
        ["round", "0", "eval", "32"], ["round", "1", "label", "32"], ["round", "1", "rm", "1"],
        ["round", "1", "rl", "7"], ["round", "1", "eval", "32"],
    ]
    assert out.count("[not started") == 8
    assert not (tmp_path / "runs" / "dry").exists()  # a dry run writes nothing


def test_dry_run_refuses_what_the_run_refuses(tmp_path, small_assets, capsys):
    tree = small_config_tree(small_assets, tmp_path / "runs", run={"name": "dry"})
    config = write_config(tmp_path / "c.yaml", tree)
    assert main(["run", str(config), "sampling.max_new_tokens=100000000", "--dry-run"]) == 2
    assert "more than the model's context" in capsys.readouterr().err
    tree["model"]["path"] = str(tmp_path / "no-such-model")
    assert main(["run", str(write_config(tmp_path / "c.yaml", tree)), "--dry-run"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_status_reads_the_run_folder(tmp_path, small_assets, capsys):
    root = tmp_path / "runs"
    tree = small_config_tree(small_assets, root, run={"name": "st", "rounds": 1, "storage_options": {"anon": False}})
    (root / "st").mkdir(parents=True)
    (root / "st" / "config.yaml").write_text(yaml.safe_dump(redact(tree)))  # as the flow writes it
    config = build_config(redact(tree) | {"run": tree["run"] | {"storage_options": {}}}, "t")
    reader = StoreReader(config)  # the identities a run of this config gives its stages
    sft_planned = reader.planned("sft", 0, SFTUpstream(init=reader.model(config.model.init_path)))
    sft = CheckpointStore(stage_prefix(str(root), "st", 0, "sft"))
    with sft.writer(40) as w:
        w.write_bytes("x", b"x")
    final = sft.mark_final(40, {"identity": sft_planned.identity, "identity_tree": sft_planned.identity_tree})
    trained = ModelInput(uri=sft.step_url(40), identity=final["manifest_sha256"])
    rm_planned = reader.planned("rm", 0, RewardModelUpstream(init=trained))
    rm = CheckpointStore(stage_prefix(str(root), "st", 0, "rm"))
    with rm.writer(20) as w:
        w.write_bytes("x", b"x")
        w.meta.update(identity=rm_planned.identity, identity_tree=rm_planned.identity_tree)
    (root / "st" / "events.jsonl").write_text('{"run": "st", "round": 0, "stage": "rm", "step": 25, "time": "T"}\n')
    assert main(["status", "st", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "sft" in out and "[done at step 40]" in out and "[at step 20 (committed; continues)]" in out
    assert out.count("[not started") == 2 and "last logged step: round 0 rm step 25" in out
    assert main(["status", "nope", "--root", str(root)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
