"""A run begun by rlflow 0.1 (its stage identities lists of config keys kept by hand, its RL stage named
ppo), continued by this rlflow: `rlflow run` stops before any stage runs, with one line (exit 2) that
says what to do, whatever resume.allow_config_change says, and nothing in the run's folder is touched;
`rlflow status` says the same. The run folder is built from the stage records a real rlflow 0.1 run
wrote (tests/fixtures/run_rlflow_0_1.json), one of them interrupted."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from conftest import small_config_tree
from rlflow.flows.cli.main import main

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_rlflow_0_1.json"


def folder_state(root: Path) -> dict[str, str]:
    files = (p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture
def old_run(tmp_path):
    """runs/old-run as rlflow 0.1 left it after a kill during its RL stage: SFT, the reward model and
    the evaluation's records as written, the RL stage at committed step 2 with no final.json."""
    root = tmp_path / "runs"
    for rel, content in json.loads(FIXTURE.read_text())["files"].items():
        if rel == "round_0/ppo/final.json" or rel.startswith("round_0/eval/"):
            continue
        path = root / "old-run" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return root


def test_continuing_a_run_of_rlflow_0_1_stops_before_anything_runs(old_run, small_assets, tmp_path, capsys):
    tree = small_config_tree(small_assets, old_run, run={"name": "old-run", "rounds": 1})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tree))
    before = folder_state(old_run)
    for extra in ([], ["resume.allow_config_change=true"], ["--dry-run"]):
        assert main(["run", str(config), *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"rlflow: error: run 'old-run' ({old_run}/old-run)")
        assert "written by rlflow 0.1" in err and "new run.name" in err and "continue it with rlflow 0.1" in err
    assert folder_state(old_run) == before  # nothing written, nothing removed
    assert not (old_run / "mlflow.db").exists() and not (old_run / "old-run" / "config.yaml").exists()
    assert main(["status", "old-run", "--root", str(old_run)]) == 2
    assert "written by rlflow 0.1" in capsys.readouterr().err
