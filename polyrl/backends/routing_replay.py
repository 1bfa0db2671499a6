"""MoE routing replay (R2 / R3) and routing metrics for HF MoE models, pure torch.

A route is the top-k expert choice of every MoE layer for one token. Routes travel per sample as
[L - 1, num_hidden_layers, k] int tensors (SGLang's `routed_experts` layout: the last token is never forwarded by
the engine, so it has no route; layers without experts hold -1). Keeping them per sample lets the micro-batch plan
of the train pass differ from the one of the pass that recorded them.

MoERouting puts a forward hook on every top-k router of one model (installed when the backend builds the model, so
nothing depends on import order). Per forward it either
- computes the routing as usual (and may record it, or compare it with given routes: moe/topk_mismatch_frac), or
- replays given routes: the top-k indices come from the record, the gate weights are recomputed from the current
  router logits at those indices (softmax, gather, renormalised when the router normalises its top-k), so the
  router still gets gradients. Tokens without a recorded route (each sample's last token) keep their own routing.
It also counts the per-layer expert load and, when configured, adds the switch load-balancing loss and the router
z-loss to the training loss.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# router class -> whether it renormalises its top-k gates (None: read the module's norm_topk_prob). All of these
# return (router_logits [N, E], top-k gates [N, k], top-k indices [N, k]) with gates = softmax(logits) at the indices.
SOFTMAX_TOPK_ROUTERS = {
    "Qwen3MoeTopKRouter": None, "Qwen2MoeTopKRouter": None, "OlmoeTopKRouter": None, "Qwen3NextTopKRouter": None,
    "Qwen3VLMoeTextTopKRouter": None, "Qwen3_5MoeTopKRouter": None, "MixtralTopKRouter": True,
}
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")  # megatron's names
FSDP_LOAD_BALANCING_TYPES = ("aux_loss", "none")


def routes_dtype(num_experts: int) -> torch.dtype:
    """The smallest signed int that holds every expert id and the -1 of a layer without experts: recorded routes of
    a step stay in host memory, [tokens, layers, k] per sample."""
    return torch.int16 if num_experts < 2**15 else torch.int32


def routes_nbytes(routes: list | None) -> int:
    return sum(int(r.numel()) * r.element_size() for r in routes) if routes else 0


def unsupported_router(lm: nn.Module) -> str | None:
    """The class name of a top-k router that replay cannot drive, if the model has one."""
    for m in lm.modules():
        name = type(m).__name__
        if name.endswith("TopKRouter") and name not in SOFTMAX_TOPK_ROUTERS:
            return name
    return None


@dataclass
class _Forward:
    """What the hooks need for one forward: where each sample's tokens sit in the flattened [B * width] token axis."""

    valid: torch.Tensor  # [N] bool: a real token (not padding)
    target: torch.Tensor | None = None  # [N, num_layers, k] long: given routes (-1: none)
    has: torch.Tensor | None = None  # [N] bool: the token has a given route
    replay: bool = False
    record: bool = False
    accumulate: bool = True  # off once the loss is taken: activation checkpointing re-runs the hooks in backward
    recorded: dict = field(default_factory=dict)  # layer -> [N, k]
    aux: torch.Tensor | None = None  # scalar: this forward's load-balancing + z-loss terms


class MoERouting:
    """Record / replay / compare hooks on every softmax top-k router of one HF model; see the module docstring."""

    def __init__(self, lm: nn.Module, *, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
                 load_balancing_type: str = "aux_loss"):
        text = lm.config.get_text_config()
        self.num_layers = int(text.num_hidden_layers)
        self.routers: list[tuple[int, nn.Module]] = []
        for name, m in lm.named_modules():
            if type(m).__name__ in SOFTMAX_TOPK_ROUTERS:
                hit = re.search(r"layers\.(\d+)\.", name)
                if hit is None:
                    raise ValueError(f"MoE router {name!r} sits outside a decoder layer: routing replay cannot place it")
                self.routers.append((int(hit.group(1)), m))
        if not self.routers:
            raise ValueError("this model has no softmax top-k MoE router")
        first = self.routers[0][1]
        self.top_k, self.num_experts = int(first.top_k), int(first.num_experts)
        self.layers = [i for i, _ in self.routers]
        self.slot = {layer: j for j, layer in enumerate(self.layers)}  # layer -> row of the load counts
        self.aux_coeff = aux_loss_coeff if load_balancing_type == "aux_loss" else 0.0
        self.z_coeff = z_loss_coeff
        self.state: _Forward | None = None
        self._reset_stats()
        self.handles = [m.register_forward_hook(functools.partial(self._hook, layer, self._normalises(m)))
                        for layer, m in self.routers]

    @classmethod
    def attach(cls, lm: nn.Module, **kw) -> "MoERouting | None":
        """Hooks on `lm`'s routers, or None for a dense model (or one whose routers replay does not know)."""
        if not any(type(m).__name__ in SOFTMAX_TOPK_ROUTERS for m in lm.modules()):
            return None
        return cls(lm, **kw)

    @staticmethod
    def _normalises(m: nn.Module) -> bool:
        fixed = SOFTMAX_TOPK_ROUTERS[type(m).__name__]
        return bool(m.norm_topk_prob) if fixed is None else fixed

    def _reset_stats(self, device="cpu") -> None:
        # on the model's device: the hooks add to them without a host sync
        self.load = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64, device=device)
        self.mismatch = torch.zeros(2, dtype=torch.float64, device=device)  # differing (token, layer) pairs, compared
        self.aux_logged = torch.zeros(2, dtype=torch.float64, device=device)  # aux loss sum, z-loss sum

    # ---- one forward ------------------------------------------------------------------------------------------
    def begin(self, lens: list[int], layout: str, device, **kw) -> None:
        """Before a forward over samples of `lens` tokens laid out `layout` ("packed": one row; "padded": one row of
        max(lens) per sample); the keywords are begin_at's."""
        width = max(lens) if layout == "padded" else sum(lens)
        starts = [i * width for i in range(len(lens))] if layout == "padded" else [sum(lens[:i]) for i in range(len(lens))]
        self.begin_at([torch.arange(s, s + l) for s, l in zip(starts, lens)],
                      len(lens) * width if layout == "padded" else width, device, **kw)

    def begin_at(self, positions: list[torch.Tensor], n: int, device, *, routes: list | None = None, replay: bool = False,
                 record: bool = False, count: bool = True) -> None:
        """Before a forward whose routers see n flattened tokens, sample i's at `positions[i]`. routes: one
        [len_i - 1, num_layers, k] tensor per sample, replayed when `replay`, else compared with the computed routing.
        record: keep the computed routing for `recorded()`. count: add this forward to the metrics (and aux losses)."""
        self._pos = positions
        lens = [int(p.numel()) for p in positions]
        valid = torch.zeros(n, dtype=torch.bool)
        valid[torch.cat(positions)] = True
        st = _Forward(valid=valid.to(device), replay=replay, record=record, accumulate=count)
        if self.load.device != st.valid.device:
            self._reset_stats(st.valid.device)
        if routes is not None:
            for r, l in zip(routes, lens):
                if tuple(r.shape) != (l - 1, self.num_layers, self.top_k):
                    raise ValueError(f"routed experts of shape {tuple(r.shape)} for a sample of {l} tokens; expected "
                                     f"({l - 1}, {self.num_layers}, {self.top_k}) = (tokens - 1, num_hidden_layers, top-k)")
            rows = torch.cat([p[:-1] for p in self._pos])
            target = torch.full((n, self.num_layers, self.top_k), -1, dtype=torch.long)
            target[rows] = torch.cat(list(routes)).long()
            has = torch.zeros(n, dtype=torch.bool)
            has[rows] = True
            st.target, st.has = target.to(device), has.to(device)
        self.state = st

    def take_aux_loss(self) -> torch.Tensor | None:
        """This forward's load-balancing + z-loss terms (None when neither is configured or nothing was routed);
        afterwards the hooks only replay (a recompute in backward must not count twice)."""
        st = self.state
        if st is None:
            return None
        st.accumulate = False
        return st.aux

    def recorded(self, drop_last: bool = True) -> list[torch.Tensor]:
        """The routing the last forward (begun with record=True) computed: one [len_i - 1, num_layers, k] CPU tensor
        per sample ([len_i, ...] without drop_last: an engine's prefill, whose last token is forwarded too)."""
        st = self.state
        full = torch.full((st.valid.numel(), self.num_layers, self.top_k), -1, dtype=routes_dtype(self.num_experts))
        for layer, idx in st.recorded.items():
            full[:, layer] = idx.cpu().to(full.dtype)
        return [full[p[:-1] if drop_last else p] for p in self._pos]

    def end(self) -> None:
        self.state = None

    def _hook(self, layer: int, normalise: bool, module, args, out):
        st = self.state
        if st is None:
            return None
        logits, gates, idx = out
        if st.target is not None:
            tgt, has = st.target[:, layer], st.has
            if st.replay:
                idx = torch.where(has[:, None], tgt, idx)
                w = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, idx)
                if normalise:
                    w = w / w.sum(dim=-1, keepdim=True)
                gates = w.to(gates.dtype)
            elif st.accumulate:
                differs = (idx.sort(-1).values != tgt.sort(-1).values).any(-1) & has
                self.mismatch += torch.stack([differs.sum(), has.sum()]).double()
        if st.record:
            st.recorded[layer] = idx.detach()
        if st.accumulate:
            v = st.valid
            counts = torch.bincount(idx[v].reshape(-1), minlength=self.num_experts)
            self.load[self.slot[layer]] += counts.double()
            if (self.aux_coeff or self.z_coeff) and torch.is_grad_enabled():
                lg = logits[v].float()
                term = logits.new_zeros((), dtype=torch.float32)
                if self.aux_coeff:  # switch load balancing: E * sum_e (share of routed slots_e) * (mean gate prob_e)
                    frac = counts.float() / (lg.shape[0] * self.top_k)
                    aux = self.num_experts * (frac * torch.softmax(lg, dim=-1).mean(0)).sum()
                    term = term + self.aux_coeff * aux
                    self.aux_logged[0] += aux.detach().double()
                if self.z_coeff:  # router z-loss (ST-MoE): keeps router logits small
                    z = torch.logsumexp(lg, dim=-1).square().mean()
                    term = term + self.z_coeff * z
                    self.aux_logged[1] += z.detach().double()
                st.aux = term if st.aux is None else st.aux + term
        return logits, gates, idx

    # ---- metrics ----------------------------------------------------------------------------------------------
    def drain_metrics(self, all_reduce=None, forwards: int = 1, world: int = 1) -> dict[str, float]:
        """moe/* metrics over everything routed since the last call. all_reduce: sums a float64 tensor over the
        `world` ranks in place; forwards: how many forwards (per rank) the aux / z-loss sums cover."""
        vec = torch.cat([self.load.reshape(-1), self.mismatch, self.aux_logged])
        if all_reduce is not None:
            all_reduce(vec)
        vec = vec.cpu()
        n = self.load.numel()
        load = vec[:n].reshape(self.load.shape)
        mism, aux = vec[n:n + 2], vec[n + 2:]
        self._reset_stats(self.load.device)
        out: dict[str, float] = {}
        if load.sum() > 0:
            mean = load.mean(-1).clamp(min=1e-12)
            ratio, cv = load.max(-1).values / mean, load.std(-1, unbiased=False) / mean
            for layer, r, c in zip(self.layers, ratio.tolist(), cv.tolist()):
                out[f"moe/layer{layer}/load_max_over_mean"] = r
                out[f"moe/layer{layer}/load_cv"] = c
            out["moe/load_max_over_mean"], out["moe/load_cv"] = float(ratio.mean()), float(cv.mean())
        if mism[1] > 0:
            out["moe/topk_mismatch_frac"] = float(mism[0] / mism[1])
        if self.aux_coeff:
            out["moe/aux_loss"] = float(aux[0]) / (forwards * world * len(self.layers))
        if self.z_coeff:
            out["moe/z_loss"] = float(aux[1]) / (forwards * world * len(self.layers))
        return out
