"""Loading models and the forward passes every stage shares (log-probs, values, scores).

A tiny demo model and a 70B model go through exactly the same code: HF directories loaded with
`from_pretrained`, safetensors only, `trust_remote_code` off unless the config turns it on.
"""

from __future__ import annotations

import os
import tempfile
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlflow.engine.errors import ConfigError
from rlflow.engine.models.gguf import check_gguf_file, strip_quantizer
from rlflow.engine.models.identity import HUB_ID, SCALAR_HEAD_NAMES
from rlflow.engine.models.lm_head import next_token_logprobs

try:  # progress bars per checkpoint drown the per-step progress lines
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
    _hf_logging.set_verbosity_error()  # load reports for heads we initialise on purpose
except ImportError:  # pragma: no cover
    pass
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """A local directory or GGUF file as is; a hub id ("org/name") passed through; anything else
    is an error."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        if path.endswith(".gguf"):
            check_gguf_file(path, key)
            return path
        raise ConfigError(f"{key} {path!r} is a file; point it at a Hugging Face model directory")
    if HUB_ID.match(path) and not path.startswith((".", "/")):
        return path
    raise ConfigError(
        f"{key} {path!r} does not exist; give a local HF model directory or a hub id like Qwen/Qwen2-0.5B-Instruct"
    )


def _from_pretrained(cls: Any, path: str, key: str, **kwargs: Any) -> Any:
    """cls.from_pretrained of a directory, a hub id or a GGUF file (dequantised on load)."""
    path = resolve_model_path(path, key)
    if os.path.isfile(path):  # a GGUF file: transformers takes its folder and name apart
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
        kwargs.pop("use_safetensors", None)
    try:
        return cls.from_pretrained(path, **kwargs)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # A missing local folder that looks like "org/name" was tried as a hub id: say so, or the hub's
        # "couldn't connect" reads as if the folder were there.
        read_as = "" if os.path.exists(path) else f" (there is no local folder {path!r}, so it was read as a hub id)"
        raise ConfigError(f"{key} {path!r} could not be loaded{read_as}: {first}") from None


def load_model_config(path: str, trust_remote_code: bool = False, key: str = "model.path") -> Any:
    """The transformers config of a directory, a hub id or a GGUF file (read, no weights)."""
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig, path, key, trust_remote_code=trust_remote_code)


def load_tokenizer(path: str, trust_remote_code: bool = False, key: str = "model.path", chat_template: str = "auto"):
    """Tokenizer with left padding (batched generation), its stop ids and a pad token that is not
    one of them (engine/models/tokens.py: EOS only when no other special token exists). chat_template
    (data.chat_template): "none" drops the tokenizer's template, so prompts are used as written;
    "auto" keeps it (the pre-flight refuses "auto" for a tokenizer without one)."""
    from transformers import AutoTokenizer

    from rlflow.engine.models.tokens import configure_token_roles

    tokenizer = _from_pretrained(AutoTokenizer, path, key, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"{key} {path!r}: the tokenizer has no EOS token; every response ends with EOS (or the chat"
            " template's end of turn), so set eos_token in its tokenizer_config.json"
        )
    configure_token_roles(tokenizer, path if os.path.isdir(path) else None)
    if chat_template == "none":
        tokenizer.chat_template = None
    tokenizer.padding_side = "left"
    return tokenizer


def check_shared_vocabulary(policy_path: str, rm_path: str, trust_remote_code: bool = False) -> None:
    """ConfigError unless a reward model loaded from `rm_path` (rm.init) reads the policy's token ids.

    PPO hands the reward model (and a critic made from it) the policy's sampled ids: with another
    tokenizer those are out of range (an index error mid-PPO) or mean other words (scores of noise).
    """
    from transformers import AutoConfig

    policy = load_tokenizer(policy_path, trust_remote_code, "model.path").get_vocab()
    reward = load_tokenizer(rm_path, trust_remote_code, "rm.init").get_vocab()
    fix = f"set rm.init=sft or give a reward model fine-tuned from the model at {policy_path!r}"
    where = f"rm.init {rm_path!r} and model.path {policy_path!r}"
    if len(policy) != len(reward):
        raise ConfigError(
            f"{where} have different vocabularies ({len(reward)} vs {len(policy)} tokens): the reward model"
            f" scores the policy's token ids, so it must share its tokenizer; {fix}"
        )
    differing = sorted(t for t in policy if reward.get(t) != policy[t])
    if differing:
        token = differing[0]
        raise ConfigError(
            f"{where} both have {len(policy)} tokens but number them differently (e.g. {token!r}: id"
            f" {reward.get(token)} vs {policy[token]}): the reward model scores the policy's token ids; {fix}"
        )
    # Embedding rows can exceed the tokenizer (padded vocabularies): the policy may sample any row.
    remote = {"trust_remote_code": trust_remote_code}
    reward_rows = _from_pretrained(AutoConfig, rm_path, "rm.init", **remote).vocab_size
    policy_rows = _from_pretrained(AutoConfig, policy_path, "model.path", **remote).vocab_size
    if reward_rows < policy_rows:
        raise ConfigError(
            f"{where}: the reward model has embeddings for {reward_rows} token ids but the policy can sample"
            f" {policy_rows}; {fix}"
        )


def disable_dropout(model: nn.Module) -> nn.Module:
    """PPO's ratio must be 1 on the first mini-batch: no dropout anywhere, even in train mode."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # Llama/Qwen2/Mistral attention applies a plain float rate in train mode.
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    if isinstance(getattr(model.config, "attention_dropout", None), float):
        model.config.attention_dropout = 0.0
    return model


def model_kwargs(cfg: Any) -> dict[str, Any]:
    """load_policy / load_scalar_model keyword arguments from a ModelConfig."""
    return {
        "dtype": cfg.dtype,
        "trust_remote_code": cfg.trust_remote_code,
        "attn_implementation": cfg.attn_implementation,
    }


def resolve_attn_implementation(requested: str) -> str:
    """flash_attention_2 needs the optional flash-attn package and a GPU; without them, sdpa
    (which uses flash kernels on GPU anyway) with a warning instead of a failure at load."""
    if requested != "flash_attention_2":
        return requested
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available():
        why = "the flash-attn package is not installed" if torch.cuda.is_available() else "no GPU is visible"
        warnings.warn(
            f"model.attn_implementation=flash_attention_2 but {why}; using sdpa "
            "(install the 'flash-attn' extra on a CUDA machine to use it)",
            stacklevel=2,
        )
        return "sdpa"
    return requested


def load_policy(
    path: str,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    key: str = "model.path",
    attn_implementation: str = "sdpa",
):
    """A causal LM from an HF directory, a hub id, or a LoRA directory (engine/models/lora.py: its base
    with every adapter merged in, a plain HF model all the same)."""
    from transformers import AutoModelForCausalLM

    from rlflow.engine.models.lora import is_lora_dir, load_lora_dir

    if is_lora_dir(path):
        load_base = lambda base: load_policy(base, dtype, trust_remote_code, key, attn_implementation)  # noqa: E731
        return load_lora_dir(path, load_base, key)
    model = _from_pretrained(
        AutoModelForCausalLM,
        path,
        key,
        dtype=DTYPES[dtype],
        trust_remote_code=trust_remote_code,
        attn_implementation=resolve_attn_implementation(attn_implementation),
        use_safetensors=True,  # a pickled .bin checkpoint is never loaded
    )
    return disable_dropout(strip_quantizer(model))


SCORE_HEADS = "rlflow_score_heads"  # the HF config's record of an ensemble's number of score heads


def load_scalar_model(
    path: str,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    key: str = "rm.init",
    attn_implementation: str = "sdpa",
    heads: int | None = None,
):
    """An `AutoModelForSequenceClassification` (reward model or critic) whose forward returns
    per-token values: [B, T] with one score head, [B, T, H] with an ensemble of H heads.

    heads: None, as saved (one head for a causal-LM directory); H > 1 on a causal LM, a fresh
    ensemble (rm.ensemble); 1 on a trained ensemble, its heads averaged into one (a critic started
    from an ensemble reward model). Loading a causal-LM directory gives a freshly initialised head:
    one head is zeroed so a new critic or reward model starts at 0 instead of random noise; an
    ensemble's heads are drawn N(0, 1/hidden) each, so that they disagree wherever the training
    pairs do not pull them together. A trained head is kept as it is. A LoRA directory
    (engine/models/lora.py) loads as its base with every adapter (and a trained head) merged in.
    """
    from transformers import AutoModelForSequenceClassification

    from rlflow.engine.models.lora import is_lora_dir, load_lora_dir

    config = load_model_config(path, trust_remote_code, key)
    saved = int(getattr(config, SCORE_HEADS, 1))
    build = saved if saved > 1 or heads is None else heads
    if heads is not None and heads != saved and 1 not in (heads, saved):
        raise ConfigError(f"{key} {path!r} holds an ensemble of {saved} score heads, not {heads}")
    if is_lora_dir(path):
        load_base = lambda base: load_scalar_model(  # noqa: E731
            base, dtype, trust_remote_code, key, attn_implementation, heads=build
        )
        model = load_lora_dir(path, load_base, key)
    else:
        config.num_labels = build
        if build > 1:
            setattr(config, SCORE_HEADS, build)
        model = _load_scalar_dir(
            AutoModelForSequenceClassification, path, key, config, DTYPES[dtype], trust_remote_code, attn_implementation
        )
    if heads == 1 and build > 1:
        _average_heads(model)
    return model


def _load_scalar_dir(cls, path: str, key: str, config: Any, dtype, trust_remote_code: bool, attn_implementation: str):
    model, info = _from_pretrained(
        cls,
        path,
        key,
        config=config,
        output_loading_info=True,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=resolve_attn_implementation(attn_implementation),
        use_safetensors=True,  # a pickled .bin checkpoint is never loaded
    )
    strip_quantizer(model)
    head = scalar_head(model)
    head_names = {name for name, p in model.named_parameters() if any(p is q for q in head.parameters())}
    if head_names & set(info["missing_keys"]):
        with torch.no_grad():
            for param in head.parameters():
                if config.num_labels == 1:
                    param.zero_()
                else:
                    param.normal_(0.0, head.in_features**-0.5, generator=torch.Generator().manual_seed(0))
    # Its forward returns per-token values: critic and reward model both need them, and a
    # DeepSpeed engine must run every training forward through the module's own forward (it
    # counts micro-steps there; a backbone called from outside would overwrite accumulated grads).
    model.forward = types.MethodType(_per_token_values, model)
    return disable_dropout(model)


def _average_heads(model: nn.Module) -> None:
    """Replace an ensemble's H score heads by one whose output is their mean (linear: exact)."""
    from rlflow.engine.models.lora import scalar_head_name

    name = scalar_head_name(model)
    if name is None:
        raise ConfigError(f"{type(model).__name__} has no linear 'score' head to average")
    head = getattr(model, name)
    mean = nn.Linear(head.in_features, 1, bias=head.bias is not None, dtype=head.weight.dtype)
    with torch.no_grad():
        mean.weight.copy_(head.weight.mean(0, keepdim=True))
        if head.bias is not None:
            mean.bias.copy_(head.bias.mean(0, keepdim=True))
    setattr(model, name, mean.to(head.weight.device))
    model.config.num_labels = 1
    if hasattr(model.config, SCORE_HEADS):
        delattr(model.config, SCORE_HEADS)


def scalar_head(model: nn.Module) -> nn.Linear:
    """The linear head in use: under LoRA (peft's modules_to_save wrapper) its trained copy, or the
    original while the adapters are disabled."""
    for name in SCALAR_HEAD_NAMES:
        head = getattr(model, name, None)
        copies = getattr(head, "modules_to_save", None)
        if copies is not None:
            active = not head.disable_adapters and head.active_adapters
            head = copies[head.active_adapters[0]] if active else head.original_module
        if isinstance(head, nn.Linear):
            return head
    raise ConfigError(f"{type(model).__name__} has no linear 'score' head; use a decoder model (Llama, Qwen2, ...)")


def model_device(model: nn.Module) -> torch.device:
    """Where a model's (possibly partitioned) parameters live: batches are built on the CPU and
    moved there right before the forward pass."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask -> [B, T] positions counting only attended tokens (left padding safe)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the response tokens under `model`.

    input_ids, attention_mask: [B, T] (left-padded prompt of width response_start, then response).
    Returns logprobs [B, T - response_start] (float32, logits divided by the sampling temperature)
    and, if asked, the per-token entropy of the same distribution, else None; on the model's device.
    """
    device = model_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # The LM head runs only where a response token is predicted (the prompt positions' vocabulary
    # projection is wasted work), in chunks (engine/models/lm_head.py: no [B, T, V] logits).
    forward = {"attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask)}
    forward["use_cache"] = False
    return next_token_logprobs(model, input_ids, forward, response_start, temperature, with_entropy)


def _per_token_values(
    self: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor:
    """[B, T] values ([B, T, H] with H score heads) on the model's device; packed rows:
    attention_mask None and position_ids restarting per sequence."""
    device = model_device(self)
    input_ids = input_ids.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    position_ids = position_ids.to(device) if position_ids is not None else None
    backbone = getattr(self, self.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask) if attention_mask is not None else position_ids,
        use_cache=False,
    ).last_hidden_state
    return scalar_head(self)(hidden).squeeze(-1).float()


def token_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token scalar head outputs [B, T] (the critic: GAE needs a value at every token)."""
    return model(input_ids=input_ids, attention_mask=attention_mask)


def head_columns(scores: torch.Tensor) -> torch.Tensor:
    """Scores as [B, H] columns, one per score head: a one-head model's [B] becomes [B, 1]."""
    return scores if scores.dim() == 2 else scores[:, None]


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar head at each row's last attended token [B] (reward model score; [B, H] for an
    ensemble of H heads).

    Located from the attention mask, not the pad id, so an EOS that doubles as pad still counts.
    """
    values = token_values(model, input_ids, attention_mask)
    attention_mask = attention_mask.to(values.device)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.long() * positions).argmax(-1)
    return values[torch.arange(values.shape[0], device=values.device), last.to(values.device)]


def save_model_dir(
    model: nn.Module, tokenizer: Any, writer: Any, prefix: str = "model", state_dict: dict | None = None
) -> None:
    """save_pretrained (safetensors) into a temp dir, then through the checkpoint writer.

    `state_dict` replaces the model's own tensors (the gathered weights of a ZeRO-3 model). A LoRA
    model writes its adapters and a pointer to its base instead of full weights (engine/models/lora.py)."""
    from rlflow.engine.models.lora import is_lora_model, save_lora_dir

    with tempfile.TemporaryDirectory(prefix="rlflow-save-") as tmp:
        if is_lora_model(model):
            save_lora_dir(model, tokenizer, tmp)
        else:
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        writer.put_dir(tmp, prefix=f"{prefix}/")


def model_dir(local_step_dir: str, prefix: str = "model") -> str:
    return str(Path(local_step_dir) / prefix)
