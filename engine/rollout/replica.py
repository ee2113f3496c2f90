"""A rollout replica, trainer side: an HTTP server that samples and takes new weights.

    client = ReplicaClient(url, key, tokenizer, name="vllm-0")
    generation = client.generate(prompts, params, seed)        # token ids in, ids + log-probs out
    stats = client.update_weights(policy.named_parameters(), bucket_mb=256, version=1)
    assert client.fingerprint() == weights_fingerprint(policy.named_parameters(), round_to=client.dtype)

The routes are vLLM 0.32's, so a replica is a vLLM server (started by rlflow, or an external fleet
named by rollout.endpoints):
- `POST /inference/v1/generate`: one request per row, prompt token ids in; sampled ids, per-token
  log-probs (after temperature: the server runs with `--logprobs-mode processed_logprobs`) and
  the weight version of each token span out. Nothing is tokenised or decoded on the way.
- the RL routes: `/pause`, `/resume`, `/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`, `/update_weight_version`, `/weight_info`.

Every request carries the replica's key (engine/rollout/replica_auth.py); every wait is bounded by
`timeout_s`. Weights travel through rlflow's transfer engine in the replica (vllm_transfer.py) over a
channel (transfer.py): `transport="shm"`, a memfd on this host, `"gloo"`, a two-rank gloo group
for a replica anywhere, or `"fsspec"`, safetensors files in a folder both reach (`weights_url`); the
replica reports the fingerprint of what it loaded over the same channel.
A replica's engine serves the trainer that attached last.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import requests
import torch
import urllib3

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.config.secrets import redact_url
from rlflow.engine.errors import RlflowError
from rlflow.engine.models.tokens import stop_token_ids
from rlflow.engine.rollout.replica_auth import auth_header
from rlflow.engine.rollout.transfer import UPDATE_PHASES, make_channel
from rlflow.engine.rollout.weight_sync import DTYPES, Bucket, iter_buckets

MB = 1 << 20
TRANSFER_BACKEND = "rlflow"  # engine/rollout/vllm_transfer.py registers it under this name
# Rows in flight per replica (threads start as needed). An HF replica samples a batch only once all its
# rows have arrived, so a generate call's rows must all be in flight at once: generate_batch may not exceed it.
MAX_PARALLEL_ROWS = 1024


class Generation(NamedTuple):
    """A replica's samples, one entry per prompt; each response ends at its EOS (kept) or the length limit."""

    response_ids: list[list[int]]
    logprobs: list[list[float]]  # log softmax(logits / T) of each sampled token, by the replica
    # the policy version that sampled each token (several in a row a partial rollout continued
    # across weight updates); None where the reply did not say
    versions: list[list[int]] | None = None


class ReplicaError(RlflowError):
    """A replica refused a request, did not answer in time, or answered something malformed."""


@dataclass(frozen=True)
class SyncStats:
    """One weight update (the caller logs its own timing_s/update_weights, which includes its hashing)."""

    seconds: float
    bytes: int  # tensor bytes sent (alignment padding excluded)
    gb_per_s: float
    buckets: int
    tensors: int
    transport: str
    replica_s: dict[str, float]  # {phase of UPDATE_PHASES: seconds}, per phase the slowest replica's

    def metrics(self) -> dict[str, float]:
        """rollout/sync_gb_per_s and timing_s/update_weights/replica_<phase> (where the replicas' side went)."""
        replica = {f"timing_s/update_weights/replica_{phase}": s for phase, s in self.replica_s.items()}
        return {"rollout/sync_gb_per_s": self.gb_per_s} | replica


def row_seed(seed: int, row: int) -> int:
    """Row i of a request samples with its own seed, so equal prompts in one batch draw independently."""
    return (seed * 1_000_003 + row) % (1 << 63)


def version_label(run_tag: str, version: int) -> str:
    """The weight version a replica records: the run's tag, so a replica of another run is told apart."""
    return f"{run_tag}:{version}"


@dataclass(frozen=True)
class RowBatch:
    """What the rows of one generate call share. Each row samples with its own seed (row_seed); an
    HF replica, told the batch (`hint`), samples all its rows together with `seed` instead, exactly as
    colocated generation samples that chunk. vLLM ignores the hint."""

    id: str
    rows: int
    params: SamplingParams
    seed: int
    stops: tuple[int, ...]
    pad: int
    priority: bool = False  # the sync probe: sampled before the batches waiting (HF replica)

    def hint(self, row: int) -> dict[str, Any]:
        return {"batch": self.id, "rows": self.rows, "row": row, "seed": self.seed, "pad": self.pad,
                "priority": self.priority}  # fmt: skip


class RowRequests:
    """Generations sent row by row on a thread pool and collected whole: a sampler's submit/collect.
    `row(index, prompt, batch)` samples one row and returns (ids, log-probs, versions)."""

    def __init__(self, workers: int, name: str):
        self.name, self.workers = name, workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix=f"rows-{name}")
        self.pending: dict[int, list[Future]] = {}
        self.next_id = 0
        self.prefix = secrets.token_hex(4)  # batch ids unique across clients of one replica
        self.lock = threading.Lock()

    def submit(
        self, row: Callable[..., Any], prompts: Sequence[Sequence[int]], params: Any, seed: int, tokenizer: Any,
        priority: bool = False,
    ) -> int:
        if len(prompts) > self.workers:
            raise ReplicaError(
                f"{self.name}: {len(prompts)} rows in one generate call, more than the {self.workers} a replica"
                " takes in flight; lower rollout.generate_batch"
            )
        stops = tuple(int(t) for t in stop_token_ids(tokenizer))
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
            batch = RowBatch(f"{self.prefix}-{request_id}", len(prompts), params, int(seed), stops,
                             int(tokenizer.pad_token_id), priority)  # fmt: skip
            self.pending[request_id] = [
                self.pool.submit(row, i, [int(t) for t in prompt], batch) for i, prompt in enumerate(prompts)
            ]
        return request_id

    def collect(self, request_id: int | None = None) -> Generation:
        with self.lock:
            if not self.pending:
                raise ReplicaError(f"{self.name}: collect() with no request outstanding")
            futures = self.pending.pop(min(self.pending) if request_id is None else request_id)
        rows = [f.result() for f in futures]
        return Generation([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ReplicaClient:
    """One replica. Generations may be submitted while others run (`submit`/`collect`); weight
    updates pause the replica first (`pause_mode`: wait lets generations in flight finish with the
    old weights, keep freezes them and continues them with the new ones)."""

    def __init__(
        self,
        url: str,
        key: str,
        tokenizer: Any,
        *,
        name: str | None = None,
        run_tag: str = "rlflow",
        timeout_s: float = 600.0,
        on_failure: Callable[[], str] | None = None,
        on_close: Callable[[], None] | None = None,
        on_kill: Callable[[], None] | None = None,
        pause_mode: str = "wait",
        check_fingerprint: bool = True,
        transport: str = "shm",
        gloo_host: str = "127.0.0.1",
        weights_url: str | None = None,
    ):
        self.url, self.name = url.rstrip("/"), name or redact_url(url)
        self.tokenizer, self.run_tag, self.timeout_s = tokenizer, run_tag, timeout_s
        self._headers = auth_header(key)
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=MAX_PARALLEL_ROWS + 4)
        self._session.mount("http://", adapter)  # a connection per row in flight, and the control calls
        self._session.mount("https://", adapter)
        self._rows = RowRequests(MAX_PARALLEL_ROWS, f"rollout replica {self.name}")
        self.channel = make_channel(
            transport, fingerprint=check_fingerprint, timeout_s=timeout_s, gloo_host=gloo_host, url=weights_url
        )
        self._report: dict[str, Any] = {}
        self.on_failure = on_failure  # says why (e.g. the replica process died, quoting its log)
        self.on_close = on_close  # stops a replica this client owns
        self.on_kill = on_kill  # SIGKILLs it (fault tests)
        self.pause_mode = pause_mode  # how an update treats generations in flight: wait, or keep (partial rollouts)
        self.dtype = torch.float32  # the replica's weight dtype, from its transfer engine's report

    # --- HTTP ------------------------------------------------------------------------------------

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        """The replica's whole answer to one request; no answer is a ReplicaError naming the replica."""
        try:
            return self._session.request(
                method, self.url + path, json=body, params=params or None, headers=self._headers, timeout=self.timeout_s
            )
        except requests.RequestException as exc:
            self._fail(f"{path} {self._what_went_wrong(exc)}")

    def _what_went_wrong(self, exc: requests.RequestException) -> str:
        # requests raises a read timeout met in the body as a ConnectionError: a timeout all the same
        body_timeout = exc.args and isinstance(exc.args[0], urllib3.exceptions.ReadTimeoutError)
        if isinstance(exc, requests.Timeout) or body_timeout:
            return f"got no answer within {self.timeout_s:g} s (rollout.response_timeout_s)"
        if isinstance(exc, requests.ConnectionError):
            return f"could not connect ({type(exc).__name__})"
        return f"broke off its answer ({type(exc).__name__})"  # e.g. it died mid-answer: ChunkedEncodingError

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, **params: Any) -> dict[str, Any]:
        response = self._send(method, path, body, **params)
        if response.status_code == 401:
            self._fail(f"{path} was refused (401): the replica wants another API key")
        if response.status_code >= 400:
            self._fail(f"{path} answered {response.status_code}: {response.text[:300]}")
        try:
            return response.json() if response.content else {}
        except ValueError:
            self._fail(f"{path} answered something that is not JSON: {response.text[:120]!r}")

    def _fail(self, what: str) -> Any:
        detail = self.on_failure() if self.on_failure is not None else ""
        raise ReplicaError(f"rollout replica {self.name}: {what}" + (f"; {detail}" if detail else ""))

    def health(self) -> bool:
        try:
            return self._session.get(self.url + "/health", timeout=min(self.timeout_s, 5.0)).status_code == 200
        except requests.RequestException:
            return False

    def gauge(self, name: str) -> float | None:
        """The sum of a GET /metrics series (e.g. vllm:num_requests_running, rlflow:idle_seconds_total);
        None where the replica does not report it."""
        response = self._send("GET", "/metrics")
        values = [line.rsplit(" ", 1)[-1] for line in response.text.splitlines() if line.startswith(name)]
        return sum(float(v) for v in values) if values else None

    def idle_s(self) -> float | None:
        """Seconds the replica has had nothing to sample (the HF replica says; vLLM does not: None)."""
        return self.gauge("rlflow:idle_seconds_total")

    # --- sampling --------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Any:
        return self.collect(self.submit(prompts, params, seed))

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int, *, priority: bool = False
    ) -> int:
        """Send one request per row and return at once; `collect` waits for them."""
        return self._rows.submit(self._generate_row, prompts, params, seed, self.tokenizer, priority)

    @property
    def outstanding(self) -> int:
        return len(self._rows.pending)

    def collect(self, request_id: int | None = None) -> Any:
        return self._rows.collect(request_id)

    def _generate_row(self, index: int, prompt: list[int], batch: RowBatch, hint: bool = True):
        """One row: (ids, log-probs, per-token versions). `hint`: tell the replica the row's batch."""
        params = batch.params
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_new_tokens,
            "seed": row_seed(batch.seed, index),
            "logprobs": 0,
            "stop_token_ids": list(batch.stops),
            "detokenize": False,
        }
        body = {"token_ids": prompt, "sampling_params": sampling}
        body |= {"rlflow_batch": batch.hint(index)} if hint else {}
        reply = self._call("POST", "/inference/v1/generate", body)
        return self._parse_row(reply, params.max_new_tokens)

    def _parse_row(self, reply: dict[str, Any], max_tokens: int) -> tuple[list[int], list[float], list[int]]:
        """Token ids, log-probs and per-token versions of one answer; anything malformed is an error."""
        try:
            choice = reply["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(c["logprob"]) for c in choice["logprobs"]["content"]]
            spans = choice.get("weight_versions") or []
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            self._fail(f"/inference/v1/generate answered without token ids and log-probs ({type(exc).__name__}: {exc})")
        if not ids or len(ids) > max_tokens:
            self._fail(f"/inference/v1/generate answered {len(ids)} tokens; asked for 1 to {max_tokens}")
        if len(logprobs) != len(ids):
            self._fail(f"/inference/v1/generate answered {len(ids)} tokens but {len(logprobs)} log-probs")
        bad = [x for x in logprobs if math.isnan(x) or x > 1e-6]
        if bad:
            self._fail(f"/inference/v1/generate answered log-prob {bad[0]} (NaN or positive)")
        return ids, logprobs, self._token_versions(spans, len(ids))

    def _token_versions(self, spans: list[dict[str, Any]], length: int) -> list[int]:
        versions = [-1] * length
        for span in spans:
            tag, _, number = str(span.get("version", "")).rpartition(":")
            if tag != self.run_tag or not number.isdigit():
                self._fail(
                    f"sampled with weight version {span.get('version')!r}, not one of this run's ({self.run_tag}:N):"
                    " the replica holds weights rlflow did not send it"
                )
            for i in range(int(span["start"]), min(int(span["end"]), length)):
                versions[i] = int(number)
        if -1 in versions:
            self._fail("/inference/v1/generate left tokens without a weight version")
        return versions

    # --- weights ---------------------------------------------------------------------------------

    _sent = 0  # tensors sent since begin_update

    def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        return self._call("POST", path, body)

    def attach(self, slot_bytes: int) -> None:
        """Set up the transfer channel (buckets up to slot_bytes); the replica reports its dtype."""
        report = self.channel.attach(self._post, slot_bytes)
        if report.get("dtype") not in DTYPES:
            self._fail(
                f"its transfer engine reported dtype {report.get('dtype')!r}: is it started with"
                f" --weight-transfer-config '{{\"backend\": \"{TRANSFER_BACKEND}\"}}'?"
            )
        self.dtype = DTYPES[report["dtype"]]

    def pause(self, mode: str = "wait") -> None:
        self._call("POST", "/pause", mode=mode)

    def resume(self) -> None:
        self._call("POST", "/resume")

    def weight_version(self) -> str | None:
        return self._call("GET", "/weight_info").get("weight_version")

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_mb: float = 256,
        *,
        version: int | None = None,
        pause_mode: str | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> SyncStats:
        """Pause (`pause_mode`, default this client's), start / update per bucket / finish through the
        transfer engine, record the version, resume (push_weights; `meanwhile` runs during the finish)."""
        return push_weights([self], named_tensors, bucket_mb, version, pause_mode, meanwhile)

    def begin_update(self, pause_mode: str | None = None) -> None:
        self.pause(pause_mode or self.pause_mode)
        try:
            self._call("POST", "/start_weight_update")
        except BaseException:
            self.resume()
            raise
        self._sent = 0

    def send_bucket(self, bucket: Bucket, index: int, bucket_bytes: int) -> None:
        if bucket.nbytes > self.channel.slot_bytes:
            self.attach(max(bucket_bytes, bucket.nbytes))
        self.channel.send(self._post, bucket, index)
        self._sent += len(bucket.entries)

    def end_update(self, version: int | None) -> None:
        """Finish, record the version, resume; the replica must have loaded every tensor sent."""
        try:
            self._report = self.channel.finish(self._post)
            if version is not None:
                self._call("POST", "/update_weight_version", {"new_version": version_label(self.run_tag, version)})
        finally:
            self.resume()
        if self._report.get("tensors") != self._sent:
            self._fail(f"loaded {self._report.get('tensors')} tensors of the {self._sent} sent")

    def abort_update(self) -> None:
        """After a failed send: resume sampling (the replica keeps whatever it had loaded; the guard sees it)."""
        try:
            self.resume()
        except ReplicaError:
            pass

    def fingerprint(self) -> str:
        """The fingerprint of the weights the replica loaded in its last update (its finish's report)."""
        if "fingerprint" not in self._report:
            self._fail("fingerprint() before any weight update")
        return str(self._report["fingerprint"])

    def kill(self) -> None:
        """SIGKILL the replica this client started (RLFLOW_FAULT rollout:replica_kill); nothing for one it did not."""
        if self.on_kill is not None:
            self.on_kill()

    def close(self) -> None:
        self._rows.close()
        self._session.close()
        self.channel.close()
        if self.on_close is not None:
            self.on_close()
            self.on_close = None

    def __enter__(self) -> ReplicaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def push_weights(
    clients: Sequence[ReplicaClient],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_mb: float,
    version: int | None,
    pause_mode: str | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> SyncStats:
    """One weight update of several replicas: the tensors are iterated once (under ZeRO-3 each is a
    gather) and each bucket goes to every replica in turn; then each finishes and resumes.
    `meanwhile` runs on this thread while the replicas finish (they fingerprint what they loaded): the
    trainer hashes its own weights then, so a guarded sync costs one hash of the weights, not two."""
    started = time.monotonic()
    bucket_bytes = max(1, int(bucket_mb * MB))
    buckets = tensors = sent = 0
    begun: list[ReplicaClient] = []
    try:
        for client in clients:
            client.begin_update(pause_mode)
            begun.append(client)
        for index, bucket in enumerate(iter_buckets(named_tensors, bucket_bytes)):
            for client in clients:
                client.send_bucket(bucket, index, bucket_bytes)
            buckets, tensors = buckets + 1, tensors + len(bucket.entries)
            sent += sum(e.nbytes for e in bucket.entries)
    except BaseException:
        for client in begun:
            client.abort_update()
        raise
    failures: list[BaseException] = []

    def finish(client: ReplicaClient) -> None:
        try:
            client.end_update(version)
        except BaseException as exc:  # re-raised below, on the caller's thread
            failures.append(exc)

    threads = [threading.Thread(target=finish, args=(c,), name=f"finish-{c.name}", daemon=True) for c in clients]
    for thread in threads:
        thread.start()
    try:
        if meanwhile is not None:
            meanwhile()
    finally:  # every call is bounded by the client's timeout
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    seconds = time.monotonic() - started
    transport = "+".join(sorted({c.channel.transport for c in clients}))
    replica_s = {p: max((float(c._report.get(f"{p}_s", 0.0)) for c in clients), default=0.0) for p in UPDATE_PHASES}
    return SyncStats(seconds, sent, sent / max(seconds, 1e-9) / 1e9, buckets, tensors, transport, replica_s)
