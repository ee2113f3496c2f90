"""Unit tests mirror the package: every module of engine/, tasks/ and flows/ that has logic has
tests/unit/<package path>/test_<module>.py, and that file imports the module and calls something it
imports from it. Modules without one are listed below with the tests that cover them today; the lists
may only shrink (a listed module that gains a mirror test, or no longer exists, fails the check).
Every file under tests/unit/ is named for a module (test_<module>.py or test_<module>_<topic>.py), and
no test module imports another (shared code lives in tests/helpers/)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = ("engine", "tasks", "flows")  # installed as rlflow.engine, rlflow.tasks, rlflow.flows

# Modules with logic that need no mirror test of their own, and why.
EXEMPT = {
    "engine/errors.py": "exception types and their exit codes only: no behaviour of their own; the tests that "
    "match an error's message and exit code exercise them",
}

# Modules with no mirror test yet, and the tests that exercise them today. Remove a module from here
# when its tests/unit/<path>/test_<module>.py imports it and calls it.
NOT_YET_MIRRORED: dict[str, str] = {
    "engine/rollout/vllm_transfer.py": "imports vLLM, which only .venv-vllm holds (it runs inside a vLLM server):"
    " tests/unit/engine/rollout/test_vllm_replica.py and test_service.py exercise it through a real one",
}


def has_logic(tree: ast.Module) -> bool:
    """Anything beyond imports, the docstring and assignments of literal constants."""
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_literal(node.value):
            continue
        return True
    return False


def _is_literal(value: ast.expr | None) -> bool:
    if value is None:  # a bare annotation
        return True
    try:
        ast.literal_eval(value)
    except ValueError:
        return False
    return True


def source_modules(repo: Path) -> Iterator[tuple[str, str]]:
    """(path relative to the repo, dotted module name) of every module under the source roots."""
    for root in SOURCE_ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            rel = path.relative_to(repo)
            parts = rel.with_suffix("").parts
            dotted = ".".join(("rlflow", *(parts[:-1] if parts[-1] == "__init__" else parts)))
            yield rel.as_posix(), dotted


def mirror_path(rel: str) -> str:
    """tests/unit/<package path>/test_<module>.py (a package's own __init__.py: test___init__.py)."""
    path = Path(rel)
    return (Path("tests/unit") / path.parent / f"test_{path.stem}.py").as_posix()


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a Name or an Attribute chain on a Name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def mirror_gap(test_file: Path, dotted: str) -> str | None:
    """Why `test_file` is not a mirror test of module `dotted` (None when it is one): it must import
    from the module and call a name it imported (or an attribute of it, or of the imported module)."""
    if not test_file.is_file():
        return "missing"
    tree = ast.parse(test_file.read_text(), str(test_file))
    parent, _, stem = dotted.rpartition(".")
    names: set[str] = set()  # local names bound to things imported from the module
    modules: set[str] = set()  # local dotted names bound to the module itself
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if node.module == dotted:
                    names.add(alias.asname or alias.name)
                elif node.module == parent and alias.name == stem:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == dotted:
                    modules.add(alias.asname or dotted)
    if not names and not modules:
        return f"does not import {dotted}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in names:
                return None
            if isinstance(func, ast.Attribute) and _dotted(func.value) in modules | names:
                return None  # the module's function, or a class method (`RolloutClient.start(...)`)
    return f"imports from {dotted} but calls nothing it imported"


def mirror_problems(repo: Path, exempt: Mapping[str, str], not_yet: Mapping[str, str]) -> list[str]:
    """Every way `repo` breaks the mirror rule, one line each (empty when it keeps it)."""
    problems = [f"{rel} is in both EXEMPT and NOT_YET_MIRRORED" for rel in sorted(set(exempt) & set(not_yet))]
    seen = set()
    for rel, dotted in source_modules(repo):
        tree = ast.parse((repo / rel).read_text(), rel)
        listed = "EXEMPT" if rel in exempt else "NOT_YET_MIRRORED" if rel in not_yet else None
        if not has_logic(tree):
            if listed:
                problems.append(f"{rel} is in {listed} but has no logic to test: remove it from {listed}")
            continue
        seen.add(rel)
        expected = mirror_path(rel)
        gap = mirror_gap(repo / expected, dotted)
        if gap is None and listed:
            problems.append(f"{rel} now has a mirror test ({expected}): remove it from {listed}")
        elif gap == "missing" and not listed:
            problems.append(
                f"{rel} has no mirror test: expected {expected} to import {dotted} and call it "
                "(or list the module in NOT_YET_MIRRORED with the tests that cover it)"
            )
        elif gap is not None and not listed:
            problems.append(f"{rel} has no mirror test: {expected} {gap}")
    for rel in sorted((set(exempt) | set(not_yet)) - seen):
        if not (repo / rel).is_file():
            listed = "EXEMPT" if rel in exempt else "NOT_YET_MIRRORED"
            problems.append(f"{rel} is in {listed} but no longer exists: remove it from {listed}")
    return problems + unnamed_unit_tests(repo)


def unnamed_unit_tests(repo: Path) -> list[str]:
    """Files under tests/unit/ not named test_<module>.py or test_<module>_<topic>.py for a module of the
    package they mirror."""
    problems = []
    unit = repo / "tests" / "unit"
    for test in sorted(unit.rglob("test_*.py")) if unit.is_dir() else []:
        folder = repo / test.parent.relative_to(unit)
        modules = {p.stem for p in folder.glob("*.py")} if folder.is_dir() else set()
        name = test.stem.removeprefix("test_")
        if not any(name == m or name.startswith(f"{m}_") for m in modules):
            rel = test.relative_to(repo).as_posix()
            where = folder.relative_to(repo).as_posix()
            problems.append(f"{rel} is named for no module of {where}/ (test_<module>.py, test_<module>_<topic>.py)")
    return problems


def test_every_module_with_logic_has_its_mirror_test():
    assert mirror_problems(REPO, EXEMPT, NOT_YET_MIRRORED) == []


def test_the_lists_name_test_files_that_exist():
    """Each reason names the test files that cover the module; a bare file name is in the folder of the
    path before it."""
    missing = []
    for rel, reason in (EXEMPT | NOT_YET_MIRRORED).items():
        folder = None
        for name in re.findall(r"[\w/]*test_\w+\.py", reason):
            if "/" in name:
                folder = Path(name).parent
            path = Path(name) if "/" in name else folder / name if folder else None
            if path is None or not (REPO / path).is_file():
                missing.append(f"{rel}: {name}")
    assert missing == []


def test_no_test_module_imports_another():
    """Tests share code through tests/helpers/ (and conftest.py's helpers), never another test module."""
    test_packages = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and p.name != "helpers"}
    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported = [node.module]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            for name in imported:
                parts = name.split(".")
                if parts[0] in test_packages or any(part.startswith("test_") for part in parts):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert offenders == []


def test_the_check_names_a_module_without_a_test_and_where_its_test_goes(tmp_path):
    (tmp_path / "engine" / "parts").mkdir(parents=True)
    (tmp_path / "engine" / "parts" / "widget.py").write_text('"""A widget."""\n\ndef make():\n    return 1\n')
    (tmp_path / "engine" / "parts" / "names.py").write_text('"""Constants only."""\n\nNAME = "x"\nSIZES = (1, 2)\n')
    (tmp_path / "engine" / "parts" / "__init__.py").write_text('"""Only a docstring."""\n')
    assert mirror_problems(tmp_path, {}, {}) == [
        (
            "engine/parts/widget.py has no mirror test: expected tests/unit/engine/parts/test_widget.py to import "
            "rlflow.engine.parts.widget and call it (or list the module in NOT_YET_MIRRORED with the tests that cover it)"
        )
    ]

    test = tmp_path / "tests" / "unit" / "engine" / "parts" / "test_widget.py"
    test.parent.mkdir(parents=True)
    test.write_text("from rlflow.engine.parts import names\n\ndef test_it():\n    assert names.NAME\n")
    assert mirror_problems(tmp_path, {}, {}) == [
        (
            "engine/parts/widget.py has no mirror test: tests/unit/engine/parts/test_widget.py "
            "does not import rlflow.engine.parts.widget"
        )
    ]
    test.write_text("from rlflow.engine.parts.widget import make\n\ndef test_it():\n    assert make\n")
    assert mirror_problems(tmp_path, {}, {}) == [
        (
            "engine/parts/widget.py has no mirror test: tests/unit/engine/parts/test_widget.py "
            "imports from rlflow.engine.parts.widget but calls nothing it imported"
        )
    ]
    for calling in (
        "from rlflow.engine.parts.widget import make\n\ndef test_it():\n    assert make() == 1\n",
        "from rlflow.engine.parts import widget\n\ndef test_it():\n    assert widget.make() == 1\n",
        "import rlflow.engine.parts.widget\n\ndef test_it():\n    assert rlflow.engine.parts.widget.make() == 1\n",
        "from rlflow.engine.parts.widget import Widget\n\ndef test_it():\n    assert Widget.start() == 1\n",
    ):
        test.write_text(calling)
        assert mirror_problems(tmp_path, {}, {}) == []


def test_the_lists_only_shrink(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "widget.py").write_text("def make():\n    return 1\n")
    test = tmp_path / "tests" / "unit" / "engine" / "test_widget.py"
    test.parent.mkdir(parents=True)
    test.write_text("from rlflow.engine.widget import make\n\ndef test_it():\n    assert make() == 1\n")
    covered = {"engine/widget.py": "tested by tests/x.py"}
    assert mirror_problems(tmp_path, {}, covered) == [
        "engine/widget.py now has a mirror test (tests/unit/engine/test_widget.py): remove it from NOT_YET_MIRRORED"
    ]
    assert mirror_problems(tmp_path, covered, {}) == [
        "engine/widget.py now has a mirror test (tests/unit/engine/test_widget.py): remove it from EXEMPT"
    ]
    gone = {"engine/gone.py": "tested by tests/x.py"}
    assert mirror_problems(tmp_path, {}, gone) == [
        "engine/gone.py is in NOT_YET_MIRRORED but no longer exists: remove it from NOT_YET_MIRRORED"
    ]
    (tmp_path / "tests" / "unit" / "engine" / "test_gadget_fuzz.py").write_text("")
    assert mirror_problems(tmp_path, {}, {}) == [
        (
            "tests/unit/engine/test_gadget_fuzz.py is named for no module of engine/ "
            "(test_<module>.py, test_<module>_<topic>.py)"
        )
    ]
