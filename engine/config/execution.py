"""Config sections of how a run executes: checkpoints and resume, per-stage policies, safety
guards and alerts, tracking, the engine and its resources, the rollout replicas and GPU placement.
Assembled into `Config` by engine/config/schema.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rlflow.engine.config.base import Section, neutral

TRANSPORT = "how samples and weights travel to the rollout replicas, not what is sampled"
SPREAD = "where rows are sampled, not what: each row has its own seed (vLLM's batching may move last digits)"
SYNC_GUARD = "a check of every weight sync: it stops a run, never changes what is trained"

# The default stop of the sync guard's log-prob check, in nats, per (server_backend, rollout.dtype), against
# an fp32 trainer, from `bench/sampler_mismatch.py` (SmolLM2-135M-Instruct, 64 chat prompts x 32 tokens, T=1;
# docs/vllm.md): largest |diff| 5.5e-5 (hf fp32), 7.2e-5 (vllm fp32; 3e-4 after perturbing each layer),
# 0.27 (hf bf16), 0.71 (vllm bf16, a heavy tail: p99 0.16). fp32 stops at a skipped update (0.05-1 nats
# in the tests); bf16 only at a broken sampler, its rounding being what algorithm.rollout_correction
# corrects. The weights themselves are checked exactly either way (rollout.check_fingerprint).
LOGPROB_DIFF_STOPS: dict[tuple[str, str], float] = {
    ("hf", "float32"): 1e-3,
    ("hf", "bfloat16"): 5.0,
    ("vllm", "float32"): 2e-3,
    ("vllm", "bfloat16"): 5.0,
}


class CheckpointConfig(Section):
    every_steps: int = Field(10, ge=1)
    """Training stages commit a checkpoint every this many steps (and at their last)."""
    keep_last: int = Field(2, ge=1)
    """Newest committed checkpoints kept per stage; older ones are pruned (a stage's final step and
    keep_best's step stay)."""
    consolidate_every: int = Field(5, ge=1)
    """Every n-th checkpoint (and a stage's last) also holds whole HF model directories; the others
    hold only per-rank optimizer shards with fp32 master weights (a 70B policy is 140 GB each time)."""
    keep_best: str | None = None
    """A metric of PPO's evaluations, e.g. "eval/rm_score" or a judge's "reward/judge/mean": the best
    evaluated step is never pruned (and is the hacking detector's rollback target when it precedes
    the diverged window)."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether keep_best's best is its max or its min ("min" for losses and KL)."""
    mirror: str | None = None
    """A second copy of every committed step (any fsspec URL), written in the background; None: none."""
    mirror_storage_options: dict[str, Any] = Field(default_factory=dict)
    """fsspec options of the mirror (its credentials)."""
    mirror_retries: int = Field(8, ge=0)
    """Retries of each file copy before the step is tried again later."""
    mirror_backoff_s: float = Field(1.0, gt=0)
    """First retry delay in seconds; doubles up to 60 s."""
    preempt_grace_s: float = Field(120.0, gt=0)
    """SIGTERM (spot reclaim, pod eviction): checkpoint at the next step boundary within this time (s)."""


class ResumeConfig(Section):
    allow_config_change: bool = False
    """Continue a stage whose identity changed (config, inputs or data); the changed keys become
    MLflow tags. Off: a changed finished stage is an error."""


class StagePolicy(Section):
    """How Prefect runs a stage: retries (each resumes from the last checkpoint) and the watchdog."""

    retries: int | None = Field(None, ge=0)
    """Prefect retries of this stage; None: stage.retries."""
    retry_delay_s: float | None = Field(None, ge=0)
    """Seconds between its retries; None: stage.retry_delay_s."""
    hang_timeout_s: float | None = Field(None, gt=0)
    """No step finished for this long (s): stacks dumped, stage failed; None: stage.hang_timeout_s."""


class StageConfig(Section):
    retries: int = Field(0, ge=0)
    """Prefect retries of a failed stage; each resumes from its last checkpoint."""
    retry_delay_s: float = Field(10.0, ge=0)
    """Seconds between a stage's retries."""
    hang_timeout_s: float | None = Field(3600.0, gt=0)
    """Watchdog of the training stages (sft, rm, rl, dpo): no step finished for this long (s), stacks
    dumped and the stage fails; None: no watchdog."""
    sft: StagePolicy = Field(default_factory=StagePolicy)
    """Overrides for the sft stage, e.g. stage.sft.retries=3; unset keys inherit stage.*."""
    label: StagePolicy = Field(default_factory=StagePolicy)
    """Overrides for the label stage; unset keys inherit stage.*."""
    rm: StagePolicy = Field(default_factory=StagePolicy)
    """Overrides for the reward-model stage; unset keys inherit stage.*."""
    rl: StagePolicy = Field(default_factory=StagePolicy)
    """Overrides for the RL stage (every algorithm but dpo); unset keys inherit stage.*."""
    dpo: StagePolicy = Field(default_factory=StagePolicy)
    """Overrides for the dpo stage; unset keys inherit stage.*."""
    eval: StagePolicy = Field(default_factory=StagePolicy)
    """Overrides for the eval stage; unset keys inherit stage.*."""

    def policy(self, stage: str) -> StagePolicy:
        """The effective retries, retry delay and hang timeout of one stage."""
        override: StagePolicy = getattr(self, stage)
        pick = lambda name: getattr(self, name) if getattr(override, name) is None else getattr(override, name)
        return StagePolicy(**{name: pick(name) for name in StagePolicy.model_fields})


class SafetyConfig(Section):
    """Guards while training."""

    max_nonfinite_skips: int = Field(3, ge=0)
    """Consecutive skipped non-finite updates before the stage stops."""
    pause_timeout_s: float = Field(86400.0, gt=0)
    """How long a paused run (KL breach, reward failure) waits for an operator before it fails (s)."""


class AlertsConfig(Section):
    webhook_url: str | None = None
    """JSON POST on a KL breach or reward failure (the URL may hold a token); None: no alerts."""
    headers: dict[str, str] = Field(default_factory=dict)
    """HTTP headers of the POST, e.g. Authorization."""
    timeout_s: float = Field(10.0, gt=0)
    """Timeout of the POST in seconds (a failed alert only warns)."""


class TrackingConfig(Section):
    uri: str | None = None
    """MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else sqlite:///{root}/mlflow.db."""
    experiment: str = "rlflow"
    """MLflow experiment name."""


class EngineConfig(Section):
    """How every stage trains: one process (torch) or a DeepSpeed ZeRO job, and how batches are cut."""

    backend: Literal["torch", "deepspeed"] = "torch"
    """torch: one process; deepspeed: a DeepSpeed ZeRO job (needed for more than one process)."""
    zero_stage: Literal[1, 2, 3] = 2
    """ZeRO stage; deepspeed only."""
    offload_optimizer: bool = False
    """ZeRO optimizer state in CPU memory."""
    offload_params: bool = False
    """ZeRO-3 parameters in CPU memory (needs zero_stage 3)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """DeepSpeed's training precision; auto: bf16 on GPU, fp32 on CPU (the torch backend trains in model.dtype)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Rows per forward pass per rank; None: all at once."""
    max_tokens_per_microbatch: int | None = Field(None, ge=8)
    """Padding-free dynamic batching: micro-batches hold at most this many real tokens per rank."""
    packing: bool = False
    """SFT and reward model: concatenate a micro-batch's sequences into one row (no padding at all)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (less memory, more compute)."""
    offload_frozen_models: bool = False
    """Reference and reward models wait in CPU memory between phases (on a GPU)."""

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"engine.offload_params needs engine.zero_stage=3 (got {self.zero_stage})")
        return self


class ResourcesConfig(Section):
    """Where a stage runs: processes per node and nodes (deepspeed backend only above one process)."""

    nproc_per_node: int = Field(1, ge=1, le=64)
    """Processes (ranks) per node of a training stage's job."""
    nnodes: int = Field(1, ge=1, le=1024)
    """Nodes of a training stage's job."""
    node_rank: int = Field(0, ge=0)
    """This machine's rank when each node runs its own launcher (torchrun)."""
    hostfile: str | None = None
    """DeepSpeed/MPI style "host slots=N" lines (launcher deepspeed only)."""
    master_addr: str = "127.0.0.1"
    """Address of node 0, where the job's ranks meet."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """Port of node 0 where the ranks meet; None: a free port (multi-node torchrun needs one set)."""
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    """torchrun: one launcher per node (node_rank tells them apart); deepspeed: DeepSpeed's runner on node 0
    starts the hosts of the hostfile over pdsh/ssh (see infra/multinode.md)."""
    gpu_type: str | None = None
    """The accelerator type, a device name of configs/prices.yaml (e.g. a100-80g); read only by
    `rlflow estimate` (None: this machine's CPU). Not part of any stage's identity."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class RolloutConfig(Section):
    """Where responses are sampled, and how the sampler's weights are kept in step with training."""

    mode: Literal["colocated", "server"] = "colocated"
    """colocated: the trainer samples with its own policy; server: rollout replicas (HTTP servers of their
    own) sample and get the actor's weights after every step."""
    server_backend: Literal["hf", "vllm"] = "hf"
    """The replicas of mode server: rlflow's transformers replica (hf: one, sampling bit for bit what
    colocated generation would) or vLLM's server (vllm). Both speak the same routes (docs/replicas.md)."""
    generate_batch: int = Field(32, ge=1)
    """Sequences sampled together under one seed (world-size independent)."""
    n: int = Field(1, ge=1, le=1024)
    """Samples per prompt (a group: GRPO and RLOO need n >= 2)."""
    bucket_mb: Annotated[float, neutral(TRANSPORT)] = Field(256.0, gt=0)
    """Weight-sync bucket size (MB): a sync costs one round trip per bucket."""
    check_fingerprint: Annotated[bool, neutral(SYNC_GUARD)] = True
    """Compare the sha256 fingerprints of the trainer's and the replica's weights after every sync; a
    mismatch stops the run."""
    off_policy_steps: int = Field(0, ge=0, le=64)
    """k: the replica samples the batch of step t+k while the trainer trains step t (mode server only);
    batch t is sampled by the actor after max(0, t-1-k) steps, whatever the machine's speed, so runs
    stay reproducible and resume exactly. 0: synchronous, each batch sampled by the current actor."""
    async_: bool = Field(False, alias="async")
    """Fully asynchronous sampling (mode server only): the replica samples continuously into a buffer
    the trainer takes each step's groups from, and weights go to it without waiting for the samples
    in flight. Unlike off_policy_steps, timing decides which version samples what, so a resumed run
    continues rather than repeats (docs/replicas.md)."""
    max_staleness: int = Field(1, ge=0, le=64)
    """With async: the most versions a trained sample may lag the trainer's policy; the replica starts
    no sample that could exceed it, and one that would (after a resume with a lower bound) is dropped
    and counted in rollout/dropped_stale."""
    partial_rollouts: bool = False
    """With async: a weight update reaches generations in flight at the next token; they go on with
    the new weights, each token keeping the version and log-prob that sampled it. A row's staleness
    is its oldest token's."""
    threads: Annotated[int | None, neutral("a thread count (it may change a continued run's last digits)")] = Field(
        None, ge=1
    )
    """CPU threads of each replica: hf, its torch threads (None: the trainer's count, so both compute
    alike); vllm, cores of its own, which the trainer leaves to it (None: vLLM's choice)."""
    probe_rows: Annotated[int, neutral(SYNC_GUARD)] = Field(4, ge=1)
    """Rows the replica samples, and the trainer rescores, right after each weight sync when
    off_policy_steps > 0 or async (the guard compares both under the same version). At 0 the log-probs of
    every sampled row are compared instead, as PPO's old log-probs."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the replica samples in (mode server). bfloat16 halves a sync's bytes and, on a GPU,
    speeds sampling, but its log-probs differ from an fp32 trainer's: correct the gap with
    algorithm.rollout_correction (docs/vllm.md has the measured table)."""
    max_logprob_diff: Annotated[float | None, neutral(SYNC_GUARD)] = Field(None, gt=0)
    """Largest |trainer - replica| log-prob difference of a sampled token after a sync, in nats; above
    it the run stops. None: the measured stop of the sampler (server_backend, dtype), LOGPROB_DIFF_STOPS."""
    vllm_python: Annotated[str, neutral(TRANSPORT)] = ".venv-vllm/bin/python"
    """Interpreter of the separate vLLM environment."""
    replicas: Annotated[int, neutral(SPREAD)] = Field(1, ge=1, le=64)
    """vLLM replicas rlflow starts for the stage (server_backend vllm, no endpoints): each row samples with
    its own seed on one of them; a replica that dies is dropped and its rows go to the others."""
    endpoints: Annotated[list[str], neutral(SPREAD)] = Field(default_factory=list)
    """URLs of vLLM replicas someone else runs (an external fleet): rlflow starts none, checks each is
    reachable before the stage trains, and sends them weights over gloo (rollout.trainer_address). Their
    API key comes from the environment variable RLFLOW_REPLICA_API_KEY, never from the config."""
    transport: Annotated[Literal["auto", "shm", "gloo", "fsspec"], neutral(TRANSPORT)] = "auto"
    """How weights reach the replicas. auto: shm (shared memory) for the replicas rlflow starts, gloo
    for rollout.endpoints; fsspec: safetensors files in rollout.weights_url, for replicas that share
    storage with the trainer but no network group."""
    weights_url: Annotated[str | None, neutral(TRANSPORT)] = None
    """transport fsspec: a folder the trainer and every replica reach (a shared disk, s3://bucket/path);
    each side reads its credentials from its own environment, never from the config."""
    trainer_address: Annotated[str, neutral(TRANSPORT)] = "127.0.0.1"
    """The address external replicas reach the trainer at: its gloo TCPStore, for weights."""
    startup_timeout_s: Annotated[float, neutral("a time limit of the replica's start")] = Field(300.0, gt=0)
    """How long the rollout replicas may take to become ready, in seconds."""
    response_timeout_s: Annotated[float, neutral("a time limit of the replica's replies")] = Field(1800.0, gt=0)
    """Longest wait for one answer of a replica (a row's samples, a weight bucket), in seconds; a request
    unanswered that long stops the run (or drops the replica from a fleet) with an error naming it."""

    @model_validator(mode="after")
    def _check_replicas(self) -> RolloutConfig:
        if (self.endpoints or self.replicas > 1) and (self.mode, self.server_backend) != ("server", "vllm"):
            key = "rollout.endpoints" if self.endpoints else f"rollout.replicas={self.replicas}"
            raise ValueError(
                f"{key} names vLLM replicas: it needs rollout.mode=server and rollout.server_backend=vllm"
                f" (got {self.mode}, {self.server_backend})"
            )
        if self.endpoints and self.replicas > 1:
            raise ValueError(
                f"rollout.endpoints ({len(self.endpoints)}) is a fleet someone else runs and rollout.replicas="
                f"{self.replicas} one rlflow starts: keep one"
            )
        from rlflow.engine.config.secrets import redact_url

        self._check_transport()
        for url in self.endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"rollout.endpoints: {redact_url(url)!r} is not an http(s) URL (e.g. http://10.0.0.7:8000)")
            if redact_url(url) != url:
                raise ValueError(
                    f"rollout.endpoints: {redact_url(url)!r} carries credentials; the config is logged: put the"
                    " replicas' key in the environment variable RLFLOW_REPLICA_API_KEY instead"
                )
        return self

    def _check_transport(self) -> None:
        from rlflow.engine.config.secrets import redact_url

        if self.transport != "auto" and self.mode != "server":
            raise ValueError(
                f"rollout.transport={self.transport} moves weights to rollout replicas: it needs rollout.mode=server"
                f" (got {self.mode}); or leave it auto"
            )
        if self.transport == "shm" and self.endpoints:
            raise ValueError(
                "rollout.transport=shm maps the trainer's memory: it serves only the replicas rlflow starts on this"
                " host, not rollout.endpoints; use gloo or fsspec (or auto)"
            )
        if self.transport == "fsspec" and not self.weights_url:
            raise ValueError(
                "rollout.transport=fsspec writes the weights into a folder the replicas read: set rollout.weights_url"
                " (a shared disk or s3://bucket/path)"
            )
        if self.weights_url and redact_url(self.weights_url) != self.weights_url:
            raise ValueError(
                f"rollout.weights_url: {redact_url(self.weights_url)!r} carries credentials; the config is logged:"
                " give each side its storage credentials in its environment instead"
            )

    @model_validator(mode="after")
    def _check_async(self) -> RolloutConfig:
        if self.async_ and self.mode != "server":
            raise ValueError(
                "rollout.async=true samples in a rollout replica while the trainer trains: it needs"
                " rollout.mode=server (got colocated); set rollout.mode=server or rollout.async=false"
            )
        if self.async_ and self.off_policy_steps:
            raise ValueError(
                f"rollout.async=true and rollout.off_policy_steps={self.off_policy_steps} are two schedules of the"
                " replicas: keep one (rollout.off_policy_steps=0 with async; rollout.max_staleness bounds the lag)"
            )
        if self.partial_rollouts and not self.async_:
            raise ValueError(
                "rollout.partial_rollouts=true continues generations across weight updates, which only"
                " rollout.async=true sends mid-generation; set rollout.async=true or rollout.partial_rollouts=false"
            )
        return self

    @property
    def logprob_diff_stop(self) -> float:
        """rollout.max_logprob_diff, or the measured stop of this sampler and dtype."""
        if self.max_logprob_diff is not None:
            return self.max_logprob_diff
        return LOGPROB_DIFF_STOPS[(self.server_backend, self.dtype)]

    @property
    def samples_ahead(self) -> bool:
        """Whether the replica samples ahead of training (a checkpoint keeps what it sampled)."""
        return self.async_ or self.off_policy_steps > 0

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained row may lag the trainer's policy."""
        return self.max_staleness if self.async_ else self.off_policy_steps


class PlacementConfig(Section):
    """GPU indices per role; None everywhere: all roles colocated on all visible GPUs."""

    train: list[int] | None = None
    """GPUs of the training ranks, as indices into the visible GPUs (after CUDA_VISIBLE_DEVICES
    renumbering); None: every visible GPU."""
    rollout: list[int] | None = None
    """GPUs of the rollout replicas (rollout.mode=server), as indices into the visible GPUs; None: every
    visible GPU."""
