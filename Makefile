# The two commands: `make demo` and `make test`. Each sets up everything it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NATIVE_SRC := $(wildcard csrc/*.cc csrc/*.h) CMakeLists.txt pyproject.toml

# Pinned tool and build versions (runtime ranges live in pyproject.toml).
# torch is pinned to 2.13.0: that release is the CPU build; anything else pulls a CUDA build.
PINS := scikit-build-core==1.1.2 nanobind==2.9.2 numpy==2.4.6 tokenizers==0.23.3 \
        rich==15.0.0 pytest==9.2.0 hypothesis==6.170.15 ruff==0.17.5 mypy==2.4.1 \
        torch==2.13.0 safetensors==0.8.0 fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 \
        prometheus-client==0.26.0 transformers==5.24.0 httpx==0.28.1 sniffio==1.3.1 \
        aiohttp==3.14.5 uvloop==0.23.0 httptools==0.9.0 orjson==3.13.0 \
        jinja2==3.1.6 pyarrow==26.0.1 matplotlib==3.11.2 pyyaml==6.0.4 types-PyYAML==6.0.12.20261122 \
        ray==2.60.0 cmake==4.4.5 ninja==1.13.2

.PHONY: demo test lint typecheck install clean bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3

$(STAMP): $(BIN)/python $(NATIVE_SRC)
	$(BIN)/pip install --quiet $(PINS)
	$(BIN)/pip install --quiet --no-build-isolation -e ".[dev,ray]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/war demo

test: install
	$(BIN)/python -m pytest -q
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

bench: install
	$(BIN)/python benchmarks/spec/bench_replay.py --mode path --json bench-spec-path.json
	$(BIN)/python benchmarks/spec/bench_replay.py --mode tree --json bench-spec-tree.json

clean:
	rm -rf build $(VENV) .pytest_cache .mypy_cache .ruff_cache
