"""The HF rollout replica: a transformers model behind vLLM's routes, so one client drives both backends.

    RLFLOW_REPLICA_API_KEY=... python -m rlflow.engine.rollout.hf_replica --model-dir DIR --port 8000

Started by rlflow (engine/rollout/replicas.py), never by hand in a run. The routes are the ones
engine/rollout/replica.py's ReplicaClient calls on a vLLM server, with the same bodies and answers:
`POST /inference/v1/generate` (one row: prompt ids in; ids, processed log-probs and weight-version
spans out), `/pause` (`mode` wait or keep), `/resume`, `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/update_weight_version`,
`GET /weight_info`, `GET /rlflow/model_signature`, `GET /metrics` (`rlflow:idle_seconds_total`,
`rlflow:num_requests_running`), and
`GET /health`. A row may name its batch (`rlflow_batch`, which vLLM ignores): then it is sampled with
the rest of that batch, exactly as colocated generation would (engine/rollout/hf_sampler.py).

Weights come through rlflow's channels (engine/rollout/transfer_receiver.py: shm, gloo or fsspec) and
are copied into the parameters (converting the dtype); the report's fingerprint hashes the parameters
themselves. Every route but /health wants the key (replica_auth.RequireKey, from the environment
only). Binds 127.0.0.1 unless told otherwise; exits when the trainer that started it is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qs

import torch

from rlflow.engine.rollout.hf_sampler import BatchKey, HFModel, HFSampler, RowRequest, SamplerError
from rlflow.engine.rollout.replica_auth import RequireKey
from rlflow.engine.rollout.replica_model import SIGNATURE_PATH, model_signature
from rlflow.engine.rollout.replica_watch import watch_trainer
from rlflow.engine.rollout.transfer_receiver import BucketUpdate, ReplicaChannel, TransferInit, UpdateClock

log = logging.getLogger("rlflow.hf_replica")
MAX_CALLS = 32  # control calls handled at once (rows wait for their batch without a thread)


class HFReplica:
    """The routes' logic, on plain dicts: (method, path) -> handler(body, query) -> JSON answer."""

    def __init__(self, model: HFModel, sampler: HFSampler):
        self.model, self.sampler = model, sampler
        self.channel: ReplicaChannel | None = None
        self.loaded = 0  # tensors loaded since /start_weight_update
        self.clock = UpdateClock()
        self.routes: dict[tuple[str, str], Callable[[dict[str, Any], dict[str, str]], Any]] = {
            ("GET", "/health"): lambda body, query: {},
            ("POST", "/inference/v1/generate"): self.generate,
            ("POST", "/pause"): lambda body, query: self.sampler.pause(query.get("mode", "abort")) or {},
            ("POST", "/resume"): lambda body, query: self.sampler.resume() or {},
            ("POST", "/init_weight_transfer_engine"): self.init_transfer,
            ("POST", "/start_weight_update"): self.start_update,
            ("POST", "/update_weights"): self.update_weights,
            ("POST", "/finish_weight_update"): self.finish_update,
            ("POST", "/update_weight_version"): self.set_version,
            ("GET", "/weight_info"): lambda body, query: {"weight_version": self.sampler.version},
            ("GET", SIGNATURE_PATH): lambda body, query: model_signature(self.model.model.config.to_dict()),
            ("GET", "/metrics"): lambda body, query: self.metrics(),
        }

    async def generate(self, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        """One row: awaited on the event loop, so rows waiting for their batch hold no thread."""
        request, timeout_s = row_request(body), self.sampler.timeout_s
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(self.sampler.submit(request)), timeout_s)
        except TimeoutError:
            raise SamplerError(f"the row was not sampled within {timeout_s:g} s (a batch missing rows?)") from None
        content = [{"logprob": x} for x in result.logprobs]
        choice = {"token_ids": result.ids, "logprobs": {"content": content}, "weight_versions": result.spans}
        return {"choices": [choice]}

    def metrics(self) -> str:
        """Prometheus text: idle seconds (timing_s/wait_train) and the rows being sampled."""
        return (
            f"rlflow:idle_seconds_total {self.sampler.idle_s:.6f}\n"
            f"rlflow:num_requests_running {self.sampler.rows_running}\n"
        )

    def init_transfer(self, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        init = TransferInit(**_field(body, "init_info"))
        if self.channel is not None:
            self.channel.close()
        self.channel = ReplicaChannel(init)
        self.channel.report({"dtype": str(self.model.dtype).removeprefix("torch.")})
        return {}

    def start_update(self, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        self.sampler.require_paused("/start_weight_update")
        self.loaded = 0
        self.clock.reset()
        return {}

    def update_weights(self, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        if self.channel is None:
            raise SamplerError("/update_weights before /init_weight_transfer_engine")
        self.sampler.require_paused("/update_weights")
        with self.clock.phase("receive"):
            weights = self.channel.receive(BucketUpdate(**_field(body, "update_info")))
        with self.clock.phase("load"):
            self.model.load(weights)  # copied into the parameters: the channel's buffer may be reused
        self.loaded += len(weights)
        return {}

    def finish_update(self, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        if self.channel is None:
            raise SamplerError("/finish_weight_update before /init_weight_transfer_engine")
        with self.clock.phase("fingerprint"):
            fingerprint = self.model.fingerprint() if self.channel.init.fingerprint else None
        dtype = str(self.model.dtype).removeprefix("torch.")
        report = {"dtype": dtype, "tensors": self.loaded, "fingerprint": fingerprint} | self.clock.report()
        self.channel.report(report)
        return {}

    def set_version(self, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        self.sampler.version = str(_field(body, "new_version"))
        return {}


def _field(body: dict[str, Any], name: str) -> Any:
    if name not in body:
        raise SamplerError(f"the request body has no {name!r}")
    return body[name]


def row_request(body: dict[str, Any]) -> RowRequest:
    """A /inference/v1/generate body as a RowRequest; what is missing or malformed is a SamplerError."""
    try:
        sampling = body["sampling_params"]
        hint = body.get("rlflow_batch")
        key = None if hint is None else BatchKey(
            str(hint["batch"]), int(hint["rows"]), int(hint["seed"]), int(hint["pad"]), bool(hint.get("priority"))
        )
        request = RowRequest(
            [int(t) for t in body["token_ids"]],
            float(sampling.get("temperature", 1.0)),
            float(sampling.get("top_p", 1.0)),
            int(sampling["max_tokens"]),
            int(sampling.get("seed") or 0),
            [int(t) for t in sampling["stop_token_ids"]],
            int(hint["row"]) if hint is not None else 0,
            key,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SamplerError(f"malformed generate request ({type(exc).__name__}: {exc})") from None
    if not request.prompt or request.temperature <= 0 or request.max_tokens < 1 or not request.stops:
        raise SamplerError("generate needs prompt ids, temperature > 0, max_tokens >= 1 and stop_token_ids")
    return request


class App:
    """A minimal ASGI app over HFReplica's routes: JSON in and out, each call on a thread of its own
    (rows block until their batch is sampled; a gloo update blocks inside its call)."""

    def __init__(self, replica: HFReplica):
        self.replica = replica
        self.pool = ThreadPoolExecutor(MAX_CALLS, thread_name_prefix="replica-call")

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        route = self.replica.routes.get((scope["method"], scope["path"]))
        if route is None:
            await _answer(send, 404, {"error": f"no route {scope['method']} {scope['path']}"})
            return
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
        if inspect.iscoroutinefunction(route):  # a row: it waits for its batch on the event loop
            try:
                status, answer = 200, await route(json.loads(body) if body else {}, query)
            except Exception as exc:
                status, answer = _failure(exc)
        else:  # pause waits for the running batch, a gloo update inside a collective: on a thread
            loop = asyncio.get_running_loop()
            status, answer = await loop.run_in_executor(self.pool, _call, route, body, query)
        await _answer(send, status, answer)


def _call(route: Callable[..., Any], body: bytes, query: dict[str, str]) -> tuple[int, Any]:
    try:
        return 200, route(json.loads(body) if body else {}, query)
    except Exception as exc:
        return _failure(exc)


def _failure(exc: Exception) -> tuple[int, Any]:
    """400 for the request's fault (say what was wrong), 500 for the replica's (logged with its trace)."""
    if not isinstance(exc, (SamplerError, ValueError, TypeError)):
        log.error("request failed", exc_info=exc)
        return 500, {"error": f"{type(exc).__name__}: {exc}"}
    return 400, {"error": f"{type(exc).__name__}: {exc}"}


async def _answer(send: Any, status: int, answer: Any) -> None:
    text = isinstance(answer, str)
    body = answer.encode() if text else json.dumps(answer).encode()
    kind = b"text/plain" if text else b"application/json"
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="rlflow's HF rollout replica (started by rlflow)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest pause and batch wait")
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from rlflow.engine.backend.cpu_memory import keep_freed_memory

    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s hf-replica[{os.getpid()}] %(message)s"
    )
    watch_trainer()  # ends with the trainer that started it (replica_watch.py)
    if not os.path.isdir(args.model_dir):
        log.error("model directory %s does not exist; point the replica at a local HF model", args.model_dir)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():  # as make_runtime: a CPU process keeps its freed memory
        keep_freed_memory()
    app = RequireKey(App(HFReplica(model := HFModel(args.model_dir, args.dtype, args.trust_remote_code),
                                   HFSampler(model, args.timeout_s))))  # fmt: skip
    log.info("loaded %s (%s); serving on %s:%d", args.model_dir, model.dtype, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on")
    return 0


if __name__ == "__main__":
    sys.exit(main())
