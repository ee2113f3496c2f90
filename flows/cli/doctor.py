"""`rlflow doctor [CONFIG] [key=value ...]`: check the environment before a run burns GPU hours.

Each check is a small function returning a `Check` (ok / warn / fail, what was found, the command
that fixes it); `run_checks` composes them and never raises. A warning is something a run survives
(CPU only, an untested version); a failure is something it would die of, later and at a cost.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from rlflow.engine.config.secrets import shown_url

# The Makefile installs torch==2.13.0 before the project (pyproject says torch>=2.4 so that no
# requirement pulls a CUDA build): the tested torch is named here, every other pin in pyproject.
TESTED_TORCH = "2.13.0"
CHECKED_PACKAGES = ("torch", "transformers", "deepspeed", "prefect", "mlflow", "fsspec", "s3fs")
GIB = 1024**3
DISK_WARN_BELOW, DISK_FAIL_BELOW = 20 * GIB, 2 * GIB
HEALTH_TIMEOUT_S, VLLM_TIMEOUT_S = 3, 180  # importing vLLM cold on a loaded machine: up to a minute seen
# Op builders reported per accelerator. Only shm_comm is needed (JIT-compiled on a CPU run's first
# start, ~40 s): the engine's client optimizer is torch's AdamW, so FusedAdam/CPUAdam never build.
DS_OPS = {"cpu": ("ShareMemCommBuilder", "CPUAdamBuilder"), "cuda": ("FusedAdamBuilder", "CPUAdamBuilder")}
DS_NEEDED = {"deepspeed_shm_comm"}


@dataclass(frozen=True)
class Check:
    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str
    fix: str = ""


def tested_versions() -> dict[str, str]:
    """Tested version per checked package: the `==` pins of the installed rlflow distribution
    (pyproject, extras included), plus TESTED_TORCH."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {"torch": TESTED_TORCH}
    for req in map(Requirement, importlib.metadata.requires("rlflow") or []):
        specs = list(req.specifier)
        if canonicalize_name(req.name) in CHECKED_PACKAGES and len(specs) == 1 and specs[0].operator == "==":
            pins[canonicalize_name(req.name)] = specs[0].version
    return pins


def installed_versions(names: tuple[str, ...] = CHECKED_PACKAGES) -> dict[str, str | None]:
    """Installed distribution versions, None for a missing package."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def check_versions(installed: Mapping[str, str | None], tested: Mapping[str, str], deepspeed_required: bool) -> Check:
    """Installed vs tested versions: another version is a warning, a missing package a failure
    (deepspeed only when engine.backend=deepspeed needs it)."""
    shown, pins, status, ds_missing = [], [], "ok", False
    for name, version in installed.items():
        want = tested.get(name)
        if version is None and name == "deepspeed":
            ds_missing, status = True, "fail" if deepspeed_required or status == "fail" else "warn"
        elif version is None:
            pins.append(f"{name}=={want}" if want else name)
            status = "fail"
        elif want and version.split("+")[0] != want:  # "2.13.0+cpu" is 2.13.0: the label names the build
            pins.append(f"{name}=={want}")
            status = "fail" if status == "fail" else "warn"
        tested_note = f" (tested {want})" if want and f"{name}=={want}" in pins else ""
        shown.append(f"{name} {version or 'MISSING'}{tested_note}")
    fixes = [f"pip install {' '.join(pins)}"] if pins else []
    fixes += ["pip install 'rlflow[deepspeed]'"] if ds_missing else []
    return Check("versions", status, ", ".join(shown), " && ".join(fixes))


def _versions(config: Any) -> Check:
    try:
        tested = tested_versions()
    except importlib.metadata.PackageNotFoundError:
        return Check("versions", "fail", "the rlflow distribution is not installed", "pip install -e .")
    return check_versions(installed_versions(), tested, config.engine.backend == "deepspeed")


def check_devices(config: Any) -> Check:
    """GPUs with their memory; none is a warning unless placement.* or the ranks per node need more
    devices than there are (the rules `rlflow run` applies, engine/backend/placement.py)."""
    import torch

    from rlflow.engine.errors import ConfigError
    from rlflow.engine.backend.placement import visible_gpu_count
    from rlflow.flows.preflight import check_devices as check_placement

    count = visible_gpu_count()
    try:
        check_placement(config)  # the rules `rlflow run` applies
    except ConfigError as exc:
        return Check("devices", "fail", str(exc), "run where the config's GPUs are, or change placement/resources")
    if count == 0:
        return Check("devices", "warn", "CPU only: fine for the demo; training runs will be slow")
    gpus = []
    for i in range(count):
        try:
            free, total = torch.cuda.mem_get_info(i)
            memory = f"{total / GIB:.1f} GiB total, {free / GIB:.1f} GiB free"
        except RuntimeError as exc:  # e.g. an exclusive-mode GPU held by another process: still listed
            memory = f"memory unknown ({' '.join(str(exc).split())[:80]})"
        gpus.append(f"[{i}] {torch.cuda.get_device_name(i)}, {memory}")
    return Check("devices", "ok", f"{count} GPU(s): " + "; ".join(gpus))


def torch_extensions_dir() -> Path:
    """Where torch puts JIT-built extensions (cpp_extension._get_build_directory, without making it)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cuda, hip = torch.version.cuda, torch.version.hip
    device = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{device}"


def _deepspeed_accelerator() -> Any:
    # DeepSpeed warns "Setting accelerator to CPU" while importing: the devices check says it already.
    logger, quiet = logging.getLogger("DeepSpeed"), lambda record: record.levelno > logging.WARNING
    logger.addFilter(quiet)
    try:
        from deepspeed.accelerator import get_accelerator

        return get_accelerator()
    finally:
        logger.removeFilter(quiet)


def check_deepspeed_ops(config: Any) -> Check:
    """Which DeepSpeed ops can build here (builder.is_compatible, nothing compiled) and which are built."""
    bad = "fail" if config.engine.backend == "deepspeed" else "warn"
    if importlib.util.find_spec("deepspeed") is None:
        return Check("deepspeed ops", bad, "deepspeed not installed", "pip install 'rlflow[deepspeed]'")
    from torch.utils.cpp_extension import is_ninja_available

    accel = _deepspeed_accelerator()
    from deepspeed.git_version_info import accelerator_name, installed_ops

    kind, cache, venv_cache = accel.device_name(), torch_extensions_dir(), Path(sys.prefix) / "torch-extensions"
    toolchain = is_ninja_available() and bool(os.environ.get("CXX") or shutil.which("c++"))
    shown, broken, unbuilt, in_venv = [], [], [], False
    for builder in filter(None, map(accel.create_op_builder, DS_OPS.get(kind, DS_OPS["cuda"]))):
        built = installed_ops.get(builder.name, False) and accelerator_name == accel._name
        state = "prebuilt" if built else "built (JIT cache)" if _has_build(cache, builder.name) else "not built"
        if state == "not built" and cache != venv_cache and _has_build(venv_cache, builder.name):
            # run outside make, which exports TORCH_EXTENSIONS_DIR: the build it paid for is not used
            state, in_venv = f"not built in {cache}, but in {venv_cache} (where `make` builds)", True
        compatible = builder.is_compatible(verbose=False)
        shown.append(f"{builder.name} {'compatible' if compatible else 'INCOMPATIBLE'}, {state}")
        if builder.name in DS_NEEDED and (not compatible or (state.startswith("not") and not toolchain)):
            broken.append(builder.name)
        elif builder.name in DS_NEEDED and state.startswith("not"):
            unbuilt.append(builder.name)
    detail = f"{kind}: " + "; ".join(shown) + ("" if toolchain else "; no ninja/c++ to JIT-compile")
    if broken:
        return Check("deepspeed ops", bad, detail, "ds_report  # says what the ops lack")
    if unbuilt and bad == "fail":
        fix = "make install  # or: DS_BUILD_OPS=1 pip install deepspeed==0.19.8"
        fix = f"export TORCH_EXTENSIONS_DIR={venv_cache}" if in_venv else fix
        return Check("deepspeed ops", "warn", f"{detail} (first use compiles, ~40 s; cache {cache})", fix)
    return Check("deepspeed ops", "ok", detail)


def _has_build(extensions_dir: Path, name: str) -> bool:
    return (extensions_dir / name / f"{name}.so").is_file()


def check_vllm(config: Any) -> Check:
    """rollout.vllm_python exists and imports vllm: a warning if not, a failure if the config uses vLLM."""
    python, need = config.rollout.vllm_python, config.rollout.server_backend == "vllm"
    bad, note = ("fail", "") if need else ("warn", " (only rollout.server_backend=vllm needs it)")
    if not os.path.isfile(python):
        return Check("vllm env", bad, f"rollout.vllm_python {python!r} does not exist{note}", "make vllm-env")
    try:
        code = "import vllm; print(vllm.__version__)"
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=VLLM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("vllm env", bad, f"{python}: {type(exc).__name__}: {exc}{note}", "make vllm-env")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Check("vllm env", bad, f"{python} cannot import vllm: {last}{note}", "make vllm-env")
    return Check("vllm env", "ok", f"vllm {done.stdout.strip()} ({python})")


def probe_writable(key: str, url: str, options: dict[str, Any], options_key: str) -> Check:
    """Write and delete a probe file under `url` (as `rlflow run` checks the mirror); a failure's
    reason never shows a storage option's value."""
    from rlflow.engine.storage.errors import describe_storage_error
    from rlflow.flows.preflight import probe_write

    try:
        probe_write(url, options)
    except Exception as exc:  # whatever the backend raises is reported, with secrets masked
        reason = describe_storage_error(url, exc, options, options_key)
        fix = f"set {key} to a writable path or bucket (credentials: {options_key} or the AWS_* environment)"
        return Check(key, "fail", f"{url!r} cannot be written: {reason}", fix)
    return Check(key, "ok", f"{url} writable")


def check_storage(config: Any) -> list[Check]:
    """run.root and, if set, checkpoint.mirror take a write."""
    checks = [probe_writable("run.root", config.run.root, config.run.storage_options, "run.storage_options")]
    mirror, options = config.checkpoint.mirror, config.checkpoint.mirror_storage_options
    if not mirror:
        return checks + [Check("checkpoint.mirror", "ok", "not set (optional second copy of each checkpoint)")]
    return checks + [probe_writable("checkpoint.mirror", mirror, options, "checkpoint.mirror_storage_options")]


def disk_check(free_bytes: int, where: str = "run.root") -> Check:
    """Free disk space: a warning below 20 GiB, a failure below 2 GiB."""
    detail, fix = f"{free_bytes / GIB:.1f} GiB free at {where}", "free disk space or point run.root at a larger disk"
    if free_bytes < DISK_FAIL_BELOW:
        return Check("disk", "fail", f"{detail} (below 2 GiB: checkpoints will not fit)", fix)
    if free_bytes < DISK_WARN_BELOW:
        return Check("disk", "warn", f"{detail} (below 20 GiB: enough for the demo, not for real models)", fix)
    return Check("disk", "ok", detail)


def check_disk(config: Any) -> Check:
    """Free space under a local run.root (its nearest existing folder); a remote root is not measured."""
    root = config.run.root.removeprefix("file://")
    if "://" in root:
        return Check("disk", "ok", f"{root} is remote: not measured")
    path = Path(root).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return disk_check(shutil.disk_usage(path).free, str(path))


def http_health(name: str, base: str, fix: str) -> Check:
    """GET {base}/health within HEALTH_TIMEOUT_S: unreachable fails, an HTTP error answer warns."""
    parts = urlsplit(base)  # without user info, which urllib would take for part of the host name
    url = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], path=f"{parts.path.rstrip('/')}/health"))
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as response:
            return Check(name, "ok", f"{shown_url(base)} healthy (HTTP {response.status})")
    except urllib.error.HTTPError as exc:  # it answered: up, but unhealthy or refusing us
        return Check(name, "warn", f"{shown_url(url)} answered HTTP {exc.code}", fix)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(getattr(exc, "reason", exc)).split())
        return Check(name, "fail", f"{shown_url(url)} unreachable: {reason}", fix)


def check_mlflow(config: Any) -> Check:
    """The tracking URI `rlflow run` would use; an http(s) server must answer /health."""
    from rlflow.tasks.tracking import resolve_tracking_uri

    fix = "start it (make up, or mlflow server --workers 1) or fix tracking.uri / MLFLOW_TRACKING_URI"
    try:
        uri = resolve_tracking_uri(config.tracking.uri, config.run.root)
    except OSError as exc:  # the default sqlite db lives under a local run.root
        detail = f"no tracking store under run.root: {type(exc).__name__}: {exc}"
        return Check("mlflow", "fail", detail, "fix run.root, or set tracking.uri / MLFLOW_TRACKING_URI")
    if uri.startswith(("http://", "https://")):
        return http_health("mlflow", uri, fix)
    local = uri.startswith(("sqlite:", "file:")) or "://" not in uri
    return Check("mlflow", "ok", f"{shown_url(uri)} ({'local store, no server' if local else 'not probed'})")


def check_prefect(config: Any) -> Check:
    """The Prefect API (PREFECT_API_URL, from the environment or the Prefect profile) answers /health."""
    try:
        from prefect.settings import Settings

        url = Settings().api.url  # read now: get_current_settings() keeps what the env held at import
    except Exception:  # a broken Prefect profile must not hide the rest of the report
        url = os.environ.get("PREFECT_API_URL")
    if not url:
        detail = "PREFECT_API_URL unset: temporary local server per run; `make up` for a persistent one"
        return Check("prefect", "ok", detail)
    return http_health("prefect", url, "start it (make up) or unset PREFECT_API_URL")


# Environment first, then where the run writes and reports: the order of the printed table.
CHECKS = (
    _versions,
    check_devices,
    check_deepspeed_ops,
    check_vllm,
    check_storage,
    check_disk,
    check_mlflow,
    check_prefect,
)


def run_checks(config: Any | None = None) -> list[Check]:
    """Every check against `config` (None: engine.config.Config() defaults); a crashing check is a failure."""
    from rlflow.engine.config.schema import Config

    config = config if config is not None else Config()
    checks: list[Check] = []
    for fn in CHECKS:
        try:
            result = fn(config)
        except Exception as exc:  # one broken check must not hide the others
            name = fn.__name__.removeprefix("check_").lstrip("_")
            result = Check(name, "fail", f"check crashed: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
        checks.extend(result if isinstance(result, list) else [result])
    return checks


def format_report(checks: list[Check]) -> str:
    """Columns status, check, detail; then a fix line per non-ok check; then the counts."""
    width = max(len(c.name) for c in checks)
    lines = [f"{'status':<6}  {'check':<{width}}  detail"]
    lines += [f"{c.status:<6}  {c.name:<{width}}  {c.detail}" for c in checks]
    fixes = [f"{c.name:<{width}}  fix: {c.fix}" for c in checks if c.status != "ok" and c.fix]
    summary = ", ".join(f"{sum(c.status == s for c in checks)} {s}" for s in ("ok", "warn", "fail"))
    return "\n".join(lines + ([""] + fixes if fixes else []) + ["", summary])


def load_doctor_config(config_path: str | None, overrides: list[str]) -> Any:
    """A config file plus overrides, or the defaults plus overrides. A first argument that is an
    override and not a file counts as one: `rlflow doctor rollout.server_backend=vllm`."""
    from rlflow.engine.config.schema import apply_override, build_config, load_config

    if config_path and "=" in config_path and not Path(config_path).is_file():
        config_path, overrides = None, [config_path, *overrides]
    if config_path:
        return load_config(config_path, overrides)
    tree: dict[str, Any] = {}
    for override in overrides:
        apply_override(tree, override)
    return build_config(tree, "overrides")


def command_doctor(args: argparse.Namespace) -> int:
    """Print the checks (a table, or JSON with --json); 1 if any failed, else 0."""
    checks = run_checks(load_doctor_config(args.config, args.overrides))
    print(json.dumps([asdict(c) for c in checks], indent=2) if args.json else format_report(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `doctor` to the CLI's subcommands (`build_parser`'s add_subparsers)."""
    parser = subparsers.add_parser("doctor", help="check packages, GPUs, storage and servers before a run")
    parser.add_argument("config", nargs="?", help="YAML config to check (default: the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. engine.backend=deepspeed")
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list")
    parser.set_defaults(handler=command_doctor)
    return parser
