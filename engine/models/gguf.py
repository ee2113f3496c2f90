"""GGUF files as transformers reads them: recognising one, and the quantizer record that
must not survive into a saved directory (transformers dequantises on load, then refuses to save)."""

from __future__ import annotations

import os
from typing import Any

from rlflow.engine.errors import ConfigError

# Quantisation methods whose weights transformers turns into plain tensors on load: such a model
# trains and saves once its quantizer is dropped. Any other quantization_config (bitsandbytes,
# GPTQ, AWQ, ...) keeps packed integer weights that full fine-tuning cannot update.
DEQUANTISED_ON_LOAD = ("gguf",)


GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str) -> bool:
    """Whether `path` is a file that starts with the GGUF magic bytes."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def check_gguf_file(path: str, key: str) -> None:
    """ConfigError unless `path` is a GGUF file, naming what it is instead."""
    if not os.path.exists(path):
        raise ConfigError(f"{key} {path!r} does not exist; give a .gguf file")
    if not os.path.isfile(path):  # a folder named x.gguf
        raise ConfigError(f"{key} {path!r} is a folder, not a GGUF file; give the .gguf file inside it")
    if not is_gguf_file(path):
        with open(path, "rb") as f:
            head = f.read(4)
        raise ConfigError(
            f"{key} {path!r} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r}); give a .gguf"
            " file, a folder holding one, or package:NAME for an installed package that ships one"
        )


def strip_quantizer(model: Any) -> Any:
    """Drop the record of a quantisation that loading already undid (GGUF): the weights are plain
    tensors, and save_pretrained would otherwise refuse them."""
    config = getattr(model.config, "quantization_config", None)
    method = getattr(config, "quant_method", None) if config is not None else None
    if method is None:
        return model
    if str(getattr(method, "value", method)) not in DEQUANTISED_ON_LOAD:
        return model
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    return model
