"""Importing DeepSpeed without MLflow.

DeepSpeed's autotuner imports MLflow whenever it is installed: 1.5 of the 1.9 s that `import
deepspeed` takes on a 2-core machine, paid by every rank of every job and by every process that
saves a checkpoint (transformers' `save_pretrained` imports DeepSpeed through accelerate when it is
installed). rlflow never autotunes and the engine never uses MLflow (tasks/tracking.py does, in the
flow's process), so a process that has not imported MLflow imports DeepSpeed with MLflow hidden for
that one import; it stays importable afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, without the MLflow import it would make on the way (see the module doc)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        return importlib.import_module("deepspeed")
    finally:
        if hide:
            del sys.modules["mlflow"]


def preload_deepspeed() -> None:
    """Import DeepSpeed (as above) where it is installed: a stage worker's first checkpoint would
    import it anyway, through transformers, and then with MLflow."""
    if importlib.util.find_spec("deepspeed") is not None:
        import_deepspeed()
