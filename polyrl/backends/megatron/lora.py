"""LoRA for the Megatron backend: adapters on megatron-core's column- and row-parallel linears, TP-aware.

Each adapted HF projection gets its own pair A [r, in], B [out, r] (peft's layout and init: A kaiming-uniform, B zero),
held by the megatron linear that computes it:

    linear_qkv  (column parallel, fused per query group)  q_proj, k_proj, v_proj
    linear_proj (row parallel)                            o_proj
    linear_fc1  (column parallel, [gate_r; up_r] per rank) gate_proj, up_proj
    linear_fc2  (row parallel)                            down_proj

Parameters are named `<linear>.lora.<proj>.A` / `.B` beside the base `<linear>.weight`. Over TP an adapter is split the
way its base weight is: on a column-parallel linear B is chunked by rows (this rank's heads / intermediate rows, the same
rows as the base shard) and A replicated; on a row-parallel linear A is chunked by columns and B replicated. So the local
merged weight W_r + s * delta_r is exactly this rank's shard of the merged full weight, and TP2 computes what TP1 does:

    column: out_r += s * B_r (A x)      A's gradient is summed over TP (copy_to_tensor_model_parallel_region on A x)
    row:    out   += s * B (sum_r A_r x_r)   (reduce_from_tensor_model_parallel_region on A_r x_r; B's gradient is whole)

The base weights are frozen (requires_grad False before DDP wraps the model), so megatron's grad buffers and distributed
optimizer hold the adapters only. What leaves the backend has the base model's shape: merged tensors under HF names for
weight sync and --save-hf; --save-hf-adapter writes peft's adapter directory.

Pure functions (names, shapes, init, TP sharding, merging, the adapter forward with its TP regions passed in) run on
CPU; `attach` imports megatron-core.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

import torch
from torch import Tensor, nn

from polyrl.config import ConfigError

# megatron linear -> the HF projections it computes, in the order they are fused
LINEARS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
KIND = {"q_proj": "col", "k_proj": "col", "v_proj": "col", "gate_proj": "col", "up_proj": "col",
        "o_proj": "row", "down_proj": "row"}
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MARK = ".lora."  # in every adapter parameter's name
_ADAPTER = re.compile(r"(.*)\.lora\.(\w+)\.([AB])")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def is_adapter(name: str) -> bool:
    return MARK in name


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _groups(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def resolve_targets(hf_config: Any, targets: str | list[str]) -> dict[str, tuple[str, ...]]:
    """--lora-target-modules (peft's names) -> {megatron linear: the HF projections adapted there}. all-linear is every
    decoder projection (peft's all-linear leaves the output layer out too). ConfigError for a model or a name this
    backend has no adapter for."""
    from polyrl.backends.megatron import bridge
    fam = bridge.FAMILIES.get(hf_config.model_type)
    if fam is None or fam.mla or fam.mixers or fam.interleaved_rope or fam.fused_gate_up or fam.mtp or fam.oss_experts:
        raise ConfigError(f"--lora-rank with --train-backend megatron: {hf_config.model_type} models are not built for "
                          "LoRA on megatron (its linears are megatron's fused QKV / gate-up layouts of Llama, Qwen2, "
                          "Qwen3 and Qwen3-MoE attention); use --train-backend fsdp")
    moe = any(bridge.is_moe_layer(hf_config, i) for i in range(hf_config.num_hidden_layers))
    mlp = ("gate_proj", "up_proj", "down_proj")
    if targets == "all-linear":
        if moe:
            raise ConfigError("--lora-target-modules all-linear on a MoE model with --train-backend megatron: the MoE "
                              "layers' experts and router have no megatron adapter; name the attention projections, "
                              "e.g. --lora-target-modules q_proj,k_proj,v_proj,o_proj")
        wanted = set(KIND)
    else:
        wanted = set(targets)
        unknown = sorted(wanted - set(KIND))
        if unknown:
            raise ConfigError(f"--lora-target-modules {','.join(targets)}: {', '.join(unknown)} has no adapter on "
                              f"--train-backend megatron (it adapts {', '.join(KIND)}); use --train-backend fsdp for "
                              "other modules")
        if moe and wanted & set(mlp):
            raise ConfigError(f"--lora-target-modules {','.join(targets)}: this MoE model's MLPs are experts, which "
                              "have no megatron adapter; target the attention projections only")
    out = {lin: tuple(p for p in projs if p in wanted) for lin, projs in LINEARS.items()}
    return {lin: projs for lin, projs in out.items() if projs}


def full_shape(hf_config: Any, proj: str) -> tuple[int, int]:
    """(out_features, in_features) of the HF projection."""
    h, hd = hf_config.hidden_size, _head_dim(hf_config)
    return {"q_proj": (hf_config.num_attention_heads * hd, h), "k_proj": (_groups(hf_config) * hd, h),
            "v_proj": (_groups(hf_config) * hd, h), "o_proj": (h, hf_config.num_attention_heads * hd),
            "gate_proj": (hf_config.intermediate_size, h), "up_proj": (hf_config.intermediate_size, h),
            "down_proj": (h, hf_config.intermediate_size)}[proj]


def init_adapter(seed: int, layer: int, proj: str, rank: int, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """peft's init of one full adapter, the same on every rank and TP degree: A ~ U(-1/sqrt(in), 1/sqrt(in))
    (kaiming_uniform_ with a=sqrt(5)), B = 0, from a generator keyed by (seed, layer, projection)."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{layer}:{proj}".encode()))
    bound = 1.0 / math.sqrt(in_f)
    a = torch.rand(rank, in_f, generator=g, dtype=torch.float64).mul_(2 * bound).sub_(bound).float()
    return a, torch.zeros(out_f, rank)


def shard_adapter(proj: str, a: Tensor, b: Tensor, tp_rank: int, tp_size: int) -> tuple[Tensor, Tensor]:
    """This TP rank's (A, B) of a full adapter: column-parallel projections chunk B's rows (the base shard's rows),
    row-parallel ones chunk A's columns (the base shard's input columns)."""
    if tp_size == 1:
        return a, b
    if KIND[proj] == "col":
        if b.shape[0] % tp_size:
            raise ValueError(f"LoRA {proj}: {b.shape[0]} output rows do not split over TP={tp_size}")
        return a, b.chunk(tp_size, dim=0)[tp_rank].clone()
    if a.shape[1] % tp_size:
        raise ValueError(f"LoRA {proj}: {a.shape[1]} input columns do not split over TP={tp_size}")
    return a.chunk(tp_size, dim=1)[tp_rank].clone(), b


def gather_adapter(name: str, shards: list[Tensor]) -> Tensor:
    """Inverse of shard_adapter for one adapter parameter (`...lora.<proj>.A|B`), all TP ranks' shards in order."""
    m = _ADAPTER.fullmatch(name)
    if m is None:
        raise ValueError(f"not a LoRA parameter: {name}")
    if len(shards) == 1:
        return shards[0]
    sharded_b = KIND[m[2]] == "col"
    if m[3] == ("B" if sharded_b else "A"):
        return torch.cat(list(shards), dim=0 if sharded_b else 1)
    return shards[0]


def tp_axis(proj: str, which: str) -> int | None:
    """The dim over which a parameter is split across TP (None: replicated)."""
    if KIND[proj] == "col":
        return 0 if which == "B" else None
    return 1 if which == "A" else None


def _fuse_qkv(parts: dict[str, Tensor], groups: int, like: dict[str, int], dim: int) -> Tensor:
    """megatron's per-group [q heads, k, v] order along `dim` from per-projection tensors (absent ones are zero)."""
    ref = next(iter(parts.values()))
    chunks = []
    for p in ("q_proj", "k_proj", "v_proj"):
        t = parts.get(p)
        if t is None:
            shape = list(ref.shape)
            shape[dim] = like[p]
            t = ref.new_zeros(shape)
        t = t.movedim(dim, -1)
        chunks.append(t.reshape(*t.shape[:-1], groups, -1))
    return torch.cat(chunks, dim=-1).flatten(-2).movedim(-1, dim)


def _local_rows(linear: str, local_rows: dict[str, int]) -> dict[str, int]:
    return {p: local_rows[p] for p in LINEARS[linear]}


def local_delta(linear: str, pairs: Mapping[str, tuple[Tensor, Tensor]], local_rows: dict[str, int], groups: int,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """sum of B @ A of one megatron linear's adapters in its local (TP-shard) weight layout, in `dtype`.
    local_rows: each projection's output rows on this rank; groups: query groups on this rank (fused QKV)."""
    d = {p: b.to(dtype) @ a.to(dtype) for p, (a, b) in pairs.items()}
    if linear.endswith("linear_qkv"):
        return _fuse_qkv(d, groups, local_rows, dim=0)
    if linear.endswith("linear_fc1"):
        ref = next(iter(d.values()))
        return torch.cat([d.get(p, ref.new_zeros(local_rows[p], ref.shape[1])) for p in ("gate_proj", "up_proj")])
    (only,) = d.values()
    return only


def adapter_forward(linear: str, x: Tensor, pairs: Mapping[str, tuple[Tensor, Tensor]], scale: float,
                    local_rows: dict[str, int], groups: int, *, dropout: Callable[[Tensor], Tensor] = lambda t: t,
                    col_input: Callable[[Tensor], Tensor] = lambda t: t,
                    col_mid: Callable[[Tensor], Tensor] = lambda t: t,
                    row_mid: Callable[[Tensor], Tensor] = lambda t: t,
                    row_out: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """What the adapters add to one megatron linear's output, x [s, b, in] (this rank's input as the linear gets it).
    The TP regions come in as callables (identity at TP=1): column linears see the whole input (col_input: the
    sequence-parallel gather) and sum A's gradient over TP (col_mid); row linears sum A_r x_r over TP (row_mid) and
    hand back this rank's sequence share under SP (row_out)."""
    kind = KIND[LINEARS[linear][0]]
    if kind == "col":
        h = dropout(col_input(x))
        outs = {p: col_mid(h @ a.t()) @ b.t() for p, (a, b) in pairs.items()}
        if linear.endswith("linear_qkv"):
            y = _fuse_qkv(outs, groups, local_rows, dim=-1)
        elif linear.endswith("linear_fc1"):
            ref = next(iter(outs.values()))
            y = torch.cat([outs.get(p, ref.new_zeros(*ref.shape[:-1], local_rows[p])) for p in ("gate_proj", "up_proj")],
                          dim=-1)
        else:
            (y,) = outs.values()
        return y * scale
    ((a, b),) = pairs.values()
    return row_out(row_mid(dropout(x) @ a.t()) @ b.t() * scale)


def local_rows_for(hf_config: Any, tp_size: int) -> tuple[dict[str, int], int]:
    """(each projection's output rows per TP rank, query groups per TP rank)."""
    groups = _groups(hf_config)
    if groups % tp_size:
        raise ConfigError(f"--lora-rank with --tensor-model-parallel-size {tp_size}: the model's {groups} KV heads do "
                          "not split over TP (LoRA on the fused QKV needs whole query groups per rank)")
    return {p: full_shape(hf_config, p)[0] // (tp_size if KIND[p] == "col" else 1) for p in KIND}, groups // tp_size


class MergedParams(Mapping):
    """GPTModel-level name -> tensor with every adapter merged into its base weight (W_r + scale * delta_r, this rank's
    shard), adapters themselves left out: what the bridge exports. Merges one tensor at a time, on access."""

    def __init__(self, named: Mapping[str, Tensor], scale: float, local_rows: dict[str, int], groups: int):
        self.named, self.scale, self.rows, self.groups = named, scale, local_rows, groups
        self.pairs: dict[str, dict[str, list]] = {}  # base weight name -> {proj: [A, B]}
        for n, t in named.items():
            m = _ADAPTER.fullmatch(n)
            if m is not None:
                pair = self.pairs.setdefault(m[1] + ".weight", {}).setdefault(m[2], [None, None])
                pair["AB".index(m[3])] = t
        self.names = [n for n in named if not is_adapter(n)]

    def __getitem__(self, name: str) -> Tensor:
        t = self.named[name]
        pairs = self.pairs.get(name)
        if not pairs:
            return t
        linear = name[: -len(".weight")]
        key = next(k for k in LINEARS if linear.endswith(k))
        with torch.no_grad():
            delta = local_delta(key, {p: (a.detach(), b.detach()) for p, (a, b) in pairs.items()}, self.rows,
                                self.groups, torch.float32)
            return (t.detach().float() + self.scale * delta).to(t.dtype)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


# ---------------------------------------------------------------------------------------------
# peft's adapter format


def peft_name(mcore_name: str) -> str:
    """`decoder.layers.{l}.self_attention.linear_qkv.lora.q_proj.A` (global layer) ->
    `base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight` (what PeftModel.save_pretrained writes)."""
    m = _ADAPTER.fullmatch(mcore_name)
    lm = _LAYER.fullmatch(mcore_name)
    if m is None or lm is None:
        raise ValueError(f"not a decoder-layer LoRA parameter: {mcore_name}")
    proj = m[2]
    return f"base_model.model.model.layers.{lm[1]}.{HF_MODULE[proj]}.{proj}.lora_{m[3]}.weight"


# any module prefix: peft's file names (base_model.model.), a backend's wrapper (FSDP's `lm.`)
_PEFT = re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


def from_peft(name: str) -> str | None:
    """Inverse of peft_name (also takes peft's in-memory `lora_A.default.weight` under any module prefix); None for
    other names."""
    m = _PEFT.fullmatch(name)
    if m is None or m[3] not in KIND:
        return None
    linear = next(lin for lin, projs in LINEARS.items() if m[3] in projs)
    return f"decoder.layers.{m[1]}.{linear}.lora.{m[3]}.{m[4]}"


def adapter_config(rank: int, alpha: int, dropout: float, targets: Iterable[str], base: str) -> dict:
    """adapter_config.json as peft reads it (LoraConfig fields; the rest keep peft's defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": sorted(set(targets)), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "init_lora_weights": True, "base_model_name_or_path": base}


def write_peft_dir(path: str, tensors: Mapping[str, Tensor], config: dict) -> None:
    import os

    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


# ---------------------------------------------------------------------------------------------
# On the megatron model (imports megatron-core)


class _Pair(nn.Module):
    def __init__(self, a: Tensor, b: Tensor):
        super().__init__()
        self.A, self.B = nn.Parameter(a), nn.Parameter(b)


class Lora:
    """The adapters of one backend's model chunks: the switch the reference pass flips, and what export reads."""

    def __init__(self, scale: float, dropout: float, targets: dict[str, tuple[str, ...]], local_rows: dict[str, int],
                 groups: int):
        self.scale, self.p, self.targets, self.rows, self.groups = scale, dropout, targets, local_rows, groups
        self.enabled = True
        self.hf_targets = sorted({p for projs in targets.values() for p in projs})

    def disabled(self):
        """The base model (the reference policy of a LoRA run)."""
        import contextlib

        @contextlib.contextmanager
        def off():
            was, self.enabled = self.enabled, False
            try:
                yield
            finally:
                self.enabled = was
        return off()

    def merged(self, named: Mapping[str, Tensor]) -> MergedParams:
        return MergedParams(named, self.scale, self.rows, self.groups)


def attach(chunks: list, hf_config: Any, config: Any, m: Any, seed: int, layer_offset: Callable[[Any], int]) -> Lora:
    """Add adapters to the (unwrapped, weights loaded) GPTModel chunks and freeze everything else; before DDP wraps them.
    m: ModelConfig (--lora-*)."""
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers as tpl
    from megatron.core.tensor_parallel import mappings as tpm
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    targets = resolve_targets(hf_config, m.lora_targets())
    tp, tp_rank = config.tensor_model_parallel_size, ps.get_tensor_model_parallel_rank()
    rows, groups = local_rows_for(hf_config, tp)
    lora = Lora(m.lora_alpha / m.lora_rank, m.lora_dropout, targets, rows, groups)
    sp = config.sequence_parallel
    tp_group = ps.get_tensor_model_parallel_group()
    regions = dict(
        col_input=(lambda t: tpm.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False,
                                                                      group=tp_group)) if sp else (lambda t: t),
        col_mid=(lambda t: tpm.copy_to_tensor_model_parallel_region(t, group=tp_group)) if tp > 1 else (lambda t: t),
        row_mid=(lambda t: tpm.reduce_from_tensor_model_parallel_region(t, group=tp_group)) if tp > 1 else (lambda t: t),
        row_out=(lambda t: tpm.scatter_to_sequence_parallel_region(t, group=tp_group)) if sp else (lambda t: t))
    drop = nn.Dropout(m.lora_dropout)

    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        off = layer_offset(chunk)
        for i, layer in enumerate(chunk.decoder.layers):
            for linear_name, projs in targets.items():
                linear = layer.get_submodule(linear_name)
                w = linear.weight
                adapters = nn.ModuleDict()
                axes = {"weight": 0 if isinstance(linear, tpl.ColumnParallelLinear) else 1}
                if isinstance(linear, tpl.ColumnParallelLinear):
                    axes["bias"] = 0
                for proj in projs:
                    a, b = init_adapter(seed, off + i, proj, m.lora_rank, full_shape(hf_config, proj))
                    a, b = shard_adapter(proj, a, b, tp_rank, tp)
                    pair = _Pair(a.to(w.device, w.dtype), b.to(w.device, w.dtype))
                    for which in "AB":
                        axis = tp_axis(proj, which)
                        if axis is not None and tp > 1:
                            tpl.set_tensor_model_parallel_attributes(getattr(pair, which), True, axis, 1)
                            axes[f"lora.{proj}.{which}"] = axis
                    adapters[proj] = pair
                linear.lora = adapters

                def hook(mod, args, kwargs, output, _name=linear_name):
                    if not lora.enabled:
                        return output
                    x = args[0] if args else kwargs["input_"]
                    pairs = {p: (pr.A, pr.B) for p, pr in mod.lora.items()}
                    y = adapter_forward(_name, x, pairs, lora.scale, rows, groups,
                                        dropout=drop if (mod.training and lora.p > 0) else (lambda t: t), **regions)
                    return (output[0] + y.to(output[0].dtype), *output[1:])

                linear.register_forward_hook(hook, with_kwargs=True)

                def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None, _axes=axes):
                    return make_sharded_tensors_for_checkpoint(
                        self.state_dict(prefix="", keep_vars=True), prefix, _axes, sharded_offsets,
                        tp_group=tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group")
                        or ps.get_data_parallel_group(with_context_parallel=True))

                linear.sharded_state_dict = types.MethodType(sharded_state_dict, linear)
        emb = getattr(chunk, "embedding", None)
        if emb is not None:  # recompute (activation checkpointing) needs an input that requires grad to reach the adapters
            emb.register_forward_hook(lambda mod, args, out: out.requires_grad_(True) if torch.is_grad_enabled() else out)
    return lora


def load_full_adapters(chunks: list, full: Mapping[str, Tensor], layer_offset: Callable[[Any], int], tp_rank: int,
                       tp_size: int) -> int:
    """Copy full (unsharded) adapters named by global-layer megatron names (`from_peft` of a peft state dict) into the
    chunks' adapters, each rank its own shard; returns how many parameters were set."""
    n = 0
    with torch.no_grad():
        for chunk in chunks:
            off = layer_offset(chunk)
            for i, layer in enumerate(chunk.decoder.layers):
                for linear_name in LINEARS:
                    linear = layer.get_submodule(linear_name)
                    for proj, pair in getattr(linear, "lora", {}).items():
                        key = f"decoder.layers.{off + i}.{linear_name}.lora.{proj}."
                        if key + "A" not in full:
                            continue
                        a, b = shard_adapter(proj, full[key + "A"], full[key + "B"], tp_rank, tp_size)
                        pair.A.copy_(a)
                        pair.B.copy_(b)
                        n += 2
    return n


def stream_to_peft(stream: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(global megatron adapter name, full tensor) -> peft's names."""
    for name, t in stream:
        yield peft_name(name), t
