"""Megatron flags: parsing, start-up validation in one place, and the lazy import (CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polyrl.cli import build_parser
from polyrl.config import ConfigError, config_from_args, validate


def _cfg(*flags: str, tmp_path=None):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": 2}\n')
    args = build_parser().parse_args(["train", "--train-backend", "megatron", "--hf-checkpoint", str(tmp_path),
                                      "--prompt-data", str(data), "--rm-type", "arithmetic", *flags])
    return config_from_args(args)


def test_megatron_flags_keep_megatron_names(tmp_path):
    cfg = _cfg("--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1", "--context-parallel-size", "2",
               "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-router-topk", "2",
               "--no-use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method", "uniform",
               "--recompute-num-layers", "1", "--use-megatron-fsdp", "--override-ddp-config", "a=1", "b=2",
               "--override-ddp-config", "c=3", tmp_path=tmp_path)
    m = cfg.megatron
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size) == (2, 2, 2)
    assert m.sequence_parallel and m.use_megatron_fsdp and not m.use_distributed_optimizer
    assert m.override_ddp_config == ["a=1", "b=2", "c=3"]  # repeatable


@pytest.mark.parametrize("flags,needle", [
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "needs --pipeline-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible"),
    (["--override-ddp-config", "nonsense"], "expected key=value"),
    (["--recompute-method", "uniform"], "--recompute-granularity full"),
    (["--gradient-checkpointing", "--recompute-granularity", "selective"], "give either, not both"),
    (["--optimizer-cpu-offload", "--no-use-distributed-optimizer"], "--optimizer-cpu-offload needs megatron's distributed"),
    (["--optimizer-cpu-offload", "--use-megatron-fsdp"], "not --use-megatron-fsdp"),
    (["--no-release-grad-buffers", "--use-megatron-fsdp"], "Megatron-FSDP .--use-megatron-fsdp. manages its own"),
])
def test_megatron_degrees_are_validated_at_start_up(tmp_path, flags, needle):
    with pytest.raises(ConfigError, match=needle.replace("+", r"\+").replace("[", r"\[")):
        validate(_cfg(*flags, tmp_path=tmp_path))


def test_megatron_core_is_not_imported_by_polyrl():
    code = ("import sys, polyrl, polyrl.cli, polyrl.backends.megatron.backend, polyrl.backends.megatron.thd, "
            "polyrl.backends.megatron.bridge; print(any(m.startswith('megatron') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_empty_shard_params_get_state_so_every_rank_saves_the_same_keys():
    """Megatron-FSDP DCP saves one collective per optimizer-state key: a rank whose shard of a
    parameter is empty (no grad, so no Adam state) must still hold that key (CPU, plain torch Adam)."""
    import types

    import torch

    from polyrl.backends.megatron.compat import fill_empty_shard_states

    full, empty = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(0))
    adam = torch.optim.Adam([full, empty], lr=0.1)
    full.grad = torch.ones(4)
    adam.step()  # Adam state for `full` only, as on a rank that holds no elements of `empty`
    assert empty not in adam.state
    before = {k: v.clone() for k, v in adam.state[full].items()}
    fill_empty_shard_states(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam)]))
    assert set(adam.state[empty]) == set(adam.state[full]) == {"step", "exp_avg", "exp_avg_sq"}
    assert adam.state[empty]["exp_avg"].numel() == 0 and float(adam.state[empty]["step"]) == 1.0
    assert all(torch.equal(before[k], adam.state[full][k]) for k in before)  # real state untouched
    full.grad = torch.ones(4)
    adam.step()  # the filled state does not disturb the next step


def test_adam_step_is_kept_when_loading_a_fully_reshardable_state():
    """megatron-core 0.19 copies every tensor of a parameter's torch-Adam state from the checkpoint,
    where `step` is left out, and raised KeyError('step'); the shim hands it the restored step."""
    import torch

    from polyrl.backends.megatron.compat import keep_adam_step_on_load

    p = torch.nn.Parameter(torch.zeros(3))
    adam = torch.optim.Adam([p], lr=0.1)
    adam.state[p] = {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}

    class DistOpt:  # the shape of megatron's DistributedOptimizer method (copies dst <- tensors[key])
        def __init__(self):
            self.optimizer, self.model_param_group_index_map = adam, {"model_param": (0, 0)}

        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            group, order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group]["params"][order]
            dst = {"param": main, **{k: v for k, v in self.optimizer.state[main].items() if isinstance(v, torch.Tensor)}}
            for key in dst:
                dst[key].data.copy_(tensors[key])

    opt = DistOpt()
    loaded = {"param": torch.ones(3), "exp_avg": torch.full((3,), 2.0), "exp_avg_sq": torch.full((3,), 3.0)}
    with pytest.raises(KeyError):
        opt._set_main_param_and_optimizer_states("model_param", loaded)
    keep_adam_step_on_load(opt)
    opt._set_main_param_and_optimizer_states("model_param", loaded)
    assert torch.equal(p.data, torch.ones(3)) and float(adam.state[p]["exp_avg_sq"][0]) == 3.0
    assert float(adam.state[p]["step"]) == 7.0
    # the shim is idempotent: a second call does not wrap twice
    keep_adam_step_on_load(opt)
    opt._set_main_param_and_optimizer_states("model_param", loaded)


def test_adam_steps_shared_by_megatron_load_are_untied():
    """megatron-core 0.19 (no Apex / TE) loads one `step` tensor into every parameter's Adam state;
    torch AdamW then advances it once per parameter. After the untie each parameter counts alone,
    and the next update equals the one an optimizer that never went through a checkpoint makes."""
    import types

    import torch

    from polyrl.backends.megatron.compat import untie_adam_steps

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    grads = [[torch.randn(4) for _ in ps] for _ in range(3)]

    def step(opt, params, g):
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()

    ref = torch.optim.AdamW(twin, lr=0.1)
    adam = torch.optim.AdamW(ps, lr=0.1)
    for g in grads[:2]:
        step(ref, twin, g)
        step(adam, ps, g)
    sd = adam.state_dict()
    shared = torch.tensor(2.0)
    for st in sd["state"].values():  # what DistributedOptimizer.load_state_dict does
        st["step"] = shared
    adam.load_state_dict(sd)
    assert len({id(st["step"]) for st in adam.state.values()}) == 1
    untie_adam_steps(types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam)]))
    step(ref, twin, grads[2])
    step(adam, ps, grads[2])
    assert [float(st["step"]) for st in adam.state.values()] == [3.0, 3.0, 3.0]
    for p, q in zip(ps, twin):
        assert torch.equal(p, q)


def test_foreach_grad_kernels_match_the_per_tensor_fallbacks():
    """The multi-tensor stand-ins for Apex's amp_C (grad norm, clip scaling) compute what
    megatron-core's per-tensor fallbacks compute: the L2 norm of all tensors together, and
    dst = src * scale (in place when src is dst)."""
    import torch

    from polyrl.backends.megatron.compat import foreach_l2_norm, foreach_scale

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g) for n in (7, 1, 300)] + [torch.zeros(0)]
    norm, _ = foreach_l2_norm(2048 * 32, None, [ts], False)
    want = torch.linalg.vector_norm(torch.stack([t.norm() for t in ts]))  # megatron: norm of per-tensor norms
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], want, rtol=1e-6, atol=0)
    src = [t.clone() for t in ts]
    dst = [torch.empty_like(t) for t in ts]
    foreach_scale(0, None, [src, dst], 0.25)
    assert all(torch.equal(d, s * 0.25) for d, s in zip(dst, src))
    foreach_scale(0, None, [src, src], 0.5)  # clipping scales the grads in place
    assert all(torch.equal(s, t * 0.5) for s, t in zip(src, ts))


def test_wgrad_accumulation_adds_the_weight_gradient_into_the_main_grad(tmp_path):
    """The stand-in for Apex's wgrad_gemm_accum kernels: main_grad += grad_output^T input, in place (the same-dtype
    path runs here; the BF16-into-FP32 GEMM needs CUDA and is refused elsewhere with its reason). FP32 on both sides:
    the GEMM accumulating into C rounds the same products once each, as the unfused GEMM then add does; the check
    allows FP32 summation order (K = 64 terms of magnitude ~1: 1e-5 relative). --no-gradient-accumulation-fusion
    is a megatron flag, refused with FSDP."""
    import torch

    from polyrl.backends.megatron.compat import wgrad_accumulate, wgrad_accumulation_works

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)
    acc = torch.randn(8, 16, generator=g)
    want = acc + dy.t() @ x
    ptr = acc.data_ptr()
    wgrad_accumulate(x, dy, acc)
    assert acc.data_ptr() == ptr
    torch.testing.assert_close(acc, want, rtol=1e-5, atol=1e-5)
    assert "CUDA" in wgrad_accumulation_works("cpu")
    assert not _cfg("--no-gradient-accumulation-fusion", tmp_path=tmp_path).megatron.gradient_accumulation_fusion
    from conftest import make_model_dir
    make_model_dir(str(tmp_path))
    from polyrl.capabilities import check_setup
    cfg = _cfg("--no-gradient-accumulation-fusion", "--train-backend", "fsdp", tmp_path=tmp_path)
    validate(cfg)
    with pytest.raises(ConfigError, match="--no-gradient-accumulation-fusion is not honoured by --train-backend fsdp"):
        check_setup(cfg, "train")


def test_critic_under_megatron_fsdp_and_the_grad_buffer_switch_are_accepted(tmp_path):
    """PPO's critic runs on Megatron-FSDP (its unused LM output layer is frozen, model.add_value_heads); megatron DDP's
    gradient buffers are released between steps unless --no-release-grad-buffers."""
    from conftest import make_model_dir
    make_model_dir(str(tmp_path))
    cfg = _cfg("--advantage-estimator", "gae", "--use-megatron-fsdp", tmp_path=tmp_path)
    validate(cfg)
    assert cfg.megatron.use_megatron_fsdp and cfg.megatron.release_grad_buffers
    assert not _cfg("--no-release-grad-buffers", tmp_path=tmp_path).megatron.release_grad_buffers
