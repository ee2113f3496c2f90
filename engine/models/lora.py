"""LoRA adapters through peft: apply, count, switch off, save, load back and merge.

With `model.lora` set, a stage trains low-rank adapters on the model it starts from (and, for a
reward model or critic, a copy of its scalar head); every other weight stays frozen. The model
it starts from is what the adapters switched off compute, so a PPO reference equal to the
policy's start needs no second copy in memory (`adapters_disabled`).

A LoRA stage's `model/` directory holds no full weights:

    adapter_config.json, adapter_model.safetensors   this stage's adapters (peft's format)
    parents/00/..., parents/01/...                   adapters of earlier stages, merged under it
    rlflow_lora.json                                 {"base": {"path", "fingerprint"}, "adapters": [...]}
    config.json, generation_config.json, tokenizer   as in a full directory

Loading it (models.load_policy / load_scalar_model do so transparently) loads the base model,
checks its fingerprint, and merges every adapter in order. A directory with config.json but no
weights makes a plain `from_pretrained` fail loudly rather than load half a model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from rlflow.engine.config.model import LoraConfig
from rlflow.engine.errors import CheckpointError, ConfigError
from rlflow.engine.models.identity import HUB_ID, SCALAR_HEAD_NAMES, model_fingerprint
from torch import nn

POINTER = "rlflow_lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # peft's adapter name; one adapter per model
FORMAT = "rlflow-lora/1"


@dataclass(frozen=True)
class Lineage:
    """Where a loaded model's weights came from: a base model plus adapters already merged into it."""

    base_path: str
    base_fingerprint: str | None = None  # None: not computed yet (apply_lora computes it)
    adapters: tuple[str, ...] = ()  # local adapter directories merged on load, oldest first


def is_lora_dir(path: str) -> bool:
    """Whether `path` is a LoRA model directory written by save_lora_dir."""
    return os.path.isfile(os.path.join(path, POINTER))


def is_lora_model(model: Any) -> bool:
    """Whether `model` carries peft adapters (apply_lora's or load_lora_dir(merge=False)'s result)."""
    peft = sys.modules.get("peft")  # never imported: no model can be a PeftModel
    return peft is not None and isinstance(model, peft.PeftModel)


def linear_module_names(model: nn.Module) -> list[str]:
    """Short names (e.g. q_proj) of the linear layers of the model's backbone, sorted: what
    model.lora.target_modules may name. The LM and score heads are outside the backbone."""
    from transformers.pytorch_utils import Conv1D

    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    names = {name.rsplit(".", 1)[-1] for name, m in backbone.named_modules() if isinstance(m, (nn.Linear, Conv1D))}
    return sorted(n for n in names if n)


def scalar_head_name(model: nn.Module) -> str | None:
    """The attribute holding a reward model's or critic's linear head; None for a causal LM."""
    return next((n for n in SCALAR_HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None)


def _lineage(model: nn.Module) -> Lineage:
    """A model's lineage: set by load_lora_dir, else the path transformers loaded it from."""
    found = getattr(model, "rlflow_lineage", None)
    return found if isinstance(found, Lineage) else Lineage(base_path=str(getattr(model, "name_or_path", "")))


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap `model` in fresh peft LoRA adapters per `cfg`; only they (and a scalar model's head,
    through peft's modules_to_save) require gradients. Returns the peft model.

    ConfigError when target_modules names a module the backbone has no linear layer for.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if is_lora_model(model):  # stacking would train two adapter sets and save only one
        raise ValueError(f"{type(model).__name__} already has LoRA adapters; merge_into_base it first")
    targets, whole = lora_modules(model, cfg)
    head = scalar_head_name(model)
    lineage = _lineage(model)
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=([head] if head else []) + whole or None,  # a scalar head trains whole; it is small
        ensure_weight_tying=bool(whole) and _ties_embeddings(model),  # the LM head follows its trained embedding
        bias="none",
    )
    with warnings.catch_warnings():  # peft probes a transformers attribute deprecated in v5
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, peft_cfg, adapter_name=ADAPTER)
    fingerprint = lineage.base_fingerprint or _fingerprint(lineage.base_path)
    peft_model.get_base_model().rlflow_lineage = Lineage(lineage.base_path, fingerprint, lineage.adapters)
    return peft_model


def _ties_embeddings(model: nn.Module) -> bool:
    """Whether `model` has an LM head tied to its input embedding (a scalar model has no LM head)."""
    return bool(getattr(model.config, "tie_word_embeddings", False)) and model.get_output_embeddings() is not None


def lora_modules(model: nn.Module, cfg: LoraConfig) -> tuple[list[str], list[str]]:
    """(modules that get adapters, modules trained whole) of `model` under `cfg`, as short names.

    ConfigError when target_modules names no linear layer of the backbone or modules_to_save no
    module with weights. Works on a model built on the meta device (the run's pre-flight check)."""
    available = linear_module_names(model)
    targets = available if cfg.target_modules == "all-linear" else list(dict.fromkeys(cfg.target_modules))
    unknown = [name for name in targets if name not in available]
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(unknown)} is not a linear module of {type(model).__name__};"
            f' its linear modules are: {", ".join(available)} (or use "all-linear")'
        )
    return targets, _modules_to_save(model, cfg.modules_to_save, targets)


def _modules_to_save(model: nn.Module, names: list[str], targets: list[str]) -> list[str]:
    """model.lora.modules_to_save checked against the model: short names of existing modules that
    hold parameters, none of them also a LoRA target. ConfigError otherwise."""
    held = [name for name, m in model.named_modules() if name and next(m.parameters(False), None) is not None]
    # peft matches a name against the end of each module's dotted path: embed_tokens, model.embed_tokens
    unknown = [n for n in names if not any(f == n or f.endswith(f".{n}") for f in held)]
    if unknown:
        short = sorted({f.rsplit(".", 1)[-1] for f in held})
        raise ConfigError(
            f"model.lora.modules_to_save: {', '.join(unknown)} is not a module with weights of {type(model).__name__};"
            f" e.g. {', '.join(short[:8])}"
        )
    both = [n for n in names if n in targets]
    if both:
        raise ConfigError(
            f"model.lora.modules_to_save: {', '.join(both)} is also in model.lora.target_modules; a module either"
            " gets adapters or trains whole: remove it from one of the two"
        )
    return list(dict.fromkeys(names))


def _fingerprint(path: str) -> str:
    return model_fingerprint(path) if path else ""


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared (tied) tensors count once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def lora_metrics(role: str, model: nn.Module) -> dict[str, float]:
    """`lora/<role>/trainable_params` and `lora/<role>/params` (adapters included) of a LoRA model:
    what a stage logs at step 0, so the MLflow run shows how much of the model trained."""
    trainable, total = trainable_parameters(model)
    return {f"lora/{role}/trainable_params": float(trainable), f"lora/{role}/params": float(total)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside, `model` computes what it was loaded as (its adapters, and a scalar head's trained
    copy, switched off): the reference policy without a second copy in memory."""
    if not is_lora_model(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to disable (model.lora is not set)")
    with model.disable_adapter():
        yield model


def save_lora_dir(model: nn.Module, tokenizer: Any, out: str) -> None:
    """Write `model`'s adapters (safetensors), its lineage's earlier adapters, the base pointer,
    the HF config and the tokenizer into the directory `out`."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    base, lineage = model.get_base_model(), _lineage(model.get_base_model())
    if not lineage.base_path:  # adapters without their base are useless
        raise ValueError(f"{type(base).__name__} was not loaded from a path: its LoRA base cannot be recorded")
    os.makedirs(out, exist_ok=True)
    state, seen = {}, set()
    for key, value in get_peft_model_state_dict(model).items():
        tensor = value.detach().to("cpu").contiguous()
        # A tied embedding and LM head trained whole (modules_to_save) are one tensor under two keys;
        # safetensors refuses aliases, and peft's loader expects both keys (ties them again).
        state[key] = tensor.clone() if tensor.data_ptr() in seen else tensor
        seen.add(tensor.data_ptr())
    save_file(state, os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    parents = []
    for i, source in enumerate(lineage.adapters):
        parents.append(f"parents/{i:02d}")
        os.makedirs(os.path.join(out, parents[-1]))
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, parents[-1], name))
    peft_cfg = model.peft_config[ADAPTER]
    # peft's own loader applies this directory's adapters to base_model_name_or_path: right only
    # without parents, so with parents it names none.
    peft_cfg.base_model_name_or_path = None if parents else lineage.base_path
    # peft's own save writes target_modules (a set) in hash order: sorted, the bytes repeat run to run.
    fields = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_cfg.to_dict().items()}
    with open(os.path.join(out, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
    base.config.save_pretrained(out)
    if base.can_generate() and getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    pointer = {
        "format": FORMAT,
        "base": {"path": lineage.base_path, "fingerprint": lineage.base_fingerprint},
        "adapters": parents + ["."],  # merged in this order onto the base
    }
    with open(os.path.join(out, POINTER), "w", encoding="utf-8") as f:
        json.dump(pointer, f, indent=2, sort_keys=True)


def read_pointer(path: str) -> dict[str, Any]:
    """The parsed rlflow_lora.json of a LoRA directory; CheckpointError if it is unreadable."""
    where = os.path.join(path, POINTER)
    try:
        with open(where, encoding="utf-8") as f:
            pointer = json.load(f)
        base, adapters = pointer["base"], pointer["adapters"]
        if pointer.get("format") != FORMAT or not isinstance(base["path"], str) or not adapters:
            raise ValueError(pointer.get("format"))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where} is not a valid rlflow LoRA pointer ({type(exc).__name__}: {exc})") from None
    return pointer


def lora_base_dir(path: str, key: str = "model.path") -> str:
    """The base model a LoRA directory's adapters apply to (checked as load_lora_dir checks it)."""
    return _check_base(path, key, read_pointer(path)["base"])


def _check_base(path: str, key: str, base: dict[str, Any]) -> str:
    """The base model path of LoRA directory `path`; ConfigError if it is gone or its weights changed."""
    base_path, recorded = base["path"], base.get("fingerprint")
    what = f"{key} {path!r} is a LoRA checkpoint whose adapters were trained on the base model {base_path!r}"
    if not os.path.isdir(base_path):
        if HUB_ID.match(base_path) and not base_path.startswith((".", "/")):
            return base_path  # a hub id: its fingerprint is the id itself
        raise ConfigError(
            f"{what}, which does not exist here (a relative path resolves from the working directory);"
            " make that model available at that path, or export the merged model on the machine that has it"
        )
    if recorded and model_fingerprint(base_path) != recorded:
        raise ConfigError(
            f"{what}, but that directory's weights changed since (fingerprint {recorded} at training time);"
            " the adapters only fit the weights they were trained on: restore that model or train again"
        )
    return base_path


def load_lora_dir(path: str, load_base: Callable[[str], nn.Module], key: str = "model.path", merge: bool = True):
    """Base model (via `load_base(base_path)`) plus every adapter of LoRA directory `path`.

    merge: every adapter merged into the weights, a plain HF model (what every stage, evaluation
    and export want). merge=False: this directory's own adapter stays a frozen peft layer (its
    outputs are bit-identical to the trained model's); earlier ones are merged.
    """
    pointer = read_pointer(path)
    base_path = _check_base(path, key, pointer["base"])
    model = load_base(base_path)
    adapters = [os.path.normpath(os.path.join(os.path.abspath(path), a)) for a in pointer["adapters"]]
    for i, adapter in enumerate(adapters):
        model = _load_adapter(model, adapter, key)
        if merge or i < len(adapters) - 1:
            model = merge_into_base(model)
    merged = tuple(adapters if merge else adapters[:-1])
    target = model.get_base_model() if is_lora_model(model) else model
    target.rlflow_lineage = Lineage(base_path, pointer["base"].get("fingerprint"), merged)
    return model.eval()


def _load_adapter(model: nn.Module, adapter_dir: str, key: str) -> nn.Module:
    """A frozen peft model with the adapter of `adapter_dir`, its weights checked against the file."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        expected = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
        with warnings.catch_warnings():  # peft probes a transformers attribute deprecated in v5
            warnings.simplefilter("ignore", FutureWarning)
            peft_model = PeftModel.from_pretrained(model, adapter_dir, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{key}: the LoRA adapter at {adapter_dir} could not be loaded: {first}") from None
    _retie_embeddings(peft_model)
    loaded = get_peft_model_state_dict(peft_model)
    wrong = sorted(set(expected) ^ set(loaded)) or [k for k in expected if not torch.equal(expected[k], loaded[k])]
    if wrong:  # peft only warns about adapter keys it could not place
        raise CheckpointError(
            f"{key}: the LoRA adapter at {adapter_dir} does not fit this model (e.g. {wrong[0]}); it was trained"
            " on another architecture"
        )
    return peft_model


def _retie_embeddings(model: nn.Module) -> None:
    """peft's loader gives a tied LM head trained whole (modules_to_save) a copy of its own, while
    the trained model held one tensor: tie the two again (the file holds equal values for both)."""
    from peft.utils.other import ModulesToSaveWrapper

    base = model.get_base_model()
    inputs, outputs = base.get_input_embeddings(), base.get_output_embeddings()
    tied = getattr(base.config, "tie_word_embeddings", False)
    if tied and all(isinstance(m, ModulesToSaveWrapper) and ADAPTER in m.modules_to_save for m in (inputs, outputs)):
        outputs.modules_to_save[ADAPTER].weight = inputs.modules_to_save[ADAPTER].weight


def merge_into_base(model: nn.Module) -> nn.Module:
    """The plain HF model of a peft model with its adapters merged into the weights (and a scalar
    head's trained copy in place of the original). NaN-checked; the peft wrapper is gone."""
    merged = model.merge_and_unload(safe_merge=True)
    for attribute in ("peft_config", "_hf_peft_config_loaded"):  # so a later apply_lora starts clean
        if attribute in merged.__dict__:
            delattr(merged, attribute)
    return merged


def merged_named_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the merged model without changing `model`: what merge_into_base would
    hold, bit for bit, under the plain model's parameter names (weight sync to a rollout worker
    holding a full copy). Tied tensors appear once, as in named_parameters."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    seen: set[int] = set()

    def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(module, ModulesToSaveWrapper):
            yield from walk(module.modules_to_save[ADAPTER], prefix)  # the trained copy
            return
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            for name, param in base.named_parameters(recurse=False):
                merge = name == "weight" and ADAPTER in module.lora_A
                yield f"{prefix}{name}", _merged_weight(module, param) if merge else param.detach()
            return
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield f"{prefix}{name}", param.detach()
        for name, child in module.named_children():
            yield from walk(child, f"{prefix}{name}.")

    if not is_lora_model(model):
        yield from ((name, param.detach()) for name, param in model.named_parameters())
        return
    yield from walk(model.get_base_model(), "")


@torch.no_grad()
def _merged_weight(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A LoRA layer's base weight plus its delta, as peft's safe_merge computes it."""
    merged = weight.detach().clone()
    merged += layer.get_delta_weight(ADAPTER).to(merged.dtype)
    return merged


class AdaptersOffView(nn.Module):
    """A LoRA model's starting point as a module of its own: every forward runs with the adapters
    off. PPO's reference and DPO's reference without a second copy of the weights in memory."""

    def __init__(self, model: nn.Module):
        super().__init__()
        if not is_lora_model(model):
            raise ValueError(f"{type(model).__name__} has no LoRA adapters to disable (model.lora is not set)")
        object.__setattr__(self, "_model", model)  # not a submodule: its parameters stay the actor's

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self._model):
            return self._model(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._model.parameters(recurse)
