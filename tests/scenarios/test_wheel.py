"""The package as a user installs it from a wheel, not from the source tree: every module is in
the wheel, and the CLI works from a non-editable install in a folder outside the checkout (an
editable install finds a module the wheel left out, and would hide it)."""

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = ("engine", "tasks", "flows", "configs")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = out / "build"  # setuptools' build folders stay out of the checkout
    env = dict(os.environ, PIP_NO_BUILD_ISOLATION="0")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        check=True, cwd=out, env=env | {"TMPDIR": str(build.parent)}, timeout=300,
    )
    (found,) = out.glob("rlflow-*.whl")
    return found


def test_the_wheel_holds_every_module_of_the_source_tree(wheel):
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    in_tree = {
        f"rlflow/{p.relative_to(ROOT).as_posix()}" for top in PACKAGES for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert len(in_tree) > 150
    assert in_tree - in_wheel == set(), f"left out of the wheel: {sorted(in_tree - in_wheel)}"
    assert "rlflow/configs/prices.yaml" in zipfile.ZipFile(wheel).namelist()  # the estimate's default prices


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (not editable); its other requirements come from this
    venv's site-packages through a .pth file, so torch is not installed twice."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "project-deps.pth").write_text(ours + "\n")  # a path line: no .pth file of ours is run
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    return env_dir


def run_in(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{installed / 'bin'}:{env['PATH']}"
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_cli_runs_from_the_installed_wheel_outside_the_checkout(installed, tmp_path):
    # rlflow is a namespace package (no __init__.py; its parts are engine/, tasks/, flows/, configs/), so
    # rlflow.__file__ is None: every entry of rlflow.__path__ must lie in the install instead.
    where = run_in(installed, tmp_path, "python", "-c",
                   "import rlflow, rlflow.engine, rlflow.flows.cli.main as m; "
                   "print(*rlflow.__path__, rlflow.engine.__file__, m.__file__, sep='\\n')")
    assert where.returncode == 0, where.stderr
    assert len(where.stdout.split()) >= 3, where.stdout
    for line in where.stdout.split():
        assert line.startswith(str(installed)) and not line.startswith(str(ROOT)), where.stdout
    help_text = run_in(installed, tmp_path, "rlflow", "--help")
    assert help_text.returncode == 0 and "run" in help_text.stdout, help_text.stderr
    assets = run_in(installed, tmp_path, "rlflow", "demo-assets", "demo_assets")
    assert assets.returncode == 0, assets.stderr
    dry = run_in(installed, tmp_path, "rlflow", "run", str(ROOT / "configs" / "demo.yaml"), "--dry-run",
                 "run.name=from-wheel")
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "round 1  eval" in dry.stdout and "from-wheel" in dry.stdout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
