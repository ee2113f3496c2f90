"""Config sections of the model: where it is, how it loads, and its LoRA adapters."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from rlflow.engine.config.base import Section, wiring


class LoraConfig(Section):
    """LoRA adapters (engine/models/lora.py, through peft): only they (and a scalar model's head) train."""

    r: int = Field(8, ge=1)
    """Rank of each adapter pair A [r x in], B [out x r]."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the adapters' update: it is multiplied by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on an adapter's input only; the base model keeps none."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Short names of the linear modules to adapt (e.g. q_proj), or "all-linear" for every linear
    layer of the backbone (never the LM or score head)."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained whole besides the adapters (peft's modules_to_save), e.g. [embed_tokens]: with
    tied input and output embeddings the LM head trains with it, as one tensor. Costs a full copy."""
    stages: list[Literal["sft", "rm", "rl", "dpo"]] = Field(default_factory=lambda: ["sft", "rm", "rl", "dpo"])
    """The training stages that train adapters; the others train every weight (e.g. a full SFT of a
    model that was never pretrained, then LoRA for the reward model and RL)."""

    @field_validator("stages", mode="before")
    @classmethod
    def _renamed_stage(cls, value: Any) -> Any:
        if isinstance(value, list) and "ppo" in value:
            raise ValueError("model.lora.stages: the RL stage is named rl now, not ppo; write rl")
        return value

    @field_validator("target_modules", mode="before")
    @classmethod
    def _named_modules(cls, value: Any) -> Any:
        empty = isinstance(value, list) and (not value or not all(isinstance(n, str) and n.strip() for n in value))
        if empty or (isinstance(value, str) and value != "all-linear"):
            raise ValueError(
                "model.lora.target_modules must be a list naming at least one module (e.g. [q_proj, v_proj])"
                ' or "all-linear"'
            )
        return value


class ModelConfig(Section):
    path: Annotated[str, wiring("the initial policy: the first stages' upstream model, by content")] = (
        "demo_assets/tiny-model"
    )
    """The initial policy: a local Hugging Face model directory or a hub id."""
    trust_remote_code: bool = False
    """Let transformers run the model's own code from its directory or hub repository."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype models load in (the torch backend trains in it; DeepSpeed follows engine.precision)."""
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    """The attention kernel; flash_attention_2 falls back to sdpa with a warning when the flash-attn
    package is missing."""
    lora: LoraConfig | None = None
    """LoRA adapters (see docs/lora.md); None: every weight trains. A LoRA stage's model/ holds the
    adapters and a pointer to the base."""
    gguf_file: Annotated[str | None, wiring("part of the initial policy's path (model.path)")] = None
    """A GGUF file inside `path` (the Hugging Face convention): dequantised on every load; convert
    once with `rlflow import-model` to load in a second instead."""

    @field_validator("gguf_file")
    @classmethod
    def _gguf_name(cls, value: str | None) -> str | None:
        if value is not None and (not value.endswith(".gguf") or "/" in value):
            raise ValueError(f"model.gguf_file {value!r} must be a file name ending in .gguf, inside model.path")
        return value

    @property
    def init_path(self) -> str:
        """What the first stage loads: model.path, or the GGUF file in it."""
        return self.path if self.gguf_file is None else f"{self.path.rstrip('/')}/{self.gguf_file}"

    def lora_for(self, stage: str) -> LoraConfig | None:
        """The adapters `stage` trains (None: all its weights train)."""
        return self.lora if self.lora is not None and stage in self.lora.stages else None
