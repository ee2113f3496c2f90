"""What a stage starts from: the records its builder (`inputs_from` in each stage's module) makes out
of the config and the stage's upstream, the one thing the stage's body reads.

A stage's inputs record holds every value the stage reads and nothing else; its identity is the
hash of that record (engine/stages/identity.py). Upstream inputs are what other stages made (or
what a path names): each is known by its `identity` (a manifest's sha256, or a content
fingerprint), never by where it lies.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from rlflow.engine.config.base import SectionView
from rlflow.engine.config.model import LoraConfig, ModelConfig
from rlflow.engine.rewards.model_scores import ScoreNorm
from rlflow.engine.stages.context import Record
from rlflow.engine.storage.checkpoint import model_location


class Upstream(Record):
    """An input another stage made, or a path names: its identity stands for it in a stage's."""

    identity: str  # the producing stage's output manifest sha256, or the content fingerprint of the file(s)


class ModelInput(Upstream):
    """A model a stage starts from or scores with."""

    uri: str  # a local directory, or a committed step's URI (each process fetches it to its own cache)


class RewardModelInput(ModelInput):
    """The round's reward model, with its score statistics on the fixed reference set."""

    score_norm: ScoreNorm  # (mean, std) of its raw scores (per head: an ensemble), recorded by its stage


class LabelsInput(Upstream):
    """Labelled preference pairs: one label stage's output, or one human label file."""

    train: str | None = None  # JSONL of pairs to train on; None: none were kept
    held_out: str | None = None  # JSONL of pairs held out (label.eval_fraction); None: none


class StageLora(SectionView, source=LoraConfig):
    """The adapters one stage trains: model.lora but the list of stages that train them."""

    r: int
    alpha: float
    dropout: float
    target_modules: list[str] | Literal["all-linear"]
    modules_to_save: list[str]


class ModelLoading(Record):
    """How a stage loads its models: model.* but the initial policy's path (an upstream input), with the
    adapters this stage trains (model.lora when model.lora.stages names it, else None)."""

    trust_remote_code: bool
    dtype: Literal["float32", "bfloat16", "float16"]
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"]
    lora: StageLora | None

    @classmethod
    def for_stage(cls, model: ModelConfig, stage: str) -> ModelLoading:
        lora = model.lora_for(stage)
        return cls(
            trust_remote_code=model.trust_remote_code,
            dtype=model.dtype,
            attn_implementation=model.attn_implementation,
            lora=None if lora is None else StageLora.of(lora),
        )


class StageInputs(Record):
    """The base of every stage's inputs record."""

    seed: int  # run.seed: every random draw of the stage derives from it


Inputs = TypeVar("Inputs", bound=StageInputs)


def located(inputs: Inputs, storage_options: dict[str, Any]) -> Inputs:
    """`inputs` with every upstream model's URI turned into a directory on this machine (a committed
    step is fetched to the local cache once); identities are untouched."""
    upstream = getattr(inputs, "upstream", None)
    if upstream is None:
        return inputs
    moved = {
        name: value.model_copy(update={"uri": model_location(value.uri, storage_options)})
        for name, value in upstream
        if isinstance(value, ModelInput)
    }
    return inputs.model_copy(update={"upstream": upstream.model_copy(update=moved)})
