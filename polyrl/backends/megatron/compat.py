"""megatron-core 0.19 as polyrl runs it (torch only: no Apex, no Transformer Engine) has a few
gaps on that path; each shim here closes one, with the measurement that found it. Nothing here
imports megatron-core at module level, so every shim is tested on CPU
(tests/backends/megatron/test_megatron_config_cpu.py).

- checkpoints: `fill_empty_shard_states` (Megatron-FSDP DCP save hung at DP > 1),
  `keep_adam_step_on_load` (KeyError('step') loading a fully-reshardable optimizer state),
  `untie_adam_steps` (the load shares one `step` tensor across parameters);
- speed: `use_foreach_grad_kernels` (the grad norm synced the host once per parameter),
  `use_fused_adam` (torch's multi-tensor AdamW instead of the fused kernel),
  `use_wgrad_accumulation` (Apex's gradient-accumulation fusion: each weight gradient accumulated by its GEMM into
  the FP32 main grad, not written in BF16 and added).
"""

from __future__ import annotations

from typing import Iterator

import torch


def inner_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's (chained) optimizer: each member wraps one as `.optimizer`."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "optimizer", None) is not None:
            yield opt.optimizer


def fill_empty_shard_states(optimizer) -> None:
    """Megatron-FSDP: a parameter whose local shard is empty on this rank never gets Adam state
    here, but DCP's uneven-DTensor save / load runs one collective per key on every rank (with
    DP=2 on the tiny test model the ranks held 56 vs 74 keys and the save hung). Give such
    parameters empty state so every rank holds the same keys. `optimizer`: megatron's (chained)
    optimizer, whose members wrap a torch optimizer as `.optimizer`."""
    for inner in inner_optimizers(optimizer):
        steps = [st["step"] for st in inner.state.values() if "step" in st]
        for group in inner.param_groups:
            for p in group["params"]:
                if getattr(p, "_local_tensor", p).numel() == 0 and not inner.state.get(p):
                    inner.state[p] = {"step": steps[0].clone() if steps else torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def untie_adam_steps(optimizer) -> None:
    """megatron-core 0.19 without Apex / TE: DistributedOptimizer.load_state_dict hands every
    parameter's Adam state the *same* `step` tensor; torch AdamW then adds 1 to it once per
    parameter, so after a resume the bias correction runs as if hundreds of steps had passed
    (the second loss after resume moved 0.27%). Give each parameter its own copy."""
    for inner in inner_optimizers(optimizer):
        seen: set[int] = set()
        for st in inner.state.values():
            step = st.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    st["step"] = step.clone()
                seen.add(id(st["step"]))


def keep_adam_step_on_load(opt) -> None:
    """megatron-core 0.19 + torch AdamW (no Apex / TE): loading a `fully_reshardable` optimizer
    state restores Adam's `step` from the param groups, then copies every tensor of each
    parameter's state from the checkpoint, where `step` was left out on purpose, and fails
    with KeyError('step'). Hand it the already-restored step for that copy (a no-op)."""
    if not hasattr(opt, "_set_main_param_and_optimizer_states") or "_set_main_param_and_optimizer_states" in vars(opt):
        return
    original = opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        step = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]].get("step")
        if isinstance(step, torch.Tensor) and "step" not in tensors:
            tensors = {**tensors, "step": step}
        return original(model_param, tensors)

    opt._set_main_param_and_optimizer_states = set_states


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for amp_C.multi_tensor_l2norm: ([1] fp32 L2 norm of every tensor together, None)."""
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))).float().reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for amp_C.multi_tensor_scale: dst = src * scale, tensor by tensor."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def use_foreach_grad_kernels() -> None:
    """Without Apex / TE megatron-core's grad norm and clipping are per-tensor Python loops (the norm
    syncs the host once per parameter: 340 times a step on a 28-layer model); put torch's
    multi-tensor kernels in their place, the role Apex's amp_C plays."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for mod in (clip_grads, moptimizer):
        if mod.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = foreach_scale


def use_fused_adam(optimizer) -> None:
    """megatron-core steps torch's AdamW (no Apex / TE) in its default multi-tensor mode: 41 ms
    per step on a 1.5B model on an H100 against 16 ms fused (the FSDP backend's). Switch plain-
    tensor CUDA param groups to the fused kernel (its `step` counters live on the device); again
    after a checkpoint load, whose param groups come from the file."""
    for inner in inner_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda and type(p.data) is torch.Tensor for p in params):
            continue  # DTensors (Megatron-FSDP) and CPU-offloaded groups keep torch's default
        for g in inner.param_groups:
            g["fused"], g["foreach"] = True, False
        for p in params:
            st = inner.state.get(p)
            if st and isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].to(device=p.device, dtype=torch.float32)


def wgrad_accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Drop-in for Apex's fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 / _fp16: main_grad += grad_output^T
    total_input by one GEMM whose epilogue adds into main_grad in main_grad's dtype (BF16 inputs into an FP32 main
    grad through torch's mixed-precision addmm), instead of a BF16 weight gradient written, read back and added."""
    a, b = grad_output.t(), total_input
    if a.dtype == main_grad.dtype:
        main_grad.addmm_(a, b)
    else:
        torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)


def wgrad_accumulation_works(device) -> str | None:
    """None if wgrad_accumulate runs here (CUDA, a torch with addmm's out_dtype), else why not."""
    if torch.device(device).type != "cuda":
        return "its fused GEMM needs CUDA"
    try:
        x = torch.ones(4, 8, dtype=torch.bfloat16, device=device)
        g = torch.ones(4, 2, dtype=torch.bfloat16, device=device)
        acc = torch.ones(2, 8, dtype=torch.float32, device=device)
        wgrad_accumulate(x, g, acc)
    except (RuntimeError, TypeError) as e:  # an older torch: no out_dtype overload of addmm on CUDA
        return f"torch.addmm(out_dtype=float32) failed: {e}"
    if not bool((acc == 5).all()):
        return "torch.addmm(out_dtype=float32) gave a wrong sum"
    return None


def use_wgrad_accumulation() -> None:
    """Let megatron-core's linears take their gradient-accumulation-fusion path without Apex: its layers module
    imports `fused_weight_gradient_mlp_cuda` at its own import (absent here) and checks `_grad_accum_fusion_available`;
    wgrad_accumulate stands in for both of Apex's kernels. A real Apex stays. (megatron's deferred embedding wgrad,
    which imports the module inside utils, is a pipeline option polyrl does not set.)"""
    import types

    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return
    shim = types.SimpleNamespace(wgrad_gemm_accum_fp32=wgrad_accumulate, wgrad_gemm_accum_fp16=wgrad_accumulate)
    layers.fused_weight_gradient_mlp_cuda = shim
    layers._grad_accum_fusion_available = True
