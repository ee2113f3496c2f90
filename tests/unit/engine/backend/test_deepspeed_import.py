"""DeepSpeed imported without MLflow, in fresh interpreters (an import happens once per process)."""

import subprocess
import sys

from rlflow.engine.backend.deepspeed_import import import_deepspeed

CHECK = """
import sys
{before}
from rlflow.engine.backend.deepspeed_import import import_deepspeed
deepspeed = import_deepspeed()
from deepspeed.autotuning import autotuner
print("mlflow loaded:", "mlflow" in sys.modules, "autotuner mlflow:", autotuner.has_mlflow)
assert import_deepspeed() is deepspeed
import mlflow  # still importable afterwards
print("mlflow importable:", mlflow.__name__ == "mlflow")
"""


def _run(before: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK.format(before=before)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_deepspeed_comes_without_mlflow_and_mlflow_stays_importable():
    out = _run("")
    assert "mlflow loaded: False autotuner mlflow: False" in out
    assert "mlflow importable: True" in out


def test_a_process_that_already_has_mlflow_keeps_it():
    out = _run("import mlflow")
    assert "mlflow loaded: True autotuner mlflow: True" in out


def test_in_this_process_it_is_the_one_deepspeed_module_and_mlflow_is_left_as_found():
    had_mlflow = "mlflow" in sys.modules
    deepspeed = import_deepspeed()
    assert deepspeed is sys.modules["deepspeed"] and hasattr(deepspeed, "initialize")
    assert ("mlflow" in sys.modules) == had_mlflow and sys.modules.get("mlflow", 0) is not None
