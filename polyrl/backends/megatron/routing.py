"""MoE routing replay (R2 / R3) and routing metrics on megatron-core, through its own RouterReplay
(megatron/core/transformer/moe/router_replay.py, on with TransformerConfig.moe_enable_routing_replay).

Routes travel per sample as [L - 1, num_hidden_layers, k] (polyrl.backends.routing_replay). A router sees this
rank's tokens of one micro-batch: the packed THD layout, this CP rank's chunks (thd.PackedBatch.token_index), and
with sequence parallelism this TP rank's contiguous share of them. `router_targets` maps per-sample routes onto that
order; tokens without a route (each sample's last token, THD padding) get experts 0..k-1, which no log-prob reads
(the experts run dropless, so they take no capacity from other tokens).

Per micro-batch and model chunk, `begin` arms each router of the chunk: REPLAY_FORWARD with its layer's targets,
RECORD (R2's log-prob pass), or megatron's own routing. Forward hooks on the routers count the per-layer expert
load and the top-k mismatch against given routes (their routing_map [T, E] is the chosen set), and collect RECORDed
indices. The interleaved schedules recompute nothing here: replay with --recompute-granularity full (which re-runs
the router in backward, where megatron pops REPLAY_BACKWARD targets) is refused at start-up.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from polyrl.backends.routing_replay import routes_dtype


def router_targets(token_index: torch.Tensor, offsets: list[int], routes: list[torch.Tensor], num_layers: int, top_k: int,
                   sp_size: int = 1, sp_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample routes ([n_i - 1, num_layers, k]; sample i's tokens start at offsets[i] of the packed layout) in the
    order one router sees its tokens. Returns (targets [T, num_layers, k] long, has [T] bool: a given route,
    global [T] long: each router token's packed index)."""
    total = offsets[-1]
    target = torch.arange(top_k).expand(total, num_layers, top_k).clone()
    has = torch.zeros(total, dtype=torch.bool)
    for off, r in zip(offsets, routes):
        target[off:off + r.shape[0]] = r.long()
        has[off:off + r.shape[0]] = True
    glob = router_tokens(token_index, sp_size, sp_rank)
    return target[glob], has[glob], glob


def router_tokens(token_index: torch.Tensor, sp_size: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """The packed indices of the tokens one router sees: this CP rank's tokens, split into sp_size contiguous
    shares over the TP ranks when sequence parallelism scatters them."""
    c = token_index.numel() // sp_size
    return token_index[sp_rank * c:(sp_rank + 1) * c]


def route_shares(rec: dict[int, torch.Tensor], glob: torch.Tensor, offsets: list[int], lens: list[int],
                 dtype: torch.dtype) -> dict[int, tuple]:
    """Recorded routes of one router token order (rec: layer -> [T, k], tokens at packed positions `glob`) as
    per-sample shares (positions [m], layers [l], experts [m, l, k]); placeholder tokens (THD padding, each sample's
    last token) are dropped. What a rank sends is what it holds, not the whole [n - 1, layers, k] of each sample."""
    if not rec:
        return {}
    layers = sorted(rec)
    stacked = torch.stack([rec[layer] for layer in layers], 1).to(dtype)  # [T, l, k]
    out = {}
    for i, (off, n) in enumerate(zip(offsets, lens)):
        sel = ((glob >= off) & (glob < off + n - 1)).nonzero().flatten()
        if sel.numel():
            out[i] = ((glob[sel] - off).to(torch.int32), torch.tensor(layers, dtype=torch.int32), stacked[sel])
    return out


def merge_route_shares(shares: list[dict[int, tuple]], lens: dict[int, int], num_layers: int, top_k: int,
                       dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Join the ranks' shares (each: sample -> (positions, layers, experts)) into one [n_i - 1, num_layers, k] per
    sample of `lens` (sample -> length); layers without experts (dense layers) stay -1."""
    full = {i: torch.full((max(n - 1, 0), num_layers, top_k), -1, dtype=dtype) for i, n in lens.items()}
    for share in shares:
        for i, (pos, layers, vals) in share.items():
            if i in full:
                full[i][pos.long()[:, None], layers.long()[None, :]] = vals.to(dtype)
    return full


class MegatronRouting:
    """RouterReplay control and routing metrics over the routers of the actor's model chunks."""

    def __init__(self, chunks: list, num_layers: int, num_experts: int, top_k: int):
        from megatron.core.transformer.moe.router import TopKRouter
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.routers: list[list] = []  # per chunk: (layer, router)
        self.hooks = []
        for c, chunk in enumerate(chunks):
            mine = [(int(m.layer_number) - 1, m) for m in chunk.modules() if isinstance(m, TopKRouter)]
            self.routers.append(mine)
            for layer, m in mine:
                self.hooks.append(m.register_forward_hook(functools.partial(self._hook, c, layer)))
        self.current: dict[int, dict] = {}  # chunk -> what its routers do for the micro-batch now running
        self.recorded: dict[int, dict[int, torch.Tensor]] = {}  # micro-batch id -> layer -> [T, k] (R2)
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.float64, device="cuda")
        self.mismatch = torch.zeros(2, dtype=torch.float64, device="cuda")
        self.moe_layers = sorted({layer for rs in self.routers for layer, _ in rs})

    def begin(self, chunk_id: int, micro_id: int, *, targets=None, has=None, valid=None, replay: bool = False,
              record: bool = False) -> None:
        """Before chunk `chunk_id` runs micro-batch `micro_id`: targets [T, num_layers, k] (device) are replayed
        (replay) or compared with megatron's routing; record keeps the routing for `take_recorded`."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        self.current[chunk_id] = dict(micro=micro_id, targets=targets, has=has, valid=valid, replay=replay, record=record)
        for layer, m in self.routers[chunk_id]:
            rr = m.router_replay  # None unless a replay flag turned moe_enable_routing_replay on
            if rr is None:
                continue
            if replay:
                rr.set_target_indices(targets[:, layer].contiguous())
                rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif record:
                rr.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                rr.clear_router_replay_action()

    def end(self) -> None:
        """After a forward-backward pass: drop the targets megatron keeps for a backward replay."""
        for rs in self.routers:
            for _, m in rs:
                if m.router_replay is not None:
                    m.router_replay.clear_indices()
                    m.router_replay.clear_router_replay_action()
        self.current.clear()

    def _hook(self, chunk_id: int, layer: int, module, args, out):
        cur = self.current.get(chunk_id)
        if cur is None:
            return
        routing_map = out[1]  # [T, E] bool: the experts each token goes to
        valid = cur["valid"]
        self.load[layer] += routing_map[valid].sum(0).double()
        if cur["targets"] is not None and not cur["replay"]:
            want = torch.zeros_like(routing_map).scatter_(1, cur["targets"][:, layer], True)
            differs = (want != routing_map).any(-1) & cur["has"]
            self.mismatch += torch.stack([differs.sum(), cur["has"].sum()]).double()
        if cur["record"]:
            self.recorded.setdefault(cur["micro"], {})[layer] = module.router_replay.get_recorded_indices().detach().cpu()

    def take_recorded(self, micro_id: int, glob: torch.Tensor, offsets: list[int], lens: list[int]) -> dict[int, tuple]:
        """This rank's share of one micro-batch's recorded routes, compact: sample (within the micro-batch) ->
        (token positions [m], layers [l], experts [m, l, k]) for the tokens and MoE layers this rank's routers saw
        (its CP / SP share, its pipeline stage); `merge_route_shares` joins the ranks' shares."""
        rec = self.recorded.pop(micro_id, {})
        return route_shares(rec, glob, offsets, lens, routes_dtype(self.num_experts))

    def drain_metrics(self) -> dict[str, float]:
        """moe/* load balance over every router of every rank (tokens are disjoint across DP / EP / CP / SP ranks and
        layers across pipeline stages, so sums are totals), and the top-k mismatch."""
        vec = torch.cat([self.load.reshape(-1), self.mismatch])
        dist.all_reduce(vec)
        vec = vec.cpu()
        self.load.zero_()
        self.mismatch.zero_()
        load = vec[:-2].reshape(self.num_layers, self.num_experts)
        out: dict[str, float] = {}
        layers = [i for i in range(self.num_layers) if load[i].sum() > 0]
        if layers:
            sel = load[layers]
            mean = sel.mean(-1).clamp(min=1e-12)
            ratio, cv = sel.max(-1).values / mean, sel.std(-1, unbiased=False) / mean
            for layer, r, c in zip(layers, ratio.tolist(), cv.tolist()):
                out[f"moe/layer{layer}/load_max_over_mean"] = r
                out[f"moe/layer{layer}/load_cv"] = c
            out["moe/load_max_over_mean"], out["moe/load_cv"] = float(ratio.mean()), float(cv.mean())
        if vec[-1] > 0:
            out["moe/topk_mismatch_frac"] = float(vec[-2] / vec[-1])
        return out
