"""FSDP2 backend on CUDA (BF16): varlen packing, micro-batch invariance, offload, 2 GPUs == 1.

Run with `make test-gpu`. BF16 tolerances: log-probs of a 2-layer model agree to a mean
absolute difference below 0.02 (max 0.1); grad norms to 2% relative.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from conftest import make_model_dir

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import fixed_batch  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with make test-gpu on a GPU machine)")


def _backend(model_dir, attn="auto", offload_train=False, compile=None, **batch):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    init_distributed("cuda")
    return FSDPBackend(ModelConfig(hf_checkpoint=model_dir, attn_implementation=attn, offload_train=offload_train,
                                   compile=compile), OptimizerConfig(lr=1e-3),
                       BatchConfig(**batch), device="cuda")


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("gpu_qwen3"), arch="qwen3", hidden=128, layers=2)


@gpu
@pytest.mark.gpu
def test_varlen_packed_logprobs_match_per_sample_forward(gpu_model):
    from transformers import AutoModelForCausalLM
    be = _backend(gpu_model, micro_batch_size=8)
    assert be.attn_impl == "varlen"
    batch = fixed_batch()
    packed = be.compute_logprobs(batch)
    ref = AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.bfloat16).cuda().eval()
    diffs = []
    with torch.no_grad():
        for ids, p, lp in zip(batch.input_ids, batch.prompt_lens, packed):
            logits = ref(ids[None].cuda()).logits[0, p - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, ids[p:, None].cuda()).squeeze(-1).cpu()
            diffs.append((lp - want).abs())
    d = torch.cat(diffs)
    assert d.mean() < 0.02 and d.max() < 0.1, (d.mean(), d.max())


@gpu
@pytest.mark.gpu
def test_varlen_and_masked_sdpa_and_micro_batching_agree(gpu_model):
    from polyrl.algorithms.losses import LossSettings, rl_loss
    loss_fn = functools.partial(rl_loss, s=LossSettings())
    norms = []
    for attn, mbs in (("varlen", 8), ("varlen", 3), ("sdpa", 8)):
        be = _backend(gpu_model, attn=attn, micro_batch_size=mbs)
        norms.append(be.train_step(fixed_batch(), loss_fn)["grad_norm"])
        del be
    assert norms[0] > 0
    for n in norms[1:]:
        assert n == pytest.approx(norms[0], rel=0.02)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["varlen", "sdpa", "eager"])
def test_packing_a_micro_batch_does_not_sync_the_host(attn):
    """pack() builds everything on the host and moves it in pinned, asynchronous copies: no device-to-host read (one
    would stall the host until the previous micro-batch's backward finished), the dense attention masks included."""
    from polyrl.backends.fsdp.backend import pack
    ids = [torch.arange(n) % 50 for n in (7, 12, 5)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids_d, pos, mask, gidx, tgt, seq, varlen = pack(ids, [3, 4, 2], attn, "cuda", torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (mask is None) == (attn == "varlen")
    if mask is not None:  # block-diagonal causal: token 8 (2nd of sequence 1) sees tokens 7-8 only
        allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0
        assert allowed[8].nonzero().flatten().tolist() == [7, 8]
    assert tgt.tolist() == torch.cat([x[p:] for x, p in zip(ids, [3, 4, 2])]).tolist()


@gpu
@pytest.mark.gpu
def test_compiled_default_equals_eager(gpu_model):
    """CUDA compiles by default (decoder layers + log-prob chunk): same log-probs, loss and grad norm as eager within
    the BF16 tolerances above (compiled kernels fuse and reorder bf16 roundings; the arithmetic is the same), and the
    exported weights after the step agree to Adam's lr-sized move (lr 1e-3 x 1 step, plus bf16 rounding of a weight)."""
    from polyrl.algorithms.losses import LossSettings, rl_loss
    loss_fn = functools.partial(rl_loss, s=LossSettings())
    out = {}
    for c in (True, False):
        be = _backend(gpu_model, compile=None if c else False, micro_batch_size=3)
        assert be.mcfg.compiled("cuda", "qwen3") is c
        lp = torch.cat(be.compute_logprobs(fixed_batch()))
        m = be.train_step(fixed_batch(), loss_fn)
        out[c] = lp, m, {n: t.float().cpu() for n, t in be.export_weights()}
        del be
    d = (out[True][0] - out[False][0]).abs()
    assert d.mean() < 0.02 and d.max() < 0.1, (d.mean(), d.max())
    assert out[True][1]["grad_norm"] == pytest.approx(out[False][1]["grad_norm"], rel=0.02)
    assert out[True][1]["loss"] == pytest.approx(out[False][1]["loss"], abs=0.02)
    for n, w in out[False][2].items():
        assert (out[True][2][n] - w).abs().max() <= 2e-3 + 1e-2 * w.abs().max(), n


@gpu
@pytest.mark.gpu
def test_offload_frees_gpu_memory_and_onload_restores(gpu_model):
    from polyrl.algorithms.losses import LossSettings, rl_loss
    be = _backend(gpu_model, offload_train=True, micro_batch_size=8)
    be.train_step(fixed_batch(), functools.partial(rl_loss, s=LossSettings()))
    torch.cuda.synchronize()
    state_bytes = sum(p.to_local().numel() * p.element_size() for p in be.model.parameters())
    state_bytes += sum(v.numel() * v.element_size() for st in be.optimizer.state.values() for v in st.values()
                       if torch.is_tensor(v) and v.is_cuda)
    before = torch.cuda.memory_allocated()
    be.offload()
    after = torch.cuda.memory_allocated()
    assert before - after >= 0.9 * state_bytes, (before, after, state_bytes)  # params + Adam moments left the GPU
    assert all(p.to_local().device.type == "cpu" for p in be.model.parameters())
    be.onload()
    m = be.train_step(fixed_batch(), functools.partial(rl_loss, s=LossSettings()))
    assert m["skipped_step"] == 0


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tied", [True, False])
def test_direct_push_into_the_gpu_engine_equals_the_named_stream(tmp_path, tied):
    """The colocated push (InMemoryTransport -> export's copy_into -> the engine's flat buffer, polyrl.weight_sync.direct)
    leaves the engine's buffer bit-identical to loading the named stream one tensor at a time (both cast the same FP32
    values to BF16), after a train step changed the weights, again after an offload/onload moved the parameters (the
    cached sources are rebuilt), and while the trainer is offloaded (the stream is taken instead)."""
    from polyrl.algorithms.losses import LossSettings, rl_loss
    from polyrl.rollout.gpu.engine import GPUEngine
    from polyrl.weight_sync import InMemoryTransport
    d = make_model_dir(tmp_path, arch="qwen3", hidden=128, layers=2, tied=tied)
    be = _backend(d, offload_train=True, micro_batch_size=8)
    eng = GPUEngine(d, dtype=torch.bfloat16, mem_fraction=0.05, max_batch=8)
    ref = torch.empty_like(eng.model.flat)

    def check(version):
        nbytes = InMemoryTransport().push(be.export_weights(), eng, version)
        got = eng.model.flat.clone()
        eng.model.flat.copy_(ref)  # anything: the named load below must rewrite every weight
        eng.model.load(be.export_weights(), strict=True)
        for n, v in eng.model.hf.items():
            assert torch.equal(got[v.data_ptr() // 2 - eng.model.flat.data_ptr() // 2:][:v.numel()].view(v.shape), v), n
        assert nbytes >= sum(p.numel() for p in be.model.parameters()) * 2 * 0.99
        assert eng.version == version

    loss = functools.partial(rl_loss, s=LossSettings())
    check(1)
    be.train_step(fixed_batch(), loss)
    check(2)
    torch.cuda.synchronize()
    param_bytes = sum(p.to_local().numel() * p.element_size() for p in be.model.parameters())
    before = torch.cuda.memory_allocated()
    be.offload()  # the direct copy's cached source views must not keep the parameters' GPU storage alive
    assert before - torch.cuda.memory_allocated() >= 0.9 * param_bytes
    InMemoryTransport().push(be.export_weights(), eng, 3)  # sources on the host: the named stream path
    be.onload()
    be.train_step(fixed_batch(), loss)
    check(4)
    before, flat_bytes = torch.cuda.memory_allocated(), eng.model.nbytes
    eng.sleep()  # nor the engine's buffer: a sleeping engine frees it
    assert before - torch.cuda.memory_allocated() >= 0.9 * flat_bytes
    eng.wake()
    check(5)  # a new engine buffer: a new plan


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_match_one_gpu_nccl(gpu_model, tmp_path):
    from test_fsdp_equivalence import run_worker
    one = run_worker(gpu_model, str(tmp_path / "one.pt"), 1, "--device", "cuda")
    two = run_worker(gpu_model, str(tmp_path / "two.pt"), 2, "--device", "cuda")
    for (la, ga, _), (lb, gb, _) in zip(one["losses"], two["losses"]):
        assert ga == pytest.approx(gb, rel=0.02)
    # BF16 gradients reduced in another order can flip the sign of near-zero gradient entries, and
    # Adam turns such an entry into a full +-lr step: compare the bulk, and bound the outliers.
    for k in one["weights"]:
        d = (one["weights"][k] - two["weights"][k]).abs()
        assert d.mean() < 2e-3, (k, d.mean())
        assert (d > 1e-2).float().mean() < 0.01, (k, (d > 1e-2).float().mean())
