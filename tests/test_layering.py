"""The layering rule: config -> flow -> task -> engine. The engine never imports an orchestrator
or a tracker, and MLflow is imported only by the one tracking module."""

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def offenders(folder: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        bad = sorted(m for m in imported_modules(path) if m.split(".")[0] in forbidden or m.startswith(forbidden))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_engine_imports_no_prefect_mlflow_tasks_or_flows():
    assert offenders("engine", ("prefect", "mlflow", "rlflow.tasks", "rlflow.flows", "tasks", "flows")) == {}


def test_tasks_do_not_import_flows():
    assert offenders("tasks", ("rlflow.flows", "flows")) == {}


def test_mlflow_only_in_the_tracking_module():
    users = {f for folder in ("engine", "tasks", "flows") for f in offenders(folder, ("mlflow",))}
    assert users == {"tasks/tracking.py"}


def test_the_checker_sees_imports():
    # Guards the guard: the AST walk must find a nested, aliased import.
    assert "prefect.client.orchestration" in imported_modules(ROOT / "flows" / "rlhf.py")
