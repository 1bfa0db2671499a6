"""--offload-train for the Megatron backend: every GPU storage of the trainer's state is emptied in place
(`untyped_storage().resize_(0)`) and refilled later, so the views megatron keeps into it (param.data and
param.main_grad into the DDP buffers, the distributed optimizer's shards, bucket views, Adam state keyed by
parameter) stay valid without being found one by one.

Storages that hold values (weights, FP32 main parameters, Adam moments, module buffers) are copied to pinned host
memory first and back on onload; the DDP gradient buffers are zero between steps (train_step ends with
zero_grad_buffer), so they are released and re-materialised as zeros. The state comes back in the order a train
step reads it: `onload(skip=STEP_ONLY)` leaves the FP32 main parameters and Adam moments away until the optimizer
step. `Released` empties storages whose values nobody reads for a while: the DDP gradient buffers between steps and
the BF16 weights during the optimizer step (the default, --release-grad-buffers). Pure torch: tested on CPU
(tests/backends/megatron/test_offload_cpu.py); `megatron_state` names megatron's tensors by duck typing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

ARENA_BYTES = 256 * 2**20  # pinned host arenas: a power of two, so the caching host allocator's rounding wastes none
ALIGN = 512  # bytes; each slot in an arena starts aligned (copy kernels and DMA like aligned addresses)


@dataclass
class Slot:
    """One GPU storage of the state: `kind` names what it holds (weights, main_params, optimizer, grads)."""
    storage: torch.UntypedStorage
    nbytes: int
    kind: str
    keep: bool  # copy the bytes to the host and back; False: release and refill with zeros
    host: torch.Tensor | None = field(repr=False, default=None)  # its pinned host copy (keep only)


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard (Megatron-FSDP)


def plan_slots(groups: Iterable[tuple[str, bool, Iterable[torch.Tensor | None]]], device_type: str = "cuda") -> list[Slot]:
    """(kind, keep, tensors) groups -> one Slot per distinct non-empty storage on `device_type`, in first-seen order.
    A storage reached from several groups keeps its first kind, and is copied when any of them asks to keep it (a
    tensor that aliases weights and gradients at once is never zeroed)."""
    slots: dict[int, Slot] = {}
    for kind, keep, tensors in groups:
        for t in tensors:
            if t is None or not torch.is_tensor(t):
                continue
            t = _local(t)
            if t.device.type != device_type:
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0:  # already freed (Megatron-FSDP's gathered buffers between uses)
                continue
            key = st.data_ptr()
            if key in slots:
                slots[key].keep = slots[key].keep or keep
            else:
                slots[key] = Slot(st, st.nbytes(), kind, keep)
    return list(slots.values())


def summarize(slots: list[Slot]) -> dict[str, int]:
    """Bytes per kind, and in total."""
    out: dict[str, int] = {}
    for s in slots:
        out[s.kind] = out.get(s.kind, 0) + s.nbytes
    out["total"] = sum(s.nbytes for s in slots)
    return out


def arena_layout(sizes: list[int], arena_bytes: int = ARENA_BYTES, align: int = ALIGN) -> list[tuple[int, int]]:
    """(arena index, byte offset) per size: first fit into arenas of `arena_bytes`, each slot aligned to `align`;
    a size above `arena_bytes` gets an arena of its own."""
    out, fill = [], []  # fill[i]: bytes used in arena i (-1: a dedicated arena)
    for n in sizes:
        if n > arena_bytes:
            out.append((len(fill), 0))
            fill.append(-1)
            continue
        for i, used in enumerate(fill):
            start = -(-used // align) * align
            if used >= 0 and start + n <= arena_bytes:
                out.append((i, start))
                fill[i] = start + n
                break
        else:
            out.append((len(fill), 0))
            fill.append(n)
    return out


def _flat(s: Slot) -> torch.Tensor:
    """A uint8 view of the whole storage (valid while it holds its bytes)."""
    return torch.empty(0, dtype=torch.uint8, device=s.storage.device).set_(s.storage, 0, (s.nbytes,))


def refill(s: Slot) -> None:
    """Give an emptied storage its bytes back: its host copy (keep) or zeros."""
    s.storage.resize_(s.nbytes)
    flat = _flat(s)
    if s.keep:
        flat.copy_(s.host, non_blocking=True)
    else:
        flat.zero_()


STEP_ONLY = ("main_params", "optimizer")  # kinds only the optimizer step reads (FP32 main parameters, Adam moments)


class Released:
    """Storages emptied in place while nothing reads their values and given their bytes back before the next writer:
    the DDP gradient buffers (zero between train steps; 4 bytes a parameter for megatron's FP32 grads) and the BF16
    weights during the optimizer step (megatron rewrites each from its FP32 main parameter after the inner step).
    Every view into them (param.data, param.main_grad, bucket views) stays valid. No host copy, no synchronisation:
    the refill is ordered on the current stream before the kernels that write into the storages."""

    def __init__(self, tensors: Iterable[torch.Tensor | None], device_type: str = "cuda", kind: str = "grads"):
        self.slots = plan_slots([(kind, False, tensors)], device_type)
        self.nbytes = sum(s.nbytes for s in self.slots)

    @property
    def released(self) -> bool:
        return any(s.storage.nbytes() == 0 for s in self.slots)

    def release(self) -> None:
        for s in self.slots:
            s.storage.resize_(0)

    def materialize(self, zero: bool = True) -> None:
        """zero=False: the bytes are left as the allocator gives them, for a caller that writes every one next."""
        for s in self.slots:
            if s.storage.nbytes() == 0:
                if zero:
                    refill(s)
                else:
                    s.storage.resize_(s.nbytes)


class StorageOffloader:
    """offload(groups) empties every storage `plan_slots` finds (after a non-blocking copy into pinned host arenas
    where it keeps values); onload() refills them (non-blocking copies back, zeros for the released ones). The host
    arenas are allocated once and reused while the layout is unchanged (one host copy of the state)."""

    def __init__(self, device_type: str = "cuda", pin: bool = True):
        self.device_type, self.pin = device_type, pin
        self.slots: list[Slot] = []
        self._away: list[bool] = []  # per slot: emptied, its values (if kept) in the host arenas
        self._arenas: list[torch.Tensor] = []
        self._layout_key: tuple | None = None

    @property
    def offloaded(self) -> bool:
        """Some of the state is away (all of it after offload(), part of it after onload(skip=...))."""
        return any(self._away)

    def _host_views(self, keep: list[Slot]) -> None:
        sizes = [s.nbytes for s in keep]
        layout = arena_layout(sizes)
        key = tuple(sizes)
        if key != self._layout_key:
            n = max((i for i, _ in layout), default=-1) + 1
            cap = [0] * n
            for (i, off), size in zip(layout, sizes):
                cap[i] = max(cap[i], off + size)
            # the old arenas go first (they hold nothing the new plan needs) and torch's pinned-block cache gives
            # their pages back: else the host holds both layouts at once when Adam's moments appear at the first step
            # (a 7B run on a 128 GiB host was killed there)
            self._arenas = []
            if self.pin and hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
            # one small state gets an arena of its own size; packed arenas get the full power-of-two size
            self._arenas = [torch.empty(c if (c > ARENA_BYTES or n == 1) else ARENA_BYTES, dtype=torch.uint8,
                                        pin_memory=self.pin) for c in cap]
            self._layout_key = key
        for s, (i, off) in zip(keep, layout):
            s.host = self._arenas[i][off:off + s.nbytes]

    def offload(self, groups: Iterable[tuple[str, bool, Iterable[torch.Tensor | None]]]) -> dict[str, int]:
        """Empty the state's storages; returns the bytes per kind (summarize). With part of the state still away (an
        onload that skipped kinds), only what came back goes, by the plan it left with; with all of it away, nothing
        happens."""
        if not self.offloaded:  # all resident: plan anew (the optimizer's state appears at its first step)
            self.slots = plan_slots(groups, self.device_type)
            self._host_views([s for s in self.slots if s.keep])
            self._away = [False] * len(self.slots)
        here = [i for i, away in enumerate(self._away) if not away]
        for i in here:
            if self.slots[i].keep:
                self.slots[i].host.copy_(_flat(self.slots[i]), non_blocking=True)
        self.put_back(here)  # its synchronize also lands the host copies before the memory is handed on
        return summarize(self.slots)

    def onload(self, skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> list[int]:
        """Refill what is away, except the kinds in `skip` (left for a later onload), or of `only` these kinds; returns
        the slots refilled (for put_back)."""
        back = []
        for i, s in enumerate(self.slots):
            if self._away[i] and s.kind not in skip and (only is None or s.kind in only):
                refill(s)
                self._away[i] = False
                back.append(i)
        if back and self.device_type == "cuda":
            torch.cuda.synchronize()  # Megatron-FSDP gathers weights on side streams that do not wait on this one
        return back

    def put_back(self, slots: list[int]) -> None:
        """Empty `slots` (an onload's return) again after they were only read (an export, a checkpoint save): their
        host copies still hold their values, so nothing is copied back. offload() ends with it too."""
        if not slots:
            return
        if self.device_type == "cuda":
            torch.cuda.synchronize()  # the readers' kernels and copies (offload's to the host) are done with them
        for i in slots:
            self.slots[i].storage.resize_(0)
            self._away[i] = True
        if self.device_type == "cuda":
            torch.cuda.empty_cache()


def _module_tensors(modules: Iterable[torch.nn.Module]) -> Iterator[torch.Tensor]:
    for m in modules:  # nn.Module's own methods: megatron's DDP shadows `buffers` with its list of grad buffers
        yield from torch.nn.Module.parameters(m)
        yield from torch.nn.Module.buffers(m)


def _fsdp_buffers(chunk, names: tuple[str, ...]) -> Iterator[torch.Tensor]:
    pgb = getattr(chunk, "param_and_grad_buffer", None)
    for group in getattr(pgb, "parameter_groups", None) or []:
        for n in names:
            buf = getattr(group, n, None)
            if buf is not None and getattr(buf, "data", None) is not None:
                yield buf.data


def ddp_grad_buffers(model: list) -> list[torch.Tensor]:
    """megatron DDP's gradient buffers (every param.main_grad is a view into one of them); none under Megatron-FSDP."""
    out = []
    for c in model:
        for name in ("buffers", "expert_parallel_buffers"):  # megatron DDP's _ParamAndGradBuffer lists
            bufs = vars(c).get(name)
            out += [getattr(b, "grad_data", None) for b in bufs] if isinstance(bufs, list) else []
    return out


def megatron_state(model: list, optimizer, frozen: list[list] = ()) -> list[tuple[str, bool, list]]:
    """The (kind, keep, tensors) groups of a Megatron backend: the trained chunks (DDP or Megatron-FSDP) and their
    gradient buffers, megatron's optimizer (main parameters, Adam state), and frozen models (reference, teacher)."""
    from polyrl.backends.megatron.compat import inner_optimizers
    weights = list(_module_tensors(model))
    for c in model:  # Megatron-FSDP: the weight buffers the sharded parameters view
        weights += list(_fsdp_buffers(c, ("model_weight_buffer", "transpose_weight_buffer")))
    grads, kept_grads = ddp_grad_buffers(model), []
    for c in model:
        grads += [getattr(p, "main_grad", None) for p in torch.nn.Module.parameters(c)]
        kept_grads += list(_fsdp_buffers(c, ("main_grad_buffer",)))  # its own lifecycle: keep its values
    mains, opt_state = [], []
    members = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for opt in members:
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups", "shard_fp32_groups"):
            for g in getattr(opt, attr, None) or []:
                mains += list(g)
    for inner in inner_optimizers(optimizer):
        for g in inner.param_groups:
            mains += list(g["params"])
            grads += [p.grad for p in g["params"]]
        for st in inner.state.values():
            opt_state += [v for v in st.values() if torch.is_tensor(v)]
    for c in model:
        mains += list(_fsdp_buffers(c, ("main_weight_buffer",)))
    frozen_t = [t for chunks in frozen if chunks for t in _module_tensors(chunks)]
    return [("weights", True, weights), ("main_params", True, mains), ("optimizer", True, opt_state),
            ("grads", True, kept_grads), ("grads", False, grads), ("frozen_models", True, frozen_t)]
