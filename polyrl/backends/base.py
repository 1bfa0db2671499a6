"""TrainBackend protocol, lazy backend table and the micro-batch planner they share."""

from __future__ import annotations

import importlib
import math
from concurrent.futures import Future
from typing import Callable, Iterable, Protocol

import torch

from polyrl.types import TrainBatch


def to_device(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors to `device` without a host sync: pinned (the caching host allocator reuses the pages) and
    non-blocking, so the copies queue behind the GPU work already launched. On CPU: the tensors themselves."""
    if torch.device(device).type != "cuda":
        return list(tensors)
    return [t.pin_memory().to(device, non_blocking=True) for t in tensors]


# name -> "module:Class"; imported only when chosen, so megatron-core stays optional.
BACKENDS = {
    "fsdp": "polyrl.backends.fsdp.backend:FSDPBackend",
    "megatron": "polyrl.backends.megatron.backend:MegatronBackend",
}

# What each backend honours (polyrl/capabilities.py maps flags to these; a flag whose capability the chosen backend lacks
# is refused at start-up). Declared here, not on the classes, so validation reads them without importing megatron-core.
BACKEND_CAPABILITIES: dict[str, frozenset[str]] = {
    "fsdp": frozenset({
        "offload",  # offload()/onload() move params, grads and optimizer state off the GPU (--offload-train)
        "cpu_offload_optimizer",  # FSDP2's CPUOffloadPolicy (--fsdp-cpu-offload)
        "gradient_checkpointing", "compile", "attn_implementation", "micro_batch_layout",
        "lora", "critic", "opd_teacher", "routing_replay", "moe_aux_losses",
        "images",  # vision-language HF models: pixel inputs and multimodal RoPE in the log-prob forward
        "true_on_policy",  # packed fixed-block forwards through polyrl.backends.true_on_policy (CPU FP32, CUDA BF16/FP32)
        "mtp_training",  # --enable-mtp-training: the MTP layers' loss beside the policy loss (polyrl.backends.fsdp.mtp)
        "save_without_optimizer",  # --no-save-optim: save(path, optimizer=False); load() of such a checkpoint
        "async_save",  # --async-save: save(path, background=True) copies the state and writes it on a thread
    }),
    "megatron": frozenset({
        "megatron_parallelism",  # TP/PP/VPP/CP/EP, recompute, Megatron-FSDP, custom model provider, optimizer CPU offload
        "offload",  # offload()/onload() empty weights, main params, grad buffers and Adam state to pinned host memory
        "gradient_checkpointing",  # megatron's full recompute of every layer
        "compile",  # polyrl's RMSNorms and RoPE in megatron's layers under torch.compile (megatron/compiled.py)
        "critic", "opd_teacher", "routing_replay", "moe_aux_losses",
        "lora",  # adapters on the column / row-parallel linears (polyrl/backends/megatron/lora.py)
        "images",  # Qwen2.5-VL: the HF vision tower on the first stage, its features in the decoder input (vision.py)
        "mtp_training",  # --enable-mtp-training: megatron-core's MTP block, polyrl's MTP loss (megatron/mtp.py)
        # TP1: the scoring function over megatron's parameters (polyrl/backends/megatron/exact.py)
        "true_on_policy",
    }),
}

LossFn = Callable[..., tuple[torch.Tensor, dict]]


class TrainBackend(Protocol):
    def compute_logprobs(self, batch: TrainBatch, *, model: str = "actor", temperature: float = 1.0) -> list[torch.Tensor]:
        """Per-response-token log-probs, one [R_i] tensor per sample. model: "actor", "ref" (the reference model) or
        "teacher" (--opd-teacher-load, built with need_teacher=True)."""

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """A backend built with role="critic" (PPO's critic, --advantage-estimator gae): the value of the state before
        each response token, one [R_i] tensor per sample. Its train_step hands loss_fn these values in place of
        log-probs; save/load/offload/onload/save_hf work on the critic as they do on the actor."""

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, temperature: float = 1.0, with_entropy: bool = False) -> dict[str, float]:
        """One optimizer step over `batch` (this rank's share); returns reduced metrics."""

    def export_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time. May be a polyrl.weight_sync.WeightExport, whose `copy_into(views)`
        lets an engine in the same process take the weights straight into its own buffers."""

    def save(self, path: str, *, optimizer: bool = True, background: bool = False) -> "Future | None":
        """A checkpoint of this backend under `path`; optimizer=False (--no-save-optim, where the backend declares
        save_without_optimizer) leaves the optimizer state out, and load() of it keeps a fresh optimizer.
        background=True (--async-save, where it declares async_save): the state is copied to host memory before it
        returns (training may go on at once) and written on a thread; the Future completes when the files are written."""

    def load(self, path: str) -> None: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...

    def sync_ref_from_actor(self) -> None:
        """Copy the actor's weights into the reference model (--ref-update-interval)."""

    def save_hf(self, path: str, tokenizer=None, *, adapter: bool = False) -> None:
        """Write the actor as an HF directory (--save-hf); with LoRA the adapters merged in, or (adapter=True,
        --save-hf-adapter) a peft adapter directory instead."""


def load_backend_class(name: str):
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"--train-backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def padded_blocks(plans: list[list[int]], lengths: list[int], block: int) -> int:
    """The blocks of `block` rows the micro-batches `plans` fill when each is padded to whole blocks (an empty one runs
    a padded dummy: one block)."""
    return sum(max(-(-sum(lengths[i] for i in p) // block), 1) for p in plans)


def fewer_blocks(plans: list[list[int]], lengths: list[int], *, max_tokens: int, block: int) -> list[list[int]]:
    """As many micro-batches as `plans`, each at most max_tokens rows once padded to whole blocks, that pad to fewer
    blocks in all, where a first-fit-decreasing packing finds them (else `plans`). --true-on-policy pads every
    micro-batch to whole blocks (polyrl.backends.true_on_policy.ROWS), where token-balanced bins round each bin up:
    two bins of 18,944 tokens pad to 2 x 20,480 rows, bins of 19,832 and 18,056 tokens to 20,480 + 18,432."""
    k, cap = len(plans), max_tokens // block
    if not k or cap == 0 or not lengths or max(lengths) > cap * block:
        return plans
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for blocks in range(max(-(-sum(lengths) // block), k), padded_blocks(plans, lengths, block)):
        base, extra = divmod(blocks, k)
        if base + (extra > 0) > cap:
            break
        caps = [(base + (j < extra)) * block for j in range(k)]
        bins: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for i in order:
            j = max(range(k), key=lambda b: caps[b] - load[b])  # the bin with the most room left
            if load[j] + lengths[i] > caps[j]:
                break
            bins[j].append(i)
            load[j] += lengths[i]
        else:
            return [sorted(b) for b in bins]
    return plans


def plan_micro_batches(lengths: list[int], *, micro_batch_size: int | None = None, max_tokens: int | None = None,
                       num_micro_batches: int | None = None) -> list[list[int]]:
    """Split sample indices into micro-batches.

    Fixed size: consecutive chunks of micro_batch_size. Dynamic (max_tokens): token-balanced
    bins, longest sample first into the lightest bin, with the fewest bins that respect the
    budget (or exactly num_micro_batches, so every rank runs the same number of forwards).
    """
    n = len(lengths)
    if max_tokens is None:
        size = micro_batch_size or n
        k = num_micro_batches or max(math.ceil(n / size), 1)
        base, extra = divmod(n, k)
        out, start = [], 0
        for i in range(k):
            end = start + base + (i < extra)
            out.append(list(range(start, end)))
            start = end
        return out
    if any(l > max_tokens for l in lengths):
        raise ValueError(f"a sample of {max(lengths)} tokens exceeds --max-tokens-per-gpu {max_tokens}")
    k = num_micro_batches or max(math.ceil(sum(lengths) / max_tokens), 1)
    order = sorted(range(n), key=lambda i: -lengths[i])
    while True:
        bins: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for i in order:
            j = min(range(k), key=lambda b: load[b])
            bins[j].append(i)
            load[j] += lengths[i]
        if max(load) <= max_tokens or num_micro_batches:
            return [sorted(b) for b in bins]
        k += 1

