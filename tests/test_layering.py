"""The layering rules, as import-linter contracts in pyproject.toml ([tool.importlinter]): the
engine imports no orchestrator, tracker, task or flow; MLflow only in tasks/tracking.py; the
engine's packages form declared layers; and no import cycle exists, function-local imports
included. Each contract is also checked against a planted violation, so none can pass vacuously."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports on the packages under `root` (a copy is found first: it leads PYTHONPATH)."""
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run([*LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300, env=env)


def test_import_contracts_hold():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken." in result.stdout, result.stdout


@pytest.fixture
def copy_of_the_tree(tmp_path: Path) -> Path:
    """The packages and pyproject.toml, importable under their rlflow names from tmp_path."""
    for folder in ("engine", "tasks", "flows", "configs"):
        shutil.copytree(ROOT / folder, tmp_path / "rlflow" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(tree: Path, module: str, source: str) -> None:
    path = tree / "rlflow" / module
    path.write_text(path.read_text() + "\n" + textwrap.dedent(source))


@pytest.mark.parametrize(
    ("module", "source", "contract"),
    [
        ("engine/errors.py", "import prefect\n", "the engine imports no orchestrator"),
        ("flows/rlhf.py", "import mlflow\n", "MLflow is imported only by the tracking module"),
        ("tasks/stages.py", "def f():\n    from rlflow.flows import rlhf\n", "config -> flow -> task -> engine"),
        ("flows/rounds.py", "def f():\n    from rlflow.flows.cli import main\n", "the CLI sits on top of the flow"),
        ("engine/config/base.py", "def f():\n    from rlflow.engine.stages import lifecycle\n", "engine packages"),
        ("engine/stages/context.py", "def f():\n    from rlflow.engine.stages import lifecycle\n", "no import cycles"),
    ],
)
def test_a_planted_violation_breaks_its_contract(copy_of_the_tree, module, source, contract):
    plant(copy_of_the_tree, module, source)
    result = lint(copy_of_the_tree)
    assert result.returncode == 1, result.stdout
    broken = [line for line in result.stdout.splitlines() if "BROKEN" in line]
    assert any(contract in line for line in broken), result.stdout
