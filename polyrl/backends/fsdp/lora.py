"""LoRA for the FSDP backend, with the `peft` package (imported here only, and only when --lora-rank > 0).

The adapters are injected into the plain HF module before FSDP wraps it, so the model's own
classes stay in place and FSDP shards base weights and adapters alike (frozen base weights and
trainable adapters share FSDP groups; FSDP2 reduces only the gradients that exist). What leaves
the backend keeps the base model's shape:
- the reference model is the actor with the adapters off (`peft`'s disable_adapter), no copy;
- the weight stream is merged tensors under the base model's HF names (W + scaling * B @ A), so
  every engine and transport takes it unchanged;
- checkpoints hold the adapters and their optimizer state only (the base is re-read from
  --hf-checkpoint on a resume).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from polyrl.config import ConfigError, ModelConfig

BASE = ".base_layer."  # peft keeps the wrapped Linear under this name


def require_peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("--lora-rank needs the peft package: pip install 'polyrl[lora]' (or pip install peft)") from e
    return peft


def add_lora(lm: nn.Module, m: ModelConfig, *, meta: bool):
    """Inject LoRA adapters into `lm` in place; returns the PeftModel around it (kept for disable_adapter and
    save_pretrained; `lm` itself stays the module the backend wraps). meta: build the adapters on the meta device
    (the weights arrive later by broadcast)."""
    peft = require_peft()
    targets = m.lora_targets()
    if getattr(lm.config, "tie_word_embeddings", False) and isinstance(targets, list) and "lm_head" in targets:
        raise ConfigError("--lora-target-modules lm_head: this model ties lm_head to the input embedding, so an adapter on "
                          "it would change the embedding too; leave lm_head out")
    cfg = peft.LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM")
    try:
        model = peft.get_peft_model(lm, cfg, low_cpu_mem_usage=meta)
    except ValueError as e:  # peft names the modules it could not find
        raise ConfigError(f"--lora-target-modules {m.lora_target_modules!r}: {e}") from None
    layers = [mod for mod in lm.modules() if isinstance(mod, peft.tuners.lora.LoraLayer)]
    other = {type(mod).__name__ for mod in layers if not isinstance(mod, peft.tuners.lora.Linear)}
    if other:  # the merged export below knows Linear adapters (W + s * B @ A) only
        raise ConfigError(f"--lora-target-modules {m.lora_target_modules!r} reaches non-Linear modules ({', '.join(sorted(other))}); "
                          "name Linear layers only (e.g. q_proj,k_proj,v_proj,o_proj) or use all-linear")
    return model


@contextlib.contextmanager
def adapters_off(peft_model):
    """The base model: the reference policy of a LoRA run. Flips only each LoRA layer's off switch (what its forward
    reads). peft's own disable_adapter() also sets the adapters' requires_grad to False and back to True; under FSDP2
    with parameters kept unsharded after the forward (one rank), the way back reached the unsharded copies only, so
    the adapters stayed frozen: the first backward found a loss without grad (the CUDA case of
    tests/backends/test_lora.py, and --bf16 on CPU)."""
    peft = require_peft()
    layers = [m for m in peft_model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    was = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, w in zip(layers, was):
            m._disable_adapters = w


def merged_weights(lm: nn.Module, full: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's HF-named tensors with every adapter merged in (W + scaling * B @ A), computed on the fly:
    nothing is merged in place. `full` gathers one parameter (a collective under FSDP: every rank walks the same
    parameters in the same order)."""
    peft = require_peft()
    layers = {name: mod for name, mod in lm.named_modules() if isinstance(mod, peft.tuners.lora.Linear)}
    for name, p in lm.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue  # folded into their base weight
        t = full(p)
        if BASE in name:
            owner, _, leaf = name.partition(BASE)
            if leaf == "weight":
                layer = layers[owner]
                for adapter in layer.active_adapters:
                    a, b = full(layer.lora_A[adapter].weight), full(layer.lora_B[adapter].weight)
                    t = t + layer.scaling[adapter] * (b.to(t.dtype) @ a.to(t.dtype))
            name = f"{owner}.{leaf}"
        yield name, t


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name
