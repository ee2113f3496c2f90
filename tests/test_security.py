"""Nothing is unpickled and no remote code runs unless the config turns it on: checked over the
source (the whole-run secret sweep is in tests/scenarios/test_pipeline.py)."""

import ast
from pathlib import Path

from rlflow.engine.config.schema import Config

ROOT = Path(__file__).parents[1]
SOURCES = [p for folder in ("engine", "tasks", "flows", "bench") for p in sorted((ROOT / folder).rglob("*.py"))]
PICKLERS = ("pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal")


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def findings(path: Path) -> list[str]:
    """Every unsafe construct in one file: a pickling module imported, torch.load without
    weights_only=True (or imported bare, where calls cannot be told apart), trust_remote_code=True."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLERS:
                found.append(f"{where} from {node.module}")
            if node.module == "torch" and any(a.name == "load" for a in node.names):
                found.append(f"{where} from torch import load")
        elif isinstance(node, ast.Call):
            kwargs = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
            if dotted(node.func).endswith("torch.load") and kwargs.get("weights_only") is not True:
                found.append(f"{where} torch.load without weights_only=True")
            if kwargs.get("trust_remote_code") is True:
                found.append(f"{where} trust_remote_code=True")
    return found


def test_the_source_holds_no_pickle_no_unsafe_torch_load_and_no_trusted_remote_code():
    assert [f for path in SOURCES for f in findings(path)] == []
    assert Config().model.trust_remote_code is False


def test_the_checker_flags_each_unsafe_construct(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nfrom torch import load\nimport torch\n"
        "torch.load('x', weights_only=False)\ntorch.load('y')\ntorch.load('z', weights_only=True)\n"
        "f(trust_remote_code=True)\nf(trust_remote_code=False)\n"
    )
    assert [f.split(" ", 1)[1] for f in findings(bad)] == [
        "import pickle",
        "from dill",
        "from torch import load",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "trust_remote_code=True",
    ]
