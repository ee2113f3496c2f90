"""Readers of the files in infra/ (Compose, .env.example, the Dockerfile, the job template)
shared by the tests in tests/infra. Not a test module."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker-compose.yml"
ENV_EXAMPLE = INFRA / ".env.example"
DOCKERFILE = INFRA / "Dockerfile.gpu"
DOCKERIGNORE = INFRA / "Dockerfile.gpu.dockerignore"
JOB_TEMPLATE = INFRA / "k8s" / "gpu-job-template.json"
INFRA_README = INFRA / "README.md"

# ${NAME}, ${NAME:?msg}, ${NAME-default}, ... ; $$ is a literal dollar; a bare $NAME is matched too
# so that the tests can refuse it (it would escape the .env checks below).
COMPOSE_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))"
)
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)
URL_CREDENTIALS = re.compile(r"://[^:/@\s]+:(?P<password>\$\{[^}]*\}|[^@\s]+)@")
ONE_REFERENCE = re.compile(r"\$\{[A-Za-z_]\w*(?::?[-?][^}]*)?\}")


# --- helpers ---------------------------------------------------------------------------------


def read_env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of one value, for the forms the file may use; an unset required
    variable raises."""

    def replace(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        if match["bare"]:
            raise AssertionError(f"unbraced ${match['bare']}: write ${{{match['bare']}}}")
        name, op, arg = match["name"], match["op"], match["arg"]
        value = env.get(name)
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise AssertionError(f"required variable {name} unset: {arg}")
        if op in (":-", "-") and (value is None or (op == ":-" and value == "")):
            return arg
        return value or ""

    return COMPOSE_VAR.sub(replace, text)


def map_strings(node: Any, fn) -> Any:
    """Compose interpolates the parsed values (comments are never read): so do these tests."""
    if isinstance(node, dict):
        return {key: map_strings(value, fn) for key, value in node.items()}
    if isinstance(node, list):
        return [map_strings(item, fn) for item in node]
    return fn(node) if isinstance(node, str) else node


def compose_strings() -> list[str]:
    found: list[str] = []
    map_strings(yaml.safe_load(COMPOSE.read_text()), found.append)
    return found


def compose_references() -> list[re.Match]:
    return [m for text in compose_strings() for m in COMPOSE_VAR.finditer(text) if not m["escaped"]]


def load_compose(env: dict[str, str] | None = None) -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())
    return doc if env is None else map_strings(doc, lambda text: interpolate(text, env))


def environment_items(service: dict) -> list[tuple[str, str]]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return [tuple(item.split("=", 1)) if "=" in item else (item, "") for item in env]
    return [(key, "" if value is None else str(value)) for key, value in env.items()]


def depends_on(service: dict) -> dict[str, dict]:
    deps = service.get("depends_on") or {}
    return {name: {"condition": "service_started"} for name in deps} if isinstance(deps, list) else deps


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current = f"{current} {line[:-1].strip()}" if line.endswith("\\") else f"{current} {line}"
        if not line.endswith("\\"):
            keyword, _, args = current.strip().partition(" ")
            instructions.append((keyword.upper(), args.strip()))
            current = ""
    return instructions


def run_index(instructions: list[tuple[str, str]], pattern: str) -> int:
    hits = [i for i, (kind, args) in enumerate(instructions) if kind == "RUN" and re.search(pattern, args)]
    assert hits, f"no RUN matching {pattern!r} in {DOCKERFILE.name}"
    return hits[0]


def makefile_torch_pin() -> str:
    pins = set(re.findall(r"pip install -q (?:--no-compile )?torch==(\S+)", (ROOT / "Makefile").read_text()))
    assert len(pins) == 1, pins
    return pins.pop()


def pyproject_pin(package: str) -> str:
    match = re.search(rf'"{package}==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, package
    return match[1]


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]


def load_template() -> dict:
    return json.loads(JOB_TEMPLATE.read_text())


def on_server(api_url: str):
    """Prefect reads its settings once, at import: point this test's clients at the session server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings(updates={PREFECT_API_URL: api_url})


# prefect-kubernetes 0.8.0 (worker.py, _get_base_job_manifest) refuses a manifest that lacks any of
# these paths or gives them other values; reproduced here since that package is not installed.
KUBERNETES_WORKER_BASE_MANIFEST = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"annotations": {}, "labels": {}},
    "spec": {
        "template": {
            "spec": {
                "parallelism": 1,
                "completions": 1,
                "restartPolicy": "Never",
                "containers": [{"name": "prefect-job"}],
            }
        }
    },
}


def render(api_url: str, values: dict[str, Any]) -> dict:
    """The job configuration a worker builds from the pool's template and a deployment's values
    (it resolves block and variable references through the API, hence the server)."""
    from prefect.client.orchestration import get_client
    from prefect.workers.base import BaseJobConfiguration

    class GpuJobConfiguration(BaseJobConfiguration):
        namespace: str
        annotations: dict[str, str] = {}
        job_manifest: dict[str, Any]
        job_watch_timeout_seconds: int | None = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True

    async def build() -> dict:
        async with get_client() as client:
            assert str(client.api_url).rstrip("/") == api_url
            configuration = await GpuJobConfiguration.from_template_and_values(load_template(), values, client=client)
        return configuration.model_dump()

    with on_server(api_url):
        return asyncio.run(build())


def kubernetes_worker_problems(manifest: dict) -> list[str]:
    manifest = copy.deepcopy(manifest)
    metadata = manifest.setdefault("metadata", {})  # the worker fills these three itself
    metadata.setdefault("annotations", {})
    metadata.setdefault("labels", {})
    patch = jsonpatch.JsonPatch.from_diff(manifest, KUBERNETES_WORKER_BASE_MANIFEST)
    return [f"{op['op']} {op['path']}" for op in patch if op["op"] in ("add", "replace")]
