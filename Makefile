# Rampart: `make serve` and `make test` both set up .venv and the model store first.
# `make serve` installs serving and model import only; `make test` adds tests, notebooks, benchmarks.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 3000

.PHONY: setup setup-dev setup-peers models serve lint test test-unit bench bench-peers build clean nginx kubectl serve-cluster stop-cluster perf-analyzer

# Serving (requirements.txt) and model import (requirements-models.txt). Each stamp is
# touched after its install, so a second run installs nothing until a requirements file changes.
# uv (pinned in constraints.txt, installed into the venv by its own pip) installs the pinned
# requirements, compiled to bytecode as pip does: on the 2-core host 41 s for serving, models and
# tests from an empty cache, against 113 s for pip with its cache warm (the same versions).
# --system-certs: the platform's certificates, as pip.conf's `cert` gives pip.
setup: $(VENV)/.installed

UV_INSTALL = $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode --system-certs

$(VENV)/.installed: requirements.txt requirements-models.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv -c constraints.txt
	$(UV_INSTALL) -r requirements-models.txt -c constraints.txt
	touch $@

# On top of setup: tests, notebooks (with their Jupyter kernel) and benchmarks (requirements-dev.txt).
setup-dev: $(VENV)/.installed-dev

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(UV_INSTALL) -r requirements-dev.txt -c constraints.txt
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

# Idempotent: models already in the BentoML store are skipped.
models: setup
	$(PY) -m models.import_models

serve: models
	$(VENV)/bin/bentoml serve service:Rampart --host 127.0.0.1 --port $(PORT)

# Replicas on loopback behind nginx (deploy/cluster.py); RAMPART_* settings reach every replica.
REPLICAS ?= 2
CLUSTER_PORT ?= 8080
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || \
		{ $(SUDO) apt-get update && $(SUDO) apt-get install -y nginx-light; }

# kubectl renders the kustomize overlays in the tests (deploy/k8s and the planner's, docs/planning.md).
kubectl:
	@command -v kubectl >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y kubectl; }

# perf_analyzer, Triton's load tool, for the /v2 endpoint (docs/oip.md), in its own folder $(PERF_ANALYZER_DIR):
# the binary bundled in the tritonclient 2.41.1 wheel (later wheels need glibc 2.38; Debian 12 has 2.36; the
# perf-analyzer package on PyPI is a placeholder), Debian's libb64-0d, and the CUDA 12 runtime from its wheel,
# put on the library path by the wrapper $(PERF_ANALYZER) (bench/perf_analyzer/perf_analyzer.sh).
PERF_ANALYZER_DIR ?= .perf-analyzer
PERF_ANALYZER := $(PERF_ANALYZER_DIR)/perf_analyzer
PERF_ANALYZER_WHEEL := tritonclient==2.41.1
CUDA_RUNTIME_WHEEL := nvidia-cuda-runtime-cu12==12.9.79

perf-analyzer: $(PERF_ANALYZER_DIR)/.installed

$(PERF_ANALYZER_DIR)/.installed: bench/perf_analyzer/perf_analyzer.sh
	@dpkg -s libb64-0d >/dev/null 2>&1 || { $(SUDO) apt-get update && $(SUDO) apt-get install -y libb64-0d; }
	rm -rf $(PERF_ANALYZER_DIR) && mkdir -p $(PERF_ANALYZER_DIR)/bin $(PERF_ANALYZER_DIR)/wheel
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
		-d $(PERF_ANALYZER_DIR)/wheel $(PERF_ANALYZER_WHEEL)
	$(PYTHON) -c "import glob, shutil, zipfile; w = zipfile.ZipFile(glob.glob('$(PERF_ANALYZER_DIR)/wheel/*.whl')[0]); \
		src = next(n for n in w.namelist() if n.endswith('/data/bin/perf_analyzer')); \
		shutil.copyfileobj(w.open(src), open('$(PERF_ANALYZER_DIR)/bin/perf_analyzer', 'wb'))"
	chmod +x $(PERF_ANALYZER_DIR)/bin/perf_analyzer
	$(PYTHON) -m pip install -q --no-deps --target $(PERF_ANALYZER_DIR)/cuda $(CUDA_RUNTIME_WHEEL)
	rm -rf $(PERF_ANALYZER_DIR)/wheel
	cp bench/perf_analyzer/perf_analyzer.sh $(PERF_ANALYZER)
	$(PERF_ANALYZER) --version
	touch $@

serve-cluster: models nginx
	$(PY) -m deploy.cluster start --replicas $(REPLICAS) --port $(CLUSTER_PORT)

stop-cluster:
	$(PY) -m deploy.cluster stop

# A hung test fails after TEST_TIMEOUT_S with every thread's stack (pytest-timeout); the whole run,
# interpreter exit included, is cut at SUITE_TIMEOUT, far above the suite's 14-15 minutes on 2 cores (measured on fresh clones).
TEST_TIMEOUT_S ?= 600
SUITE_TIMEOUT ?= 45m

# ruff with the rules of ruff.toml (about a second); `make test` runs it first.
lint: setup-dev
	$(VENV)/bin/ruff check .

# The unit layer runs on UNIT_WORKERS processes (pytest-xdist): it waits on threads and sockets a
# third of its time, so two workers take it from about 80 s to 49 s on 2 cores. The server layer
# runs on one: its tests compare rates measured in the same run, which a neighbour's load would skew.
UNIT_WORKERS ?= 2
PYTEST = timeout -k 30 $(SUITE_TIMEOUT) $(PY) -m pytest -q --timeout=$(TEST_TIMEOUT_S)

test: lint models nginx kubectl perf-analyzer setup-dev
	$(PYTEST) tests/unit -n $(UNIT_WORKERS) --durations=10
	$(PYTEST) tests/server --durations=25

# The in-process unit tests only: no model store, no server (under a minute).
test-unit: setup-dev
	$(PYTEST) tests/unit -n $(UNIT_WORKERS) --durations=10

# The load benchmark (about 10 minutes on 2 CPU cores) and the decode benchmark.
bench: models setup-dev
	$(PY) -m bench.load_bench
	$(PY) -m bench.decode_bench

# Peer servers for the load benchmark (Triton via PyTriton) in their own venv: PyTriton needs numpy < 2.
# Installed first on their own (requirements-peers.txt, all pinned in constraints-peers.txt), then a .pth
# file appends the main venv's site-packages to the peers venv's path: torch, timm, BentoML and Pillow
# come from there, not from a second multi-GB download. The .pth is removed while pip runs, so that pip
# never sees (or touches) the main venv's packages.
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
SITE_PACKAGES := import sysconfig; print(sysconfig.get_paths()['purelib'])

setup-peers: $(PEERS_VENV)/.installed

$(PEERS_VENV)/.installed: $(VENV)/.installed requirements-peers.txt constraints-peers.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	rm -f $(PEERS_VENV)/lib/python*/site-packages/_rampart_main_venv.pth
	$(PEERS_PY) -m pip install -q --upgrade pip
	$(PEERS_PY) -m pip install -q -r requirements-peers.txt -c constraints-peers.txt
	$(PY) -c "$(SITE_PACKAGES)" > "$$($(PEERS_PY) -c "$(SITE_PACKAGES)")/_rampart_main_venv.pth"
	touch $@

# The peers against the naive baseline of the same run (about 3 minutes; peers.json). `make bench`
# includes them too once they are installed, and skips them with a message otherwise.
bench-peers: models setup-dev setup-peers
	$(PY) -m bench.load_bench --peers-only

# The bento's version is bentofile.yaml's labels.version: the image tag deploy/k8s runs.
BENTO_VERSION = $(shell sed -n 's/^  version: "\(.*\)"/\1/p' bentofile.yaml)

build: models
	$(VENV)/bin/bentoml build --version $(BENTO_VERSION)

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(PERF_ANALYZER_DIR) .pytest_cache .hypothesis .ruff_cache
