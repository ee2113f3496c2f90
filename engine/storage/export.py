"""Export a trained policy as a clean Hugging Face directory, with a model card.

A committed checkpoint step holds rlflow's own files (manifest, optimizer shards, training state)
next to the policy's HF directory. The export keeps only what `from_pretrained` needs: config,
safetensors weights (sharded above `max_shard_size`), tokenizer, generation config, README.md.
It is written to a local temp dir first, then published: a local dest by one rename of a
sibling dir, a remote dest (s3://...) with config.json uploaded last, so nobody loads a half.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from rlflow.engine.storage.checkpoint import STEP_URI, CheckpointStore
from rlflow.engine.storage.files import hash_stream
from rlflow.engine.errors import CheckpointError, ConfigError
from rlflow.engine.storage.errors import STORAGE_ERRORS, describe_storage_error

CONFIG, CARD = "config.json", "README.md"
# sampling key -> (must be an int, range check, the rule in words)
_SAMPLING_RANGES = {
    "temperature": (False, lambda v: v > 0, "a number > 0"),
    "top_p": (False, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (True, lambda v: v >= 0, "an integer >= 0"),
    "min_p": (False, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "max_new_tokens": (True, lambda v: v > 0, "an integer > 0"),
    "repetition_penalty": (False, lambda v: v > 0, "a number > 0"),
}
_USAGE = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{path}")
model = AutoModelForCausalLM.from_pretrained("{path}")
inputs = tokenizer("Your prompt", return_tensors="pt")
output = model.generate(**inputs)  # sampling defaults come from generation_config.json
print(tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
```"""


def _cell(value: Any) -> str:
    """A Markdown table cell: floats to 4 significant digits, no character that breaks the row."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelCard:
    """What README.md says about an exported policy: where it came from and how it scored."""

    run_name: str
    round_index: int
    stage: str
    step_uri: str
    base_model: str
    lineage: dict[str, str] = field(default_factory=dict)  # e.g. MLflow run ids, data fingerprints
    evaluation: list[dict[str, float | int | str]] = field(default_factory=list)  # one row per round

    def render(self, model_path: str = "path/to/this/model") -> str:
        """Markdown with YAML front matter (library_name, tags), Lineage and Evaluation tables and a
        usage snippet loading `model_path`. A pure function of the fields."""
        front = ["---", "library_name: transformers", "tags:", "- rlhf", "- ppo", "- rlflow", "---"]
        lineage = [
            ["run", self.run_name],
            ["round", self.round_index],
            ["stage", self.stage],
            ["checkpoint", self.step_uri],
            ["base model", self.base_model],
            *([k, v] for k, v in self.lineage.items()),
        ]
        columns = list(dict.fromkeys(key for row in self.evaluation for key in row))  # first-seen order
        evaluation = "No evaluation was recorded."
        if self.evaluation:  # a round without some metric leaves its cell empty
            evaluation = _table(columns, [[row.get(c, "") for c in columns] for row in self.evaluation])
        sections = [
            "\n".join(front),
            f"# {self.run_name}: round {self.round_index} {self.stage} policy",
            f"A causal language model post-trained from {self.base_model} with RLHF (supervised fine-tuning,"
            " a reward model, PPO) by rlflow, exported from its checkpoint as a plain Hugging Face directory.",
            "## Lineage",
            _table(["key", "value"], lineage),
            "## Evaluation",
            evaluation,
            "## Usage",
            _USAGE.format(path=model_path),
        ]
        return "\n\n".join(sections) + "\n"


@dataclass(frozen=True)
class ExportResult:
    """An exported directory: its URL, file names (sorted), their total size and parameter count."""

    dest: str
    files: tuple[str, ...]
    total_bytes: int
    n_params: int


def export_policy(
    step_uri: str,
    storage_options: dict[str, Any] | None,
    dest: str,
    dest_options: dict[str, Any] | None,
    card: ModelCard,
    *,
    sampling: dict[str, Any] | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> ExportResult:
    """Write the policy of a committed checkpoint step (or a local HF directory) to `dest`.

    `dest` is a local directory or any fsspec URL (credentials in `dest_options`); a non-empty
    dest is refused unless `overwrite`. `sampling` (temperature, top_p, top_k, min_p,
    max_new_tokens, repetition_penalty) is recorded in generation_config.json with do_sample.
    Raises ConfigError (dest, sampling, source path) or CheckpointError (step not committed or
    holding no whole model), each naming the value.
    """
    sampling = _check_sampling(sampling or {})
    try:
        fs, path = url_to_fs(dest, **(dest_options or {}))
    except STORAGE_ERRORS as exc:
        raise ConfigError(
            f"export dest {dest}: {describe_storage_error(dest, exc, dest_options, 'dest_options')}"
        ) from None
    path = path.rstrip("/") or path
    local = isinstance(fs, LocalFileSystem)
    _refuse_existing(fs, path, dest, dest_options, overwrite)  # before minutes of work, and again at the end
    with tempfile.TemporaryDirectory(prefix="rlflow-export-") as work:
        source = _source_dir(step_uri, storage_options or {}, work)
        if local:  # a sibling, so publishing is a rename on one filesystem
            parent, name = os.path.split(os.path.abspath(path))
            os.makedirs(parent, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=f".{name}.export-", dir=parent)
        else:
            staging = os.path.join(work, "out")
        try:
            n_params = _write_clean_dir(source, staging, step_uri, card, sampling, max_shard_size)
            files = sorted(os.listdir(staging))
            total = sum(os.path.getsize(os.path.join(staging, f)) for f in files)
            if local:
                _publish_local(staging, path, dest, overwrite)
            else:
                _publish_remote(fs, staging, path, files, dest, dest_options, overwrite)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone after a rename; debris after a failure
    return ExportResult(dest=dest, files=tuple(files), total_bytes=total, n_params=n_params)


def _check_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """ConfigError naming the first unknown key or out-of-range value; transformers only checks
    most of these ranges when generate() runs, i.e. in the user's hands, not at export."""
    for key, value in sampling.items():
        if key not in _SAMPLING_RANGES:
            raise ConfigError(f"sampling key {key!r} is not supported; use some of {', '.join(_SAMPLING_RANGES)}")
        integral, in_range, rule = _SAMPLING_RANGES[key]
        kind_ok = isinstance(value, int) if integral else isinstance(value, (int, float))
        if isinstance(value, bool) or not kind_ok or not in_range(value):
            raise ConfigError(f"sampling.{key}={value!r} is invalid: it must be {rule}")
    return dict(sampling)


def _refuse_existing(fs, path: str, dest: str, options: dict[str, Any] | None, overwrite: bool) -> list[str]:
    """Return the dest's existing files (relative names); ConfigError if it is a file, or holds
    any and not `overwrite`."""
    try:
        fs.invalidate_cache(path)  # files another process wrote since this filesystem listed it
        if fs.isfile(path):
            raise ConfigError(f"export dest {dest} is a file; give a directory (or a URL prefix) to export into")
        found = fs.find(path) if fs.exists(path) else []
    except STORAGE_ERRORS as exc:
        raise ConfigError(f"export dest {dest}: {describe_storage_error(dest, exc, options, 'dest_options')}") from None
    existing = sorted(p[len(path) + 1 :] if p.startswith(path + "/") else p for p in found)
    if existing and not overwrite:
        raise ConfigError(
            f"export dest {dest} is not empty ({len(existing)} files, e.g. {existing[0]}); "
            "choose another dest or pass overwrite=True to replace it"
        )
    return existing


def _source_dir(step_uri: str, storage_options: dict[str, Any], work: str) -> str:
    """A local HF directory with the policy: the step's `model/` (downloaded if remote) or the path."""
    match = STEP_URI.match(step_uri)
    if match is None:
        if os.path.isfile(os.path.join(step_uri, CONFIG)):
            return step_uri
        raise ConfigError(
            f"{step_uri!r} is neither a checkpoint step URI (<stage prefix>/step_NNNNNN) nor a local Hugging"
            " Face model directory (no config.json there)"
        )
    store, step = CheckpointStore(match["prefix"], storage_options), int(match["step"])
    try:
        committed = store.committed_steps()
    except STORAGE_ERRORS as exc:
        raise ConfigError(
            f"checkpoint step {step_uri}: {describe_storage_error(step_uri, exc, storage_options)}"
        ) from None
    if step not in committed:
        raise CheckpointError(
            f"checkpoint step {step_uri} is not committed; committed steps of {store.url}: {committed or 'none'}"
        )
    files = {n: e for n, e in store.manifest(step)["files"].items() if n.startswith("model/")}
    if f"model/{CONFIG}" not in files:  # a resumable step, not a consolidated one
        whole = [s for s in committed if f"model/{CONFIG}" in store.manifest(s)["files"]]
        raise CheckpointError(
            f"checkpoint step {step_uri} holds optimizer shards but no whole model (checkpoint.consolidate_every);"
            f" steps of {store.url} with one: {whole or 'none'}"
        )
    if isinstance(url_to_fs(store.url, **storage_options)[0], LocalFileSystem):
        return os.path.join(store.local_dir(step), "model")
    # Only the model's files: store.local_dir would also fetch optimizer state, 3-6x the weights.
    out = os.path.join(work, "source")
    for name, entry in files.items():
        local_path = os.path.join(out, *name.split("/")[1:])
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        with store.open(step, name) as src, open(local_path, "wb") as sink:
            size, sha = hash_stream(src, sink)
        if (size, sha) != (entry["size"], entry["sha256"]):
            raise CheckpointError(f"{step_uri}/{name} is corrupted: size or sha256 differs from its manifest")
    return out


def _write_clean_dir(
    source: str, out: str, step_uri: str, card: ModelCard, sampling: dict[str, Any], max_shard_size: int | str
) -> int:
    """Load the policy and tokenizer from `source`, save them and the card into `out`; return the
    parameter count. Loading and saving (not copying) is what leaves nothing else behind. A LoRA
    directory (engine/models/lora.py) is loaded as its base with every adapter merged in: a full model."""
    from rlflow.engine.models.lora import is_lora_dir, load_lora_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        architectures = AutoConfig.from_pretrained(source).architectures or []
        if not any(a.endswith("ForCausalLM") for a in architectures):
            # AutoModelForCausalLM would load a reward model's backbone with a random LM head.
            raise ConfigError(
                f"{step_uri} holds a {'/'.join(architectures) or 'model'} model, not a causal-LM policy;"
                " export an sft or ppo step"
            )
        # dtype "auto": a bf16 checkpoint stays bf16; safetensors only, a pickle is never loaded.
        load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype="auto", use_safetensors=True)  # noqa: E731
        model = load_lora_dir(source, load, step_uri) if is_lora_dir(source) else load(source)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{step_uri} could not be loaded as a Hugging Face model: {first}") from None
    model.generation_config = _generation_config(source, tokenizer, sampling)
    # transformers 5 writes safetensors only (no safe_serialization switch any more).
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, CARD), "w", encoding="utf-8") as f:
        f.write(card.render())
    return model.num_parameters()


def _generation_config(source: str, tokenizer: Any, sampling: dict[str, Any]):
    """The checkpoint's generation config, else one from the tokenizer's special ids; `sampling`
    on top as the defaults `generate()` uses."""
    from transformers import GenerationConfig

    if os.path.isfile(os.path.join(source, "generation_config.json")):
        config = GenerationConfig.from_pretrained(source)
    else:
        tok = tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id  # batched generate() pads
        config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=pad)
    if sampling:
        config.update(do_sample=True, **sampling)
    return config


def _publish_local(staging: str, path: str, dest: str, overwrite: bool) -> None:
    """Rename the finished dir into place; dest is either the old directory or the new one whole."""
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
    if os.path.lexists(path):
        if not overwrite:  # it appeared while we wrote
            raise ConfigError(f"export dest {dest} is not empty; choose another dest or pass overwrite=True")
        old = f"{staging}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, path)


def _publish_remote(
    fs, staging: str, path: str, files: list[str], dest: str, options: dict[str, Any] | None, overwrite: bool
) -> None:
    """Upload with config.json removed first and put back last: object stores have no rename, and
    without config.json the prefix is no model, so no reader ever loads old and new files mixed."""
    existing = _refuse_existing(fs, path, dest, options, overwrite)
    body = [f for f in files if f != CONFIG]
    try:
        if CONFIG in existing:
            fs.rm_file(f"{path}/{CONFIG}")
        fs.put([os.path.join(staging, f) for f in body], [f"{path}/{f}" for f in body])
        stale = sorted(set(existing) - set(files))  # e.g. shards of a bigger old export
        if stale:
            fs.rm([f"{path}/{f}" for f in stale])
        fs.put_file(os.path.join(staging, CONFIG), f"{path}/{CONFIG}")
    except STORAGE_ERRORS as exc:
        raise ConfigError(
            f"export to {dest} failed (no config.json written, so nothing loadable is left half-done): "
            f"{describe_storage_error(dest, exc, options, 'dest_options')}"
        ) from None
    fs.invalidate_cache(path)
