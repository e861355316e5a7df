# The two commands: `make serve` and `make test`. Each sets itself up from a clean clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
# Two stamps: what serving needs, and (after it) the test tools; `make test` after `make serve` adds only the latter.
RUNTIME_STAMP := $(VENV)/.installed-runtime
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: install install-runtime system-deps serve test soak compile-kernels lint clean bench-deps loadtest need-data

# Everything `make test` needs: the runtime, the test tools (the dev and loadtest extras) and the system packages
# that tests start themselves.
install: system-deps $(DEV_STAMP)

# What `make serve` needs: Python packages only (torch, the server, the SDK), nothing from apt, no sudo, no test
# tools (tests/test_make_serve.py holds it so).
install-runtime: $(RUNTIME_STAMP)

# System packages: redis-server, which the Redis session store's tests start on their own (nothing else
# needs to run), and chromium (with a font), which the keyboard page's browser test drives headless through
# playwright (never `playwright install`: the system browser is used), and prometheus (prometheus and promtool),
# which the monitoring assets' tests run against a live server, and nginx, the balancer in front of two servers in
# tests/deploy/test_replicas.py (run by the test itself). apt-get as root, through sudo otherwise.
system-deps:
	@missing=; \
	command -v redis-server >/dev/null || test -x /usr/bin/redis-server || missing="$$missing redis-server"; \
	command -v promtool >/dev/null || test -x /usr/bin/promtool || missing="$$missing prometheus"; \
	test -x /usr/bin/chromium || missing="$$missing chromium fonts-liberation"; \
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || missing="$$missing nginx"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" -eq 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends $$missing; fi

# The SDK (clients/, the adaptlm-client distribution) is named in each install beside the server, which depends on it:
# pip then takes it from here, never from an index.
$(RUNTIME_STAMP): pyproject.toml clients/pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: the CPU build; an unpinned torch could pull a multi-GB CUDA build
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ./clients -e .
	@touch $@

# The test tools. Where the runtime is not installed yet (a fresh clone's `make test`), with it in one pip run: the
# torch pin first, as the runtime's recipe, then the SDK and the server with the extras, which are all the runtime's
# packages too. The runtime's install and then this one would build both editable packages and resolve every
# requirement twice. After `make serve`, only the extras are added.
RUNTIME_DONE := $(shell test -e $(RUNTIME_STAMP) && test -z "$$(find pyproject.toml clients/pyproject.toml Makefile \
	-newer $(RUNTIME_STAMP))" && echo yes)
$(DEV_STAMP): pyproject.toml clients/pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(if $(RUNTIME_DONE),,$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e ./clients -e '.[dev,loadtest]'  # locust: `make loadtest` and its test
	@touch $(RUNTIME_STAMP) $@

# Benchmarks only, not `make test`: Presage (bench/keyboard.py's peer) and 7-Zip (bench/dyneval.py's PPMd).
bench-deps:
	@if [ "$$(id -u)" -eq 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update && $$SUDO apt-get install -y --no-install-recommends presage libpresage-data p7zip-full

# With the in-memory session store, sessions are kept across restarts in var/sessions.zip (written at shutdown).
# A Redis session store (ADAPTLM_SESSION_STORE=redis://...) is a Redis you run (docs/operations.md): nothing is
# installed for it; when none answers at that address, the server says so in one line and exits 3.
serve: install-runtime
	@if [ "$${ADAPTLM_SESSION_STORE:-memory}" = memory ]; then \
		export ADAPTLM_SESSION_SNAPSHOT="$${ADAPTLM_SESSION_SNAPSHOT:-var/sessions.zip}"; fi; \
	exec $(VENV)/bin/adaptlm serve

# Everything but the tests marked slow (pyproject.toml's addopts leave them out), on three workers (its addopts too).
# The repository's modules are compiled first (under a second): where PYTHONDONTWRITEBYTECODE is set, Python never
# writes their bytecode, and each of the tens of Python processes the tests start (servers, the command line,
# torchrun's) would compile those it imports again, 0.3-0.5 s of CPU for a server's.
test: install
	$(PY) -m compileall -q -j 0 adaptlm models kernels server trainer loadtest bench clients >/dev/null
	$(PY) -m pytest -q

# The soak (tests/reliability/test_soak.py, marked slow: the locust mix against a server of SOAK_CHECKPOINT for
# SOAK_S seconds, the server's resident memory after the warm-up must grow < 10%, no failures; its memory curve
# goes to SOAK_OUT/soak_memory.csv and .png). In one process (-n 0): the workers would swallow its progress (-s).
SOAK_S ?= 600
SOAK_OUT ?= docs/img
SOAK_CHECKPOINT ?= checkpoints/default
soak: install
	ADAPTLM_SOAK_S=$(SOAK_S) ADAPTLM_SOAK_OUT=$(SOAK_OUT) ADAPTLM_SOAK_CHECKPOINT=$(SOAK_CHECKPOINT) \
		$(PY) -m pytest -q -s -n 0 -m slow tests/reliability/test_soak.py

# Every Triton kernel compiled for Hopper (sm_90) in each dtype, float32 included (tests/kernels/test_compile.py; no GPU
# needed, about 3 minutes): `make test` compiles bfloat16, the GPU's serving precision, and leaves the rest to this.
compile-kernels: install
	$(PY) -m pytest -q -n 0 -m 'slow or not slow' tests/kernels/test_compile.py

# A headless locust run (loadtest/), its reports in $(LOADTEST_OUT), then the objectives of $(SLO) (your own: a
# copy of loadtest/slo.toml): exits 1 when one is missed. Against URL= when given, else a server started here on a
# free loopback port. CLASSES= runs only those user classes (Scorer Generator Typist OpenAICompletions); default: the
# weighted mix.
USERS ?= 8
RUN_TIME ?= 60s
LOADTEST_OUT ?= var/loadtest
SLO ?= loadtest/slo.toml
loadtest: $(DEV_STAMP)
	$(PY) -m loadtest.run $(if $(URL),--url $(URL)) --users $(USERS) --run-time $(RUN_TIME) --out $(LOADTEST_OUT) --slo $(SLO) $(CLASSES)

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy server clients  # clients/: the SDK's adaptlm_client (mypy_path in pyproject.toml)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

# How checkpoints/default was made (about 4 hours on 2 CPU cores; needs DATA): the preset's 4,000 steps,
# then 95 minutes more from those weights on a fresh schedule (trainer/default_more.toml), its full and sparse dynamic
# evaluation tuned on the first 10 KB of the validation book, and its lexicon. dyneval.json's "session" and "copy"
# sections were chosen on held-out personal text (`python -m bench.session_defaults`, `python -m bench.copy_defaults
# --write`; docs/benchmarks.md) and carried over to the second run's weights with its own eps (the trainer's rule).
# DATA: the corpora directory (`make default-checkpoint DATA=...`, or $ADAPTLM_DATA; docs/benchmarks.md, "The
# corpora"). The texts are not in the repository, so these targets stop (status 2) without it.
DATA ?= $(ADAPTLM_DATA)
DEFAULT_TRAIN := $(filter-out %/austen-persuasion.txt %/chesterton-brown.txt,$(wildcard $(DATA)/gutenberg/*.txt)) \
	$(DATA)/tinyshakespeare/input.txt
need-data:
	@if [ -z "$(DATA)" ] || [ ! -d "$(DATA)" ]; then \
		echo "DATA is not a directory: pass the corpora directory, make $(MAKECMDGOALS) DATA=... (or set ADAPTLM_DATA);" \
			"docs/benchmarks.md, \"The corpora\"" >&2; exit 2; fi
default-checkpoint: need-data install-runtime
	$(VENV)/bin/adaptlm train --preset default --data $(DEFAULT_TRAIN) \
		--valid $(DATA)/gutenberg/austen-persuasion.txt --out runs/default-first --overwrite
	$(VENV)/bin/adaptlm train --preset default --config trainer/default_more.toml --init-from runs/default-first \
		--data $(DEFAULT_TRAIN) --valid $(DATA)/gutenberg/austen-persuasion.txt --out checkpoints/default --overwrite
	rm -rf checkpoints/default/last
	$(VENV)/bin/adaptlm tune --checkpoint checkpoints/default --mode both --bytes 10000 --max-trials 16 \
		--valid $(DATA)/gutenberg/austen-persuasion.txt
	$(MAKE) default-lexicon
# its lexicon.txt (the dictionary prior of its keyboard suggestions, models/lexicon.py): the words of the same text
default-lexicon: need-data
	$(VENV)/bin/python -m trainer.lexicon --data $(DEFAULT_TRAIN) --out checkpoints/default

# How checkpoints/words was made (about an hour on 2 CPU cores; needs DATA): the adaptive-input transformer
# on the default's mix, then its full and sparse dynamic evaluation tuned on the first 10 KB of the validation book
# (as the other shipped checkpoints') and its neural cache on the first 30 KB of the SMS messages (the keyboard
# benchmark types the file's last 20 KB); dyneval.json's "session" section is the grid's choice (docs/notes/2026-11-benchmarks-history.md,
# `python -m bench.session_defaults --checkpoint checkpoints/words --cache`).
words-checkpoint: need-data install-runtime
	$(VENV)/bin/adaptlm train --arch adaptive-transformer --preset small --data $(DEFAULT_TRAIN) \
		--valid $(DATA)/gutenberg/austen-persuasion.txt --out checkpoints/words --overwrite
	rm -rf checkpoints/words/last
	$(VENV)/bin/adaptlm tune --checkpoint checkpoints/words --mode both --bytes 10000 --max-trials 16 \
		--valid $(DATA)/gutenberg/austen-persuasion.txt
	$(VENV)/bin/adaptlm tune --checkpoint checkpoints/words --mode cache --cache-window 1000 --bytes 30000 \
		--valid $(DATA)/messages/sms_ham.train.txt
