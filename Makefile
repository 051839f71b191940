# tailwatch: `make run` serves the built-in model on SQLite; `make test` runs every test.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/var/compile-cache

.PHONY: install run test test-deps bench-deps lint demo bench clean gpu-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The pinned CPU build lies on local disk; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

# Auth is on by default: without TAILWATCH_API_TOKEN, generate one into var/api-token.
run: install
	@mkdir -p var
	@test -n "$$TAILWATCH_API_TOKEN" || test -s var/api-token || \
	  { $(BIN)/python -c "import secrets; print(secrets.token_urlsafe(24))" > var/api-token; \
	    chmod 600 var/api-token; echo "API token written to var/api-token"; }
	$(BIN)/tailwatch db upgrade
	$(BIN)/tailwatch engine precompile
	@# Ctrl-C or a TERM ends the server by its signal (exit 130/143): a normal stop, not a make error.
	TAILWATCH_API_TOKEN="$${TAILWATCH_API_TOKEN:-$$(cat var/api-token)}" $(BIN)/tailwatch serve; \
	  rc=$$?; case $$rc in 0|130|143) exit 0;; *) exit $$rc;; esac

# System packages some tests drive for real: Prometheus (promtool) and headless Chromium.
test-deps:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v chromium >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus chromium >/dev/null; }

# Three worker processes (pytest-xdist) on the development machine's two cores: the suite
# spends a fifth of its time waiting (servers, subprocesses, the demo's minute rollups), and
# the third worker fills those waits. Each builds its own tiny models and PostgreSQL
# database. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 3

test: install test-deps
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal

# CTranslate2, the comparison bench.engine, bench.throughput and bench.quality run when present.
bench-deps: install
	$(BIN)/pip install -q -e '.[test,bench]'

lint: install
	$(BIN)/ruff check .

demo: install
	$(BIN)/tailwatch demo

clean:
	rm -rf $(VENV) var/*.db

# Wheels for scripts/gpu_check.sh on the GPU machine, whose image's python3 (CPython 3.12,
# torch 2.11, transformers 5.x) lacks these runtime packages (and their own missing needs):
# pinned to the versions this venv runs, installed there offline (--no-index). bench.gpu
# and the engine need none of them; they let `pytest -m gpu` and the monitor import there.
# What travels to that machine (the tree and these) must stay under 64 MiB.
GPU_WHEELS := var/gpu-wheels
GPU_PYTHON := 3.12
GPU_WHEELS_MAX_MIB := 32
GPU_PACKAGES := sqlalchemy alembic mako psycopg psycopg-binary apscheduler tzlocal fastapi \
	starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
	pydantic-settings python-dotenv

gpu-wheels: install
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/python -c 'import sys; from importlib.metadata import version; \
	  print("\n".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $(GPU_PACKAGES) \
	  > $(GPU_WHEELS)/requirements.txt
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d $(GPU_WHEELS) \
	  --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 -r $(GPU_WHEELS)/requirements.txt
	@size=$$(du -sm $(GPU_WHEELS) | cut -f1); ls $(GPU_WHEELS); \
	  echo "gpu-wheels: $$size MiB in $(GPU_WHEELS) (limit $(GPU_WHEELS_MAX_MIB))"; \
	  test "$$size" -le $(GPU_WHEELS_MAX_MIB)
