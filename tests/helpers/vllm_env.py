"""The vLLM environment the tests start replicas from (`make vllm-env`, which `make test` runs)."""

from __future__ import annotations

import os
import pathlib

import pytest

VLLM_PYTHON = pathlib.Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str:
    """Its interpreter; a missing environment fails the test (never skips it), naming the fix."""
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-env` (make test does it)")
    return str(VLLM_PYTHON)
