"""Static checks of infra/Dockerfile.gpu and the Kubernetes GPU job template.

Docker and Kubernetes are not available here. The Dockerfile's instructions are read and checked
against the Makefile's pins; the job template against a real Prefect server (it accepts the
template and rejects a broken one) and Prefect's own templating code (it renders the manifest a
worker would submit).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from pathlib import Path

import jsonschema
import pytest
from helpers.infra_files import (
    DOCKERFILE,
    DOCKERIGNORE,
    ENV_EXAMPLE,
    INFRA_README,
    ROOT,
    SECRET_NAME,
    dockerfile_instructions,
    kubernetes_worker_problems,
    load_template,
    makefile_torch_pin,
    on_server,
    project_version,
    read_env_file,
    render,
    run_index,
)

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
    from rlflow.engine.config.execution import RolloutConfig

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
            "image": "registry.example.com/rlflow-gpu:0.2.0",
            "prefect_api_url": "http://prefect-server.rlflow:4200/api",
            "env": {"NCCL_DEBUG": "INFO"},
            "namespace": "research",
        },
    )
    manifest = config["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "64", "memory": "64Gi"}
    assert container["image"] == "registry.example.com/rlflow-gpu:0.2.0"
    assert manifest["metadata"]["namespace"] == config["namespace"] == "research"
    assert config["env"] == {
        "PREFECT_API_URL": "http://prefect-server.rlflow:4200/api",
        "MLFLOW_TRACKING_URI": "http://mlflow:5000",
        "NCCL_DEBUG": "INFO",
    }
    # The check of the worker's rules catches a manifest it would refuse.
    manifest["spec"]["template"]["spec"]["restartPolicy"] = "OnFailure"
    assert kubernetes_worker_problems(manifest) == ["replace /spec/template/spec/restartPolicy"]
