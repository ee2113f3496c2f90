"""Running the real CLI the way a user does, for the end-to-end scenarios: `rlflow run` as a
subprocess, its config file, the Prefect task runs a run left on the server, and answering a
paused flow run as an operator would."""

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


def wait_paused(api_url, run_name, proc, timeout=300):
    """Poll the server (no fixed sleeps) until the run's flow run is Paused; the CLI must be alive."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the flow run never paused"
        flow_runs, _ = prefect_task_runs(api_url, run_name)
        if flow_runs and flow_runs[-1].state.type.value == "PAUSED":
            return flow_runs[-1]
        time.sleep(0.2)


def resume_paused(api_url, flow_run_id, run_input, proc, timeout=60):
    """Resume with input from this (second) process; retried until the pausing flow has saved the
    input's schema, which it does just after the Paused state is set."""
    import time

    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        while True:
            try:
                return resume_flow_run(flow_run_id, run_input=run_input)
            except RuntimeError as exc:  # "Run input schema not found" until the flow saved it
                assert proc.poll() is None and time.monotonic() < deadline, exc
                time.sleep(0.2)
