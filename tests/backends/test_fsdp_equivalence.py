"""FSDP2 backend equivalence on CPU: packing, ranks, resume, offload, micro-batching.

Multi-rank cases run tests/backends/fsdp_worker.py as gloo ranks (tests/ranks.py). Tolerances follow
from the arithmetic (fp32 on CPU), not from one machine's rounding:
- Runs that do the same arithmetic in the same order (resume on the same world size, CPU offload
  on the same ranks) agree to ~1 ulp (atol 1e-6).
- Runs that sum in another order (2 ranks vs 1, micro-batch splits, packed vs padded rows) start
  from the same weights, so the first step's loss, grad norm, entropy and every gradient element
  agree at rounding level (ROUND, relative to the tensor's largest element: ~100 fp32 ulps for
  sums over tens of tokens through two layers of matmuls, where a wrong step is off by O(1)).
- Their weights after Adam steps are NOT comparable at rounding level: Adam divides by
  sqrt(v) + eps, so an element whose gradient is itself at rounding level (~1e-8 here, eps 1e-8)
  moves by anything up to lr on one run and differently on the other (1.65e-4 on one element
  with lr 1e-2 on an AMD EPYC). What holds is Adam's own bound (adam_update_bound), and each
  run's weights are checked to be exactly AdamW applied to the gradients that run recorded.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import pytest
import torch

from conftest import make_model_dir
from ranks import run_ranks

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_worker.py")
sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import OPTIM, fixed_batch  # noqa: E402

from polyrl.config import OptimizerConfig  # noqa: E402

ROUND = 1e-5  # rounding level of one step's sums in fp32 (see the module docstring)


_RUNS: dict[tuple, dict] = {}  # runs of a module's tests that share a setting (the worker is deterministic)


def run_worker(model: str, out: str, nproc: int = 1, *args: str) -> dict:
    """The worker's record of `nproc` ranks on `model` with `args`, run once per setting in this process: the worker is
    deterministic, and no test changes a record it gets."""
    key = (model, nproc, args)
    if key not in _RUNS:
        _RUNS[key] = _run_worker(model, out, nproc, *args)
    return _RUNS[key]


def _run_worker(model: str, out: str, nproc: int = 1, *args: str) -> dict:
    argv, env = [WORKER, model, out, *args], {**os.environ, "OMP_NUM_THREADS": "1"}
    res = run_ranks(argv, nproc, env, timeout=300)
    if res.returncode != 0 and "terminate called without an active exception" in res.stderr:
        # gloo's teardown on a loaded 2-core machine occasionally aborts a rank at exit, after the
        # work is done; one retry tells that apart from a real failure, which repeats
        res = run_ranks(argv, nproc, env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def adam_update_bound(t: int, beta1: float, beta2: float) -> float:
    """max |m_hat / sqrt(v_hat)| at Adam step t, over every gradient history. m_hat = sum a_i g_i and
    v_hat = sum b_i g_i^2 (bias-corrected moving averages), so by Cauchy-Schwarz |m_hat| <=
    sqrt(sum a_i^2 / b_i) * sqrt(v_hat): one step moves an element by at most lr times this
    (1 at t=1, where the update is lr * g / (|g| + eps); 1.0014 at t=2), whatever clipping did to g."""
    a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b)))


def assert_identical(a: dict, b: dict) -> None:
    """Same arithmetic in the same order: ~1 ulp."""
    assert [x for step in a["losses"] for x in step] == pytest.approx([x for step in b["losses"] for x in step], rel=1e-6, abs=1e-7)
    for k in a["weights"]:
        torch.testing.assert_close(a["weights"][k], b["weights"][k], atol=1e-6, rtol=0)


def assert_equivalent(a: dict, b: dict) -> None:
    """The same steps from the same weights, summed in another order (module docstring)."""
    assert len(a["losses"]) == len(b["losses"]) and a["start"] == b["start"]
    for i, ((la, ga, ea), (lb, gb, eb)) in enumerate(zip(a["losses"], b["losses"])):
        # after the first step the runs stand on weights that differ (bounded below), most on the elements
        # whose gradient is ~0, which barely move the loss: 1e-4 is ~50x the spread seen across CPUs
        rel = ROUND if i == 0 else 1e-4
        assert (la, ga, ea) == pytest.approx((lb, gb, eb), rel=rel, abs=1e-7), f"step {i}"
    ga, gb = a["grads"][0], b["grads"][0]
    assert ga.keys() == gb.keys() == a["weights"].keys() == b["weights"].keys()
    for k in ga:
        torch.testing.assert_close(gb[k], ga[k], rtol=ROUND, atol=ROUND * float(ga[k].abs().max()), msg=lambda m: f"{k}: {m}")
    o = OptimizerConfig(**OPTIM)
    assert o.weight_decay == 0 and o.lr_decay_style == "constant" and o.lr_warmup_steps == 0  # the bound assumes these
    steps = range(a["start"] + 1, a["start"] + len(a["losses"]) + 1)
    # each run moves an element by at most lr * bound per step from the common start, so the two are
    # at most twice that apart
    bound = 2 * o.lr * sum(adam_update_bound(t, o.adam_beta1, o.adam_beta2) for t in steps)
    for k in a["weights"]:
        worst = float((a["weights"][k] - b["weights"][k]).abs().max())
        assert worst <= bound, f"{k}: weights differ by {worst:.3g} > Adam's bound {bound:.3g}"
    for run in (a, b):
        if run["start"] == 0:
            assert_weights_are_adamw_of_grads(run)


def assert_weights_are_adamw_of_grads(run: dict) -> None:
    """The run's final weights are AdamW (the worker's settings) applied, step by step, to the gradients
    that run recorded: elementwise arithmetic, the same up to ~1 ulp (vectorized vs scalar loop tails),
    so a wrong shard, gather or optimizer state shows up here however loose Adam's bound is."""
    o = OptimizerConfig(**OPTIM)
    params = {k: v.clone().requires_grad_(True) for k, v in run["init"].items()}
    opt = torch.optim.AdamW(list(params.values()), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay, foreach=False)
    for grads in run["grads"]:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
    for k, p in params.items():
        torch.testing.assert_close(run["weights"][k], p.detach(), atol=1e-6, rtol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("history", ["extremal", "tiny_then_large", "large_then_tiny", "alternating", "random"])
def test_adam_update_bound_holds_and_is_tight(history):
    """torch's AdamW never moves an element by more than lr * adam_update_bound(t) at step t, and
    the bound is attained (Cauchy-Schwarz's equality case, g_i proportional to a_i / b_i, is a
    gradient growing by beta2 / beta1 per step): the weight bound above is the real one."""
    o = OptimizerConfig(**OPTIM)
    g = torch.Generator().manual_seed(0)
    n, steps = 4096, 6
    scale = {"extremal": lambda t: (o.adam_beta2 / o.adam_beta1) ** t, "tiny_then_large": lambda t: 10.0 ** (t - 3),
             "large_then_tiny": lambda t: 10.0 ** (3 - t), "alternating": lambda t: (-1) ** t * 10.0 ** (t % 2),
             "random": lambda t: 1.0}[history]
    signs = torch.randn(n, generator=g).sign()
    w = torch.zeros(n, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=0.0)
    for t in range(1, steps + 1):
        before = w.detach().clone()
        w.grad = scale(t) * (signs if history == "extremal" else torch.randn(n, generator=g))
        opt.step()
        moved = float((w.detach() - before).abs().max())
        bound = o.lr * adam_update_bound(t, o.adam_beta1, o.adam_beta2)
        assert moved <= bound * (1 + 1e-5), (t, moved, bound)
        if t == 1 or history == "extremal":
            assert moved >= bound * (1 - 1e-5), (t, moved, bound)


@pytest.fixture(scope="module", params=["qwen2-tied", "llama-untied", "qwen3-tied"])
def arch_model(request, tmp_path_factory, tiny_model):
    if request.param == "qwen2-tied":  # tiny_model is that one (make_model_dir's defaults): its runs are shared below
        return tiny_model
    arch, tie = request.param.split("-")
    return make_model_dir(tmp_path_factory.mktemp(request.param), arch=arch, tied=tie == "tied")


@pytest.mark.slow
def test_two_ranks_match_one_rank(arch_model, tmp_path):
    one = run_worker(arch_model, str(tmp_path / "one.pt"), 1)
    two = run_worker(arch_model, str(tmp_path / "two.pt"), 2)
    assert len(one["losses"]) == 2
    assert one["losses"][0][1] > 0  # a real gradient flowed
    assert_equivalent(one, two)


@pytest.mark.slow
def test_resume_matches_uninterrupted_also_on_other_world_size(tiny_model, tmp_path):
    full = run_worker(tiny_model, str(tmp_path / "full.pt"), 1, "--steps", "4")
    run_worker(tiny_model, str(tmp_path / "a.pt"), 1, "--steps", "2", "--save", str(tmp_path / "ckpt"))
    same_ws = run_worker(tiny_model, str(tmp_path / "b.pt"), 1, "--steps", "2", "--load", str(tmp_path / "ckpt"))
    other_ws = run_worker(tiny_model, str(tmp_path / "c.pt"), 2, "--steps", "2", "--load", str(tmp_path / "ckpt"))
    assert_weights_are_adamw_of_grads(full)
    tail = {"losses": full["losses"][2:], "grads": full["grads"][2:], "weights": full["weights"], "start": 2}
    assert_identical(tail, same_ws)
    assert_equivalent(tail, other_ws)


@pytest.mark.slow
def test_cpu_offload_matches_no_offload(tiny_model, tmp_path):
    plain = run_worker(tiny_model, str(tmp_path / "p.pt"), 2)
    off = run_worker(tiny_model, str(tmp_path / "o.pt"), 2, "--offload")
    assert_identical(plain, off)


def test_micro_batch_split_does_not_change_the_step(tiny_model, tmp_path):
    whole = run_worker(tiny_model, str(tmp_path / "w.pt"), 1)  # the worker's default: one micro-batch of all 8
    split = run_worker(tiny_model, str(tmp_path / "s.pt"), 1, "--micro-batch-size", "3")
    dynamic = run_worker(tiny_model, str(tmp_path / "d.pt"), 1, "--dynamic", "24")
    packed = run_worker(tiny_model, str(tmp_path / "p.pt"), 1, "--dynamic", "24", "--layout", "packed")
    assert_equivalent(whole, split)
    assert_equivalent(whole, dynamic)
    assert_equivalent(whole, packed)


def _backend(model_dir: str, **batch):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    init_distributed("cpu")
    return FSDPBackend(ModelConfig(hf_checkpoint=model_dir), OptimizerConfig(lr=1e-2), BatchConfig(**batch), device="cpu")


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_packed_logprobs_equal_unpadded_per_sample_forward(tiny_llama_untied, layout):
    """Packing 8 samples into one row (block-diagonal mask, restarted positions), or into
    right-padded rows, gives the logprobs of running each sample alone through the plain HF
    model; tolerance 1e-5 (fp32)."""
    from transformers import AutoModelForCausalLM
    be = _backend(tiny_llama_untied, micro_batch_size=8, micro_batch_layout=layout)
    assert be.layout == layout
    batch = fixed_batch()
    packed = be.compute_logprobs(batch, temperature=0.7)
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_untied).eval()
    with torch.no_grad():
        for ids, p, lp in zip(batch.input_ids, batch.prompt_lens, packed):
            logits = ref(ids[None]).logits[0, p - 1:-1].float() / 0.7
            want = torch.log_softmax(logits, -1).gather(-1, ids[p:, None]).squeeze(-1)
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


def test_nan_loss_is_skipped_and_weights_untouched(tiny_model):
    from polyrl.algorithms.losses import LossSettings, rl_loss
    be = _backend(tiny_model, micro_batch_size=8)
    before = {n: t.clone() for n, t in be.export_weights()}
    batch = fixed_batch()
    batch.token_fields["advantages"][0][0] = float("nan")
    m = be.train_step(batch, functools.partial(rl_loss, s=LossSettings()))
    assert m["skipped_step"] == 1.0 and be.skipped_steps == 1
    for n, t in be.export_weights():
        assert torch.equal(t, before[n]), n
    assert all(not s for s in be.optimizer.state.values())  # Adam moments untouched too
    batch.token_fields["advantages"][0][0] = 1.0
    m = be.train_step(batch, functools.partial(rl_loss, s=LossSettings()))
    assert m["skipped_step"] == 0.0
    assert any(not torch.equal(t, before[n]) for n, t in be.export_weights())


def test_save_hf_loads_with_from_pretrained(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    be = _backend(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    be.save_hf(str(tmp_path / "hf"), tok)
    m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    exported = dict(be.export_weights())
    for n, p in m.named_parameters():
        torch.testing.assert_close(p, exported[n], atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).eos_token == tok.eos_token


def test_export_weights_yields_each_tied_tensor_once(tiny_model):
    be = _backend(tiny_model)
    names = [n for n, _ in be.export_weights()]
    assert len(names) == len(set(names))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


@pytest.mark.parametrize("chunk_bytes", [256 * 2**20, 4096])
def test_sharded_export_equals_per_parameter_full_tensors(tiny_model, monkeypatch, chunk_bytes):
    """The batched export (one flat copy per FSDP unit chunk) yields exactly the per-parameter full tensors, each tied
    tensor once, and its views stay valid after the unit is resharded (a transport holds a whole bucket). A sharded
    one-rank model on CPU: --fsdp-cpu-offload keeps FSDP on; a 4 KiB chunk splits every unit into many copies. Exact
    equality: the export only copies fp32 bytes."""
    import polyrl.backends.fsdp.backend as fb
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from torch.distributed.tensor import DTensor
    monkeypatch.setattr(fb, "EXPORT_CHUNK_BYTES", chunk_bytes)
    init_distributed("cpu")
    be = FSDPBackend(ModelConfig(hf_checkpoint=tiny_model, fsdp_cpu_offload=True), OptimizerConfig(), BatchConfig(),
                     device="cpu")
    want = {n: p.full_tensor() for n, p in be.model.lm.named_parameters()}
    assert all(isinstance(p, DTensor) for p in be.model.parameters())
    got = list(be.export_weights())  # all held at once, as a bucket would
    assert sorted(n for n, _ in got) == sorted(want)  # unit by unit: the root's (embedding, final norm) together
    for n, t in got:
        assert torch.equal(t, want[n]), n
