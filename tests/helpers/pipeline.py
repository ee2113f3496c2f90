"""Running the real CLI the way a user does, for the end-to-end scenarios: `rlflow run` as a
subprocess, its config file, and the Prefect task runs a run left on the server."""

import subprocess
import sys

import yaml


def cli(config_path, *overrides, **popen):
    cmd = [sys.executable, "-m", "rlflow.flows.cli.main", "run", str(config_path), *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def finish(proc, timeout=400):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def write_config(path, tree):
    path.write_text(yaml.safe_dump(tree))
    return path


def prefect_task_runs(api_url, run_name):
    """Flow runs of `run_name` (oldest first) and each one's task runs, read from the server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Prefect read its settings when first imported: point this process's client explicitly.
    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name])))
        flow_runs = sorted(flow_runs, key=lambda r: r.created)
        tasks = [
            sorted(client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [fr.id]})), key=lambda t: t.created)
            for fr in flow_runs
        ]
    return flow_runs, tasks
