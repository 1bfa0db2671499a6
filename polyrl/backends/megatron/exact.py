"""--true-on-policy on the Megatron backend (TP1): the engine's scoring function over megatron's own parameters.

The mode's guarantee is that the engine and the trainer run one function (polyrl.backends.true_on_policy). A
megatron-core layer is another function: its fused QKV and fc1 GEMMs have other output widths than HF's q/k/v and
gate/up projections (cuBLAS picks its kernel by the width too), and its norm, RoPE and SwiGLU are other op orders. So
in this mode the backend keeps megatron's parameters, optimizer, DDP, checkpoints and weight export, and runs each
actor forward through an HF module shell (true_on_policy.scoring_shell) whose parameters are tensors derived from
megatron's by the bridge's own layout conversion (bridge.mcore_to_hf: slices, splits and reshapes, so differentiable
and exact). The gradient of each derived tensor flows back into megatron's fused parameter, and megatron's DDP hooks
take it from there. The engine's weights come from the same conversion (the weight export), so both sides hold the
same bits and compute the same function.

Pure torch + transformers: megatron-core is never imported here, so the derivation and the shell's arithmetic are
tested on the CPU against an HF model (tests/backends/megatron/test_exact_cpu.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from polyrl.backends import true_on_policy as tp
from polyrl.backends.megatron import bridge

# the dense families whose HF modules the mode proves (as on the FSDP backend: Llama, Qwen2, Qwen3)
FAMILIES = ("llama", "qwen2", "qwen3")


def problem(hf_config: Any, mg: Any) -> str | None:
    """Why --true-on-policy cannot run on the Megatron backend with the checkpoint's config and the Megatron flags
    `mg` (a MegatronConfig), or None. The shell is one HF model over whole parameters: no model parallelism (data
    parallelism is fine: each rank scores its own samples), no Megatron-FSDP (its parameters are data-parallel
    shards), no model but the dense families the mode proves. hf_config None: the flags only."""
    kind = getattr(hf_config, "model_type", None)
    if hf_config is not None and kind not in FAMILIES:
        return (f"model type {kind!r}: on the Megatron backend the mode runs the dense {', '.join(FAMILIES)} families "
                "(the FSDP backend also runs MoE models in it)")
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        if getattr(mg, flag) != 1:
            return (f"--{flag.replace('_', '-')} {getattr(mg, flag)}: the mode scores with one HF module over whole "
                    "parameters (TP1, no model parallelism; data parallelism is fine)")
    if mg.num_layers_per_virtual_pipeline_stage:
        return "--num-layers-per-virtual-pipeline-stage: the mode runs without pipeline stages"
    if mg.sequence_parallel:
        return "--sequence-parallel: the mode runs at TP1"
    if mg.use_megatron_fsdp:
        return "--use-megatron-fsdp: its parameters are data-parallel shards; the mode runs on megatron's DDP"
    if mg.custom_model_provider_path:
        return "--custom-model-provider-path: the mode runs the HF modules of the checkpoint's family, not a custom model"
    if mg.recompute_granularity is not None:
        return (f"--recompute-granularity {mg.recompute_granularity}: megatron's recompute works inside its layers, "
                "which the mode does not run; --gradient-checkpointing recomputes each layer of the scoring function")
    return None


class ExactForward:
    """The actor's forwards of a TP1 megatron model through the scoring function. Each forward binds tensors derived
    from the chunk's parameters into the shell (under autograd in a training pass), scores the micro-batch's
    sequences and returns (log-probs, entropy | None) of their response tokens in the order megatron's log-prob head
    gives them. release() drops the bound tensors (after every pass: nothing of megatron's is held between steps,
    when --offload-train or --release-grad-buffers move or free its storage)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device, *, checkpointing: bool = False):
        self.hf_config, self.device = hf_config, torch.device(device)
        self.lm = tp.scoring_shell(hf_config, dtype, self.device, checkpointing=checkpointing)

    def bind(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> None:
        """megatron (name, parameter) pairs of a whole model (TP1, one stage) -> the shell's parameters."""
        tp.bind_weights(self.lm, dict(bridge.mcore_to_hf(named_parameters, self.hf_config)), "the megatron model")

    def release(self) -> None:
        tp.unbind_weights(self.lm)

    def __call__(self, named_parameters: Iterable[tuple[str, torch.Tensor]], sequences: list[tuple[torch.Tensor, int]],
                 *, temperature: float, with_entropy: bool, training: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """sequences: (host ids [L_i] prompt + response, P_i) of one micro-batch. training: the pass trains (the
        shell's layers then recompute in the backward with --gradient-checkpointing, as the FSDP backend's do)."""
        self.bind(named_parameters)
        self.lm.train(training)
        return tp.sequences_logprobs(self.lm, tp.sequences_to_device(sequences, self.device),
                                     temperature=temperature, with_entropy=with_entropy)
