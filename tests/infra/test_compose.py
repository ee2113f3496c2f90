"""Static checks of infra/docker-compose.yml and infra/.env.example.

Docker is not available here, so nothing is built, pulled or started. The Compose file is checked
against the Compose Specification's JSON schema (as vendored by check-jsonschema) and the
machine notes; its variables against the example environment file; and no secret is written in it.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.infra_files import (
    ENV_EXAMPLE,
    INFRA,
    INFRA_README,
    ONE_REFERENCE,
    ROOT,
    SECRET_NAME,
    URL_CREDENTIALS,
    compose_references,
    compose_strings,
    depends_on,
    environment_items,
    load_compose,
    pyproject_pin,
    read_env_file,
)

# --- Compose ---------------------------------------------------------------------------------


def test_compose_file_is_valid_under_the_compose_specification():
    import check_jsonschema  # a test dependency: it vendors the Compose Specification schema
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
