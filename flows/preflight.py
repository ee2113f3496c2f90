"""Checks of a run's inputs before any server or model starts: a typo costs a second, not a
server start. Each raises an RlflowError naming the key and value."""

from __future__ import annotations

import json
import os
from typing import Any


def check_backend(config: Any) -> None:
    """The packages and launch settings the configured execution paths need."""
    import importlib.util

    from rlflow.engine.errors import ConfigError

    if config.engine.backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                "engine.backend=deepspeed needs the deepspeed package: pip install 'rlflow[deepspeed]'"
                " (or set engine.backend=torch)"
            )
        from rlflow.engine.backend.launch import check_resources

        check_resources(config.resources)
    if config.rollout.endpoints:
        check_endpoints(config.rollout.endpoints, config.model.path)
    elif config.rollout.mode == "server" and config.rollout.server_backend == "vllm":
        if not os.path.isfile(config.rollout.vllm_python):
            raise ConfigError(
                f"rollout.server_backend=vllm runs in its own environment, but rollout.vllm_python="
                f"{config.rollout.vllm_python!r} does not exist: build it with `make vllm-env` (GPU machines)"
            )


def check_endpoints(urls: list[str], model_path: str | None = None, timeout_s: float = 10.0) -> None:
    """An external fleet (rollout.endpoints): the key is in the environment, every replica answers
    with it, and serves a model the policy's weights fit (model.path's architecture and shapes, where
    model.path is a local HF directory), before anything trains."""
    import requests

    from rlflow.engine.config.secrets import redact_url
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.rollout.replica_auth import REPLICA_KEY_ENV, auth_header
    from rlflow.engine.rollout.replica_model import SIGNATURE_PATH, model_signature, signature_mismatch

    config_file = os.path.join(model_path, "config.json") if model_path else ""
    expected = None
    if os.path.isfile(config_file):
        with open(config_file) as f:
            expected = model_signature(json.load(f))

    key = os.environ.get(REPLICA_KEY_ENV, "")
    if not key:
        raise ConfigError(f"rollout.endpoints needs the replicas' API key: set {REPLICA_KEY_ENV} in the environment")
    for url in urls:
        where = f"rollout.endpoints: {redact_url(url)}"
        try:
            answer = requests.get(url.rstrip("/") + "/weight_info", headers=auth_header(key), timeout=timeout_s)
        except requests.RequestException as exc:
            raise ConfigError(f"{where} is unreachable ({type(exc).__name__}); is the replica up?") from None
        if answer.status_code == 401:
            raise ConfigError(f"{where} refused the key in {REPLICA_KEY_ENV} (401)")
        if answer.status_code != 200:
            raise ConfigError(f"{where} is no vLLM replica with RL routes: /weight_info answered {answer.status_code}")
        if expected is None:
            continue
        answer = requests.get(url.rstrip("/") + SIGNATURE_PATH, headers=auth_header(key), timeout=timeout_s)
        if answer.status_code != 200:
            raise ConfigError(
                f"{where} does not say which model it serves ({SIGNATURE_PATH} answered {answer.status_code}):"
                " start it with --middleware rlflow.engine.rollout.replica_model.ServedModel (docs/vllm.md)"
            )
        wrong = signature_mismatch(answer.json(), expected)
        if wrong:
            raise ConfigError(
                f"{where} serves another model than model.path={model_path} ({'; '.join(wrong)}): the policy's"
                " weights would not fit it; point rollout.endpoints at replicas of that model"
            )


def check_devices(config: Any) -> None:
    """GPU placement, and one device per rank of this node (see placement.validate_process_count)."""
    from rlflow.engine.backend.placement import (
        usable_cpu_count,
        validate_placement,
        validate_process_count,
        visible_gpu_count,
    )

    gpus, cvd = visible_gpu_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    validate_placement(config.placement, config.rollout.mode, gpus, cvd)
    validate_process_count(config.resources.nproc_per_node, config.placement.train, gpus, usable_cpu_count(), cvd)


def _for_key(key: str, fn: Any, *args: Any) -> Any:
    """fn(*args), a DataError's message led by the config key that named the file."""
    from rlflow.engine.errors import DataError

    try:
        return fn(*args)
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None


def check_model(config: Any) -> None:
    """The starting model exists, can be trained and saved, and holds a prompt plus a response: a
    stage that would train for minutes and then fail to write its result is refused now."""
    import json

    from rlflow.engine.errors import ConfigError
    from rlflow.engine.models.importing import quantization_problem
    from rlflow.engine.models.loading import load_model_config, resolve_model_path

    path = resolve_model_path(config.model.init_path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        if ggufs:
            raise ConfigError(
                f"model.path {path!r} holds GGUF file(s) ({', '.join(ggufs)}) but no config.json: set"
                f" model.gguf_file={ggufs[0]} (dequantised at every load), or convert once with `rlflow import-model"
                f" {os.path.join(path, ggufs[0])} DEST` and set model.path=DEST"
            )
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            problem = quantization_problem(json.load(f))
        if problem:
            raise ConfigError(
                f"model.path {path!r}: {problem}; convert the original GGUF once with `rlflow import-model SRC DEST`"
                " (a clean safetensors directory) and set model.path=DEST"
            )
    hf_config = load_model_config(path, config.model.trust_remote_code)
    context = getattr(hf_config, "max_position_embeddings", None)
    wanted = config.data.max_prompt_tokens + config.sampling.max_new_tokens
    if context is not None and wanted > context:
        raise ConfigError(
            f"data.max_prompt_tokens={config.data.max_prompt_tokens} + sampling.max_new_tokens={config.sampling.max_new_tokens}"
            f" = {wanted} tokens is more than the model's context of {context} (max_position_embeddings of"
            f" {path!r}); lower one of them"
        )


def check_tokenizer(config: Any, prompt_sets: dict[str, list[Any]]) -> None:
    """data.chat_template=auto needs a template; with data.prompt_overflow=drop, a prompt set left
    empty would fail the label or PPO stage after SFT and the reward model have trained:
    tokenizing the prompts now takes a second (with an env, as each episode's first messages)."""
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.data.prompts import encode_prompt_set
    from rlflow.engine.models.loading import load_tokenizer

    template = config.data.chat_template
    tokenizer = load_tokenizer(config.model.init_path, config.model.trust_remote_code, chat_template=template)
    if template == "auto" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"data.chat_template=auto, but the tokenizer of model.path {config.model.path!r} has no chat template;"
            " set data.chat_template=none to use prompts as written (a base model), or add a chat_template to its"
            " tokenizer_config.json"
        )
    if config.data.prompt_overflow != "drop":
        return
    episodes = None  # with an env, a prompt is an episode's first messages (tool instructions included)
    if config.env is not None:
        from rlflow.engine.rollout.episodes import EpisodeSampler

        episodes = EpisodeSampler(config.env, tokenizer, None, config.data.max_prompt_tokens)
    for key, records in prompt_sets.items():
        url = getattr(config.data, key)
        limit = config.data.max_prompt_tokens
        _for_key(f"data.{key}", encode_prompt_set, tokenizer, records, limit, "drop", url, episodes)


def check_reward_model_vocabulary(config: Any) -> None:
    """rm.init given as a model: PPO feeds it the policy's token ids, so it must share the policy's
    tokenizer. A remote committed step is not downloaded for this check."""
    init = config.rm.init
    if init == "sft" or "://" in init:
        return
    from rlflow.engine.storage.checkpoint import model_location
    from rlflow.engine.models.loading import check_shared_vocabulary, resolve_model_path

    path = resolve_model_path(model_location(init, {}), "rm.init")
    check_shared_vocabulary(config.model.init_path, path, config.model.trust_remote_code)


def check_run_root(config: Any) -> None:
    """Fails now (one line, exit 2) if run.root cannot be written (a missing bucket, refused
    credentials) or another live process holds the run; the flow takes the lock for real."""
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.storage.lock import RunLock
    from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error

    url, options = f"{config.run.root.rstrip('/')}/{config.run.name}", config.run.storage_options
    try:
        RunLock(url, options).acquire().release()
    except STORAGE_ERRORS as exc:
        reason = describe_storage_error(url, exc, options, "run.storage_options")
        raise ConfigError(f"run.root {config.run.root!r} cannot be written: {reason}") from None


def probe_write(url: str, options: dict[str, Any]) -> None:
    """Write and delete a probe file under `url`; raises what the store raises. A local folder
    is made (a run would make it); a missing bucket stays an error."""
    import uuid

    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **options)
    probe = f"{path.rstrip('/')}/.rlflow-probe-{uuid.uuid4().hex}"
    if "file" in fs.protocol:
        fs.makedirs(path, exist_ok=True)
    fs.pipe_file(probe, b"probe")
    fs.rm(probe)


def check_mirror(config: Any) -> None:
    """checkpoint.mirror must take a write now: a mirror misconfigured from the start would look
    like an endless outage, and the primary would keep every step for it."""
    if not config.checkpoint.mirror:
        return
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error

    url, options = f"{config.checkpoint.mirror.rstrip('/')}/{config.run.name}", config.checkpoint.mirror_storage_options
    try:
        probe_write(url, options)
    except STORAGE_ERRORS as exc:
        reason = describe_storage_error(url, exc, options, "checkpoint.mirror_storage_options")
        raise ConfigError(f"checkpoint.mirror {config.checkpoint.mirror!r} cannot be written: {reason}") from None


def check_weights_url(config: Any) -> None:
    """rollout.transport=fsspec: the trainer must be able to write the weights where the replicas read
    them (with its environment's credentials: the URL carries none)."""
    if config.rollout.transport != "fsspec":
        return
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error

    url = config.rollout.weights_url
    try:
        probe_write(url, {})
    except STORAGE_ERRORS as exc:
        reason = describe_storage_error(url, exc, {}, "the environment's storage credentials")
        raise ConfigError(f"rollout.weights_url {url!r} cannot be written: {reason}") from None


def check_reward_sources(config: Any) -> None:
    """Every rule's arguments and every function's import, before SFT spends its minutes; a
    reward model given by path must exist."""
    from rlflow.engine.models.loading import resolve_model_path
    from rlflow.engine.rewards.rules import make_rule
    from rlflow.engine.rewards.user_functions import load_function

    for source in config.reward.sources:
        if source.type == "function":
            load_function(source.fn, f"reward.sources[{source.name}].fn")
        elif source.type == "model" and source.path is not None:
            resolve_model_path(source.path, f"reward.sources[{source.name}].path")
        elif source.type != "model":
            make_rule(source.type, source.kwargs, source.name)


def check_lora(config: Any) -> None:
    """model.lora's module names against the policy's architecture (built on the meta device: no
    weights are read), before SFT spends its minutes; a reward model or critic shares the backbone."""
    if config.model.lora is None:
        return
    import torch
    from rlflow.engine.models.lora import lora_modules
    from rlflow.engine.models.loading import load_model_config
    from transformers import AutoModelForCausalLM

    trust = config.model.trust_remote_code
    hf_config = load_model_config(config.model.init_path, trust)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust)
    lora_modules(model, config.model.lora)


def check_preference_sources(config: Any, reward_model: bool) -> None:
    """A reward model or DPO with nothing to train on, or a reward model with no held-out pairs
    to measure it on, is refused before any stage runs."""
    from rlflow.engine.errors import ConfigError

    d, label = config.data, config.label
    every_round = label.online_from_round == 0  # every round's reward model (or DPO) then has fresh pairs
    learner = "the reward model" if reward_model else "DPO"
    if (reward_model or config.algorithm.name == "dpo") and d.preferences is None and not every_round:
        raise ConfigError(
            f"data.preferences is null and label.online_from_round={label.online_from_round}: {learner} of round 0"
            " has no pairs to train on; name a preference file or set label.online_from_round=0"
        )
    if config.algorithm.name == "dpo" and d.preferences_eval is None:
        raise ConfigError("data.preferences_eval is null: DPO measures its held-out accuracy on it; name a file")
    if reward_model and d.preferences_eval is None and not (every_round and label.eval_fraction > 0):
        raise ConfigError(
            "data.preferences_eval is null: the reward model would have no held-out pairs to measure its accuracy"
            " on; name a file, or set label.online_from_round=0 and label.eval_fraction (e.g. 0.2)"
        )


def check_run_format(root: str, run_name: str, storage_options: dict[str, Any]) -> None:
    """A run begun by rlflow 0.1 (stage identities listed by hand, the RL stage named ppo) is refused
    before anything runs: this rlflow cannot tell whether its stages would compute the same. A store
    that cannot be read is left to the checks that name what is wrong with it."""
    from fsspec.core import url_to_fs

    from rlflow.engine.errors import ConfigError
    from rlflow.engine.stages.identity import IDENTITY_FORMAT, legacy_message
    from rlflow.engine.storage.checkpoint import CheckpointStore
    from rlflow.engine.storage.errors import STORAGE_ERRORS

    url = f"{root.rstrip('/')}/{run_name}"
    try:
        fs, path = url_to_fs(url, **storage_options)
        for stage in sorted(fs.glob(f"{path}/round_*/*/")):
            store = CheckpointStore(fs.unstrip_protocol(stage) if "://" in url else stage, storage_options)
            final = store.final()
            newest = None if final is not None else store.latest()
            meta = final if final is not None else (store.manifest(newest)["meta"] if newest is not None else {})
            tree = meta.get("identity_tree")
            if stage.rstrip("/").endswith("/ppo") or (tree is not None and tree.get("format") != IDENTITY_FORMAT):
                raise ConfigError(legacy_message(f"run '{run_name}' ({url})"))
    except STORAGE_ERRORS:
        return


def check_inputs(config: Any, writes: bool = True) -> None:
    """Fail fast on inputs the planned stages need: devices, model paths, data files (parsed in
    full; SFT and preference files only where a stage reads them), functions, the run's format,
    and where checkpoints go (`writes`: a probe write of run.root and the mirror; a dry run writes
    nothing)."""
    from rlflow.engine.data.records import load_preference_pairs, load_prompts, load_sft_examples
    from rlflow.engine.rewards.user_functions import load_function

    check_run_format(config.run.root, config.run.name, config.run.storage_options)  # before what a stage would read
    check_devices(config)
    check_backend(config)
    check_model(config)
    d = config.data
    loaders = {"prompts": load_prompts, "eval_prompts": load_prompts}
    reward_model = config.reward.learned and config.algorithm.name != "dpo"
    if reward_model or config.algorithm.name == "dpo":
        loaders |= {"preferences": load_preference_pairs, "preferences_eval": load_preference_pairs}
    if reward_model:  # its score normalisation set comes from data.sft
        loaders |= {"sft": load_sft_examples}
    if any(r < config.run.rounds for r in config.sft.rounds):
        loaders |= {"sft": load_sft_examples, "sft_eval": load_sft_examples}
    loaders = {key: fn for key, fn in loaders.items() if getattr(d, key) is not None}
    loaded = {key: _for_key(f"data.{key}", fn, getattr(d, key), d.storage_options) for key, fn in loaders.items()}
    check_preference_sources(config, reward_model)
    check_tokenizer(config, {key: loaded[key] for key in ("prompts", "eval_prompts")})
    check_reward_model_vocabulary(config)
    load_function(config.gold.fn, "gold.fn")
    load_function(config.label.labeller.fn, "label.labeller.fn")
    if config.reward.fallback_rule is not None:
        load_function(config.reward.fallback_rule.fn, "reward.fallback_rule.fn")
    for ref in config.callbacks:
        load_function(ref, "callbacks")
    check_reward_sources(config)
    check_lora(config)
    if writes:
        check_run_root(config)
        check_mirror(config)
        check_weights_url(config)
