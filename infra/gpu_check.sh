#!/usr/bin/env bash
# The GPU check, one command: infra/gpu_check.sh [--steps 3] [--vllm-python PATH] (at most 4 minutes, 7 with
# vLLM; nothing downloaded). The vLLM replica part runs where PATH (default .venv-vllm/bin/python) imports vllm.
# Python packages the GPU machine lacks come from .gpu-wheels/ (`make gpu-wheels` here, then carry
# that folder); the machine's own torch and transformers are used as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEPS=$(mktemp -d /tmp/rlflow-gpu-deps.XXXXXX)
# Install only what is missing, without dependencies, into a private folder.
for pair in deepspeed:deepspeed hjson:hjson cpuinfo:py-cpuinfo msgpack:msgpack einops:einops ninja:ninja \
            pydantic:pydantic pydantic_core:pydantic-core annotated_types:annotated-types \
            typing_inspection:typing-inspection yaml:pyyaml fsspec:fsspec safetensors:safetensors \
            uvicorn:uvicorn h11:h11 click:click requests:requests urllib3:urllib3 idna:idna certifi:certifi; do
  module=${pair%%:*}; dist=${pair##*:}
  if ! $PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    $PY -m pip install -q --no-index --no-deps --find-links .gpu-wheels --target "$DEPS" "$dist"
  fi
done
# engine/ is importable as rlflow.engine without installing the project (a namespace package).
mkdir -p "$DEPS/rlflow" && ln -s "$PWD/engine" "$DEPS/rlflow/engine"
export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}" DS_BUILD_OPS=0 TOKENIZERS_PARALLELISM=false
exec timeout 420 $PY infra/gpu_check.py "$@"
