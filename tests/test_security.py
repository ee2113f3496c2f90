"""Nothing is unpickled and no remote code runs unless the config turns it on: checked over the
source, and over what a stage writes (the whole-run secret sweep is in tests/flows/test_pipeline.py)."""

import ast
from pathlib import Path

from rlflow.engine.config import Config

ROOT = Path(__file__).parents[1]
SOURCES = [p for folder in ("engine", "tasks", "flows", "bench") for p in sorted((ROOT / folder).rglob("*.py"))]


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def test_no_pickle_anywhere():
    users = {}
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        bad = sorted(n for n in names if n.split(".")[0] in ("pickle", "cloudpickle", "dill", "joblib"))
        if bad:
            users[str(path.relative_to(ROOT))] = bad
    assert users == {}


def test_torch_load_only_with_weights_only_true():
    unsafe = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path in SOURCES
        for call in calls(path)
        if dotted(call.func).endswith("torch.load")
        and not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in call.keywords)
    ]
    assert unsafe == []


def test_remote_code_is_never_trusted_by_a_literal():
    literal = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path in SOURCES
        for call in calls(path)
        for k in call.keywords
        if k.arg == "trust_remote_code" and getattr(k.value, "value", None) is True
    ]
    assert literal == [] and Config().model.trust_remote_code is False


def test_the_checker_sees_a_bad_call(tmp_path):
    # Guards the guards: an unsafe load in a scanned-like file is found.
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ntorch.load('x', weights_only=False)\nf(trust_remote_code=True)\n")
    found = [dotted(c.func) for c in calls(bad)]
    assert "torch.load" in found and "f" in found

