"""Static checks of infra/: the GPU worker Dockerfile, the Compose file and the Kubernetes job template.

Docker and Kubernetes are not available here, so nothing is built, pulled or started. What can be
checked is checked against the tools' own rules: the Compose Specification's JSON schema (as
vendored by check-jsonschema), a real Prefect server (it accepts the job template, and rejects a
broken one) and Prefect's own templating code (it renders the manifest a worker would submit).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from pathlib import Path
from typing import Any

import jsonpatch
import jsonschema
import pytest
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
    pins = set(re.findall(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text()))
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


# --- Compose ---------------------------------------------------------------------------------


def test_compose_file_is_valid_under_the_compose_specification():
    check_jsonschema = pytest.importorskip(
        "check_jsonschema", reason="check-jsonschema vendors the Compose Specification schema"
    )
    from importlib.resources import files

    schema = json.loads((files(check_jsonschema.__name__) / "builtin_schemas/vendor/compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    env = read_env_file(ENV_EXAMPLE)
    for doc in (load_compose(), load_compose(env)):  # as written, and as compose sees it after .env
        errors = [f"{e.json_path}: {e.message[:200]}" for e in validator.iter_errors(doc)]
        assert not errors, errors
    # The schema is strict enough to catch a typo in our kind of file.
    broken = load_compose(env)
    broken["services"]["mlflow"]["depends_on"]["postgres"]["condition"] = "service_up"
    broken["services"]["minio"]["helthcheck"] = broken["services"]["minio"].pop("healthcheck")
    assert len(list(validator.iter_errors(broken))) >= 2


def test_every_compose_variable_is_defined_in_env_example_and_required():
    references = compose_references()
    bare = sorted({m["bare"] for m in references if m["bare"]})
    assert not bare, f"unbraced variables (write ${{NAME}}, or $$ for the container's shell): {bare}"
    used = {m["name"] for m in references}
    defined = set(read_env_file(ENV_EXAMPLE))
    assert used - defined == set(), "used in docker-compose.yml, missing from infra/.env.example"
    assert defined - used == set(), "stale in infra/.env.example"
    # `:?` makes compose stop with a message instead of running with an empty password.
    optional = sorted({m["name"] for m in references if m["op"] != ":?"})
    assert not optional, f"not required with ${{NAME:?...}}: {optional}"
    with pytest.raises(AssertionError, match="POSTGRES_PASSWORD"):
        load_compose({k: v for k, v in read_env_file(ENV_EXAMPLE).items() if k != "POSTGRES_PASSWORD"})


def test_compose_services_are_wired_to_defined_healthy_services():
    services = load_compose(read_env_file(ENV_EXAMPLE))["services"]
    assert {"postgres", "prefect-server", "mlflow", "minio", "create-bucket", "worker"} <= set(services)
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        for target, spec in depends_on(service).items():
            assert target in services, f"{name} depends on undefined {target}"
            condition = spec.get("condition", "service_started")
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}, which has no healthcheck"
            if condition == "service_completed_successfully":
                assert services[target].get("restart") == "no", f"{target} is waited on to finish but restarts"
    for name in ("postgres", "prefect-server", "mlflow", "minio"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    assert services["prefect-server"]["image"] == f"prefecthq/prefect:{pyproject_pin('prefect')}-python3.11"
    assert f"mlflow=={pyproject_pin('mlflow')}" in services["mlflow"]["build"]["dockerfile_inline"]
    assert services["worker"]["build"]["dockerfile"] == "infra/Dockerfile.gpu"
    for name, service in services.items():
        build = service.get("build")
        if isinstance(build, dict):
            context = (INFRA / build.get("context", ".")).resolve()
            assert context.is_dir(), name
            assert "dockerfile_inline" in build or (context / build.get("dockerfile", "Dockerfile")).is_file(), name


def test_mlflow_and_prefect_run_as_the_machine_notes_say():
    services = load_compose(read_env_file(ENV_EXAMPLE))["services"]
    mlflow = services["mlflow"]
    command = mlflow["command"].split()
    assert command[command.index("--workers") + 1] == "1"
    assert command[command.index("--artifacts-destination") + 1].startswith("s3://")
    env = dict(environment_items(mlflow))
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    # The URL's driver is the one the image installs (psycopg2 would not be found by SQLAlchemy 2.1).
    assert env["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg://")
    assert '"psycopg[binary]==' in mlflow["build"]["dockerfile_inline"]
    # MLflow 3 refuses unknown Host headers: the name workers use must be allowed.
    assert "mlflow:5000" in env["MLFLOW_SERVER_ALLOWED_HOSTS"].split(",")
    assert dict(environment_items(services["worker"]))["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    prefect = services["prefect-server"]
    assert prefect["command"].split()[:5] == ["prefect", "server", "start", "--host", "0.0.0.0"]
    url = dict(environment_items(prefect))["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert url.startswith("postgresql+asyncpg://") and url.endswith("@postgres:5432/prefect")
    assert dict(environment_items(services["worker"]))["PREFECT_API_URL"] == "http://prefect-server:4200/api"


def test_named_volumes_are_declared_and_hold_every_stateful_service():
    compose = load_compose(read_env_file(ENV_EXAMPLE))
    declared = set(compose.get("volumes") or {})
    used, mounts = set(), {}
    for name, service in compose["services"].items():
        for volume in service.get("volumes") or []:
            source, target = volume.split(":")[:2] if isinstance(volume, str) else (volume["source"], volume["target"])
            if source.startswith((".", "/")):
                assert (INFRA / source).exists(), f"{name} mounts missing {source}"
            else:
                used.add(source)
                mounts[(name, target)] = source
    assert used - declared == set(), "named volumes used but not declared"
    assert declared - used == set(), "named volumes declared but unused"
    assert ("postgres", "/var/lib/postgresql/data") in mounts
    assert ("minio", "/data") in mounts
    assert ("worker", "/home/rlflow") in mounts


def test_published_ports_are_unique_and_the_documented_ones():
    services = load_compose(read_env_file(ENV_EXAMPLE))["services"]
    published = {}
    for name, service in services.items():
        for port in service.get("ports") or []:
            host_ip, host_port, container_port = str(port).rsplit(":", 2)
            assert (host_ip, host_port) not in published, f"{host_port} published twice"
            published[(host_ip, host_port)] = (name, container_port)
    by_port = {host_port: owner for (_, host_port), owner in published.items()}
    assert by_port["4200"] == ("prefect-server", "4200")
    assert by_port["5000"] == ("mlflow", "5000")
    assert {"postgres", "create-bucket", "worker"}.isdisjoint(name for name, _ in by_port.values())
    for readme in (ROOT / "README.md", INFRA_README):
        text = readme.read_text()
        assert ":4200" in text and ":5000" in text, readme


def test_no_secret_value_is_written_into_the_compose_file():
    for name, service in load_compose()["services"].items():
        for key, value in environment_items(service):
            if SECRET_NAME.search(key):
                assert ONE_REFERENCE.fullmatch(value), f"{name}: {key} must be a ${{VAR}} from infra/.env"
    urls = [m for text in compose_strings() for m in URL_CREDENTIALS.finditer(text)]
    assert len(urls) == 2, "the Prefect and MLflow database URLs"
    for match in urls:
        assert ONE_REFERENCE.fullmatch(match["password"]), f"a URL in the compose file holds a password: {match[0]}"
    # The example file holds placeholders only, never something that could be a real key.
    for key, value in read_env_file(ENV_EXAMPLE).items():
        if SECRET_NAME.search(key) or key == "MINIO_ROOT_USER":
            assert "change-me" in value, key
    # The self-check of the check: an inline password is caught.
    assert URL_CREDENTIALS.search("postgresql://u:hunter2@db/x")["password"] == "hunter2"


# --- Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_pins_torch_before_installing_the_project_in_each_environment():
    instructions = dockerfile_instructions(DOCKERFILE)
    pin = makefile_torch_pin()
    torch_first = run_index(instructions, rf"(^|&& )pip install torch=={re.escape(pin)}($| )")
    project = run_index(instructions, r"pip install -e \"?\.\[deepspeed\]")
    assert torch_first < project
    vllm = instructions[run_index(instructions, r"requirements-vllm\.txt")][1]
    assert vllm.index(f"torch=={pin}") < vllm.index("-r requirements-vllm.txt")
    assert f"torch=={pin}" in (ROOT / "requirements-vllm.txt").read_text()
    # vLLM's pins conflict with Prefect's: it goes only into its own venv, the project without deps.
    vllm_python = re.search(r"(\S+)/bin/pip install -r requirements-vllm\.txt", vllm)[1]
    vllm_project = instructions[run_index(instructions, rf"{re.escape(vllm_python)}/bin/pip install --no-deps -e \.")]
    assert run_index(instructions, r"requirements-vllm") < instructions.index(vllm_project)
    assert all("vllm" not in args for kind, args in instructions[: project + 1] if kind == "RUN")


def test_vllm_environment_is_where_rollout_vllm_python_points():
    from rlflow.engine.config import RolloutConfig

    instructions = dockerfile_instructions(DOCKERFILE)
    vllm_run = instructions[run_index(instructions, r"requirements-vllm\.txt")][1]
    venv = re.search(r"python3\.11 -m venv (\S+)", vllm_run)[1]
    documented = f"rollout.vllm_python: {venv}/bin/python"
    assert documented in INFRA_README.read_text()
    assert f"{venv}/bin/python" in DOCKERFILE.read_text()
    # The relative default also resolves, from the image's working directory, through a link.
    workdir = [args for kind, args in instructions if kind == "WORKDIR"][-1]
    default_venv = Path(RolloutConfig().vllm_python).parent.parent
    assert not default_venv.is_absolute()
    link = run_index(instructions, rf"ln -s {re.escape(venv)} {re.escape(str(Path(workdir) / default_venv))}($| )")
    assert link > run_index(instructions, r"requirements-vllm\.txt")
    main_venv = [args for kind, args in instructions if kind == "ENV" and args.startswith("VIRTUAL_ENV=")]
    assert main_venv and venv not in main_venv[0]


def test_dockerfile_copies_only_files_that_exist_and_reach_the_build():
    instructions = dockerfile_instructions(DOCKERFILE)
    included = {line[1:].strip("/") for line in DOCKERIGNORE.read_text().splitlines() if line.startswith("!")}
    assert "*" in DOCKERIGNORE.read_text().splitlines(), "the ignore file must start from nothing"
    copies = [args for kind, args in instructions if kind == "COPY"]
    assert copies
    for args in copies:
        parts = [p for p in args.split() if not p.startswith("--")]
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
            assert source.strip("/") in included, f"COPY {source}: excluded by {DOCKERIGNORE.name}"
    for name in ("engine", "tasks", "flows"):
        assert any(args.split()[-2].strip("/") == name for args in copies if not args.startswith("--from")), name


def test_dockerfile_runs_a_prefect_worker_as_a_numeric_non_root_user():
    instructions = dockerfile_instructions(DOCKERFILE)
    base = [args for kind, args in instructions if kind == "ARG" and args.startswith("BASE_IMAGE=")]
    assert base and base[0].split("=", 1)[1].startswith("nvidia/cuda:"), base
    user = [args for kind, args in instructions if kind == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user
    cmd = json.loads([args for kind, args in instructions if kind == "CMD"][-1])
    assert "prefect worker start --pool" in " ".join(cmd) and "RLFLOW_WORK_POOL" in " ".join(cmd)
    assert json.loads([args for kind, args in instructions if kind == "ENTRYPOINT"][-1])[0].endswith("tini")


# --- Kubernetes job template -----------------------------------------------------------------


def test_template_variables_are_a_valid_json_schema_whose_defaults_validate():
    variables = load_template()["variables"]
    validator_class = jsonschema.validators.validator_for(variables)
    validator_class.check_schema(variables)
    for name, schema in variables["properties"].items():
        if "default" in schema:
            validator_class(schema).validate(schema["default"])
    validator = validator_class(variables)
    assert validator.is_valid({"gpu_count": 8, "image_pull_policy": "Always"})
    assert not validator.is_valid({"gpu_count": -1})
    assert not validator.is_valid({"image_pull_policy": "Sometimes"})


def test_every_template_placeholder_names_a_variable_and_every_variable_is_used():
    from prefect.utilities.templating import find_placeholders

    template = load_template()
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    declared = set(template["variables"]["properties"])
    assert used - declared == set(), "placeholders without a variable"
    # `env` is merged by Prefect into job_configuration.env rather than placed by a placeholder.
    assert declared - used == {"env"}, "variables no placeholder uses"
    assert isinstance(template["job_configuration"]["env"], dict)


def test_template_holds_no_secret_values_and_names_the_compose_image():
    template = load_template()
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert "env" not in container, "the worker fills the container's env; secrets come through envFrom"
    assert container["envFrom"] == [{"secretRef": {"name": "{{ secret_name }}"}}]
    for key in template["job_configuration"]["env"]:
        assert not SECRET_NAME.search(key), key
    for name, schema in template["variables"]["properties"].items():
        default = json.dumps(schema.get("default", ""))
        assert not re.search(r"(?i)password|secret_key|aws_secret", default), name
    image = template["variables"]["properties"]["image"]["default"]
    assert image == read_env_file(ENV_EXAMPLE)["RLFLOW_IMAGE"]
    assert image.rsplit(":", 1)[1] == project_version()


def on_server(api_url: str):
    """Prefect reads its settings once, at import: point this test's clients at the session server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    return temporary_settings(updates={PREFECT_API_URL: api_url})


def test_prefect_server_accepts_the_template_and_rejects_a_broken_one(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import PrefectHTTPStatusError

    template = load_template()
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    with on_server(prefect_server), get_client(sync_client=True) as client:
        assert str(client.api_url).rstrip("/") == prefect_server  # the real server, not a temporary one
        client.create_work_pool(WorkPoolCreate(name=name, type="kubernetes", base_job_template=template))
        try:
            pool = client.read_work_pool(name)
            assert pool.type == "kubernetes"
            assert pool.base_job_template == template
        finally:
            client.delete_work_pool(name)
        broken = copy.deepcopy(template)
        limits = broken["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"]
        limits["limits"]["nvidia.com/gpu"] = "{{ gpu_cuont }}"
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_work_pool(WorkPoolCreate(name=f"{name}-broken", type="kubernetes", base_job_template=broken))
        assert refused.value.response.status_code == 422
        assert "gpu_cuont" in refused.value.response.text


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


def test_worker_renders_a_gpu_job_manifest_from_the_defaults(prefect_server):
    config = render(prefect_server, {})
    manifest = config["job_manifest"]
    assert "{{" not in json.dumps(config), "unresolved placeholders"
    assert kubernetes_worker_problems(manifest) == []
    assert manifest["spec"]["backoffLimit"] == 0  # Prefect retries (from the checkpoint), not Kubernetes
    assert manifest["spec"]["ttlSecondsAfterFinished"] == 86400
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "64Gi"}
    assert container["image"] == read_env_file(ENV_EXAMPLE)["RLFLOW_IMAGE"]
    assert "args" not in container  # the worker adds `prefect flow-run execute`
    shm = [v for v in pod["volumes"] if v["name"] in {m["name"] for m in container["volumeMounts"]}]
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/dev/shm"]
    assert shm[0]["emptyDir"]["medium"] == "Memory"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["envFrom"] == [{"secretRef": {"name": "rlflow-secrets"}}]
    # Without prefect_api_url the pod inherits the worker's PREFECT_API_URL.
    assert config["env"] == {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}


def test_worker_renders_a_deployments_overrides(prefect_server):
    config = render(
        prefect_server,
        {
            "gpu_count": 8,
            "cpu_limit": "64",
            "image": "registry.example.com/rlflow-gpu:0.1.0",
            "prefect_api_url": "http://prefect-server.rlflow:4200/api",
            "env": {"NCCL_DEBUG": "INFO"},
            "namespace": "research",
        },
    )
    manifest = config["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "64", "memory": "64Gi"}
    assert container["image"] == "registry.example.com/rlflow-gpu:0.1.0"
    assert manifest["metadata"]["namespace"] == config["namespace"] == "research"
    assert config["env"] == {
        "PREFECT_API_URL": "http://prefect-server.rlflow:4200/api",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "NCCL_DEBUG": "INFO",
    }
    # The check of the worker's rules catches a manifest it would refuse.
    manifest["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    assert kubernetes_worker_problems(manifest) == ["replace /spec/template/spec/restartPolicy"]
