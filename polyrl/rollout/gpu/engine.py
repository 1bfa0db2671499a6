"""The embedded engine's GPU path: own model forward, paged KV cache, continuous batching,
prefix sharing, CUDA-graph decode and a fused GPU sampler, behind the RolloutEngine protocol.

One generate() call:
  1. every prompt becomes a group of its n samples, waiting in order;
  2. admission: while slots (--rollout-batch-generate, default 512) and KV blocks allow, a
     group is admitted with blocks for its full length reserved up front (so nothing is ever
     preempted); its prompt is prefilled once (varlen, up to `max_prefill_tokens` per
     forward) and the n samples share the prompt's full blocks; the partial last block is
     copied per sample;
  3. decode: one token for every running sequence per step (a CUDA graph replay at the
     smallest captured batch size >= the running count, with the top-k / top-p thresholds and
     the sampler inside it); finished
     sequences give their blocks and slots back at once, and waiting groups are admitted
     into them before the next step. Step t+1 is launched before step t's tokens are read,
     so the host's bookkeeping (stop checks, retiring rows) overlaps the GPU's work; a row
     that finished at step t computes one extra token, which is dropped.

Per-sequence state lives in slot-indexed device buffers (next token, context length, block
table, sampling settings); running sequences always occupy slots [0, b), so a step reads
a prefix of every buffer and a graph of batch size B reads rows [0, B) (rows past b are
dummies that write into the reserved scratch block).

Sampling draws from a counter-based random stream per sample (seeded from
the prompt's seed and the sample's index: polyrl.rollout.sampling.sample_seed), so results do not depend on batch
composition, admission order or --rollout-batch-generate.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from transformers import AutoTokenizer

from polyrl.backends.routing_replay import routes_dtype
from polyrl.rollout.base import NO_TOP_LOGPROBS, GenerateWatch, InProcessEngine, wake_tags
from polyrl.rollout.detokenize import Detokenizer
from polyrl.rollout.gpu import ops as ref_ops
from polyrl.rollout.gpu.graphs import GraphSets, capture
from polyrl.rollout.gpu.kv_cache import KV_CACHE_DTYPES, BlockAllocator, KVCache
from polyrl.rollout.lengths import FORCED_LOGPROB, mark_forced
from polyrl.rollout.gpu.model import (DecodeAttn, DenseLM, PrefillAttn, iter_checkpoint, load_config, rope_tables,
                                      spec_from_config)
from polyrl.rollout.sampling import sample_seed
from polyrl.types import Sample, SamplingParams

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
MAX_RUNNING = 512  # default most sequences decoding at once (64 prompts x 8 samples decode as one batch)
STOP_CHECK_STEPS = 8  # how often generate() asks should_stop about its prompts


@dataclass
class _Group:
    """Samples [first, first + n) of prompt `index`, admitted and prefilled together."""
    index: int
    prompt: list[int]
    first: int
    n: int
    max_new: int  # its budget (a resumed partial response has what is left of its own)


@dataclass
class _Seq:
    sample: int  # position in generate()'s output
    group: _Group
    shared: list[int]  # prompt blocks shared with the group's other samples
    own: list[int]  # blocks this sequence alone holds
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    done: bool = False
    routes: list[torch.Tensor] = field(default_factory=list)  # MoE, when asked: the prompt's [P, layers, k], then a [layers, k] per decode step
    stop_len: int = 0  # the length-controlled workload's forced EOS (0: none)


@dataclass
class _Step:
    """A launched decode step whose tokens are still on their way to the host."""
    seqs: list[_Seq]  # the rows it computed, in row order at launch
    buf: int  # which pinned host buffer it copies into
    copied: torch.cuda.Event | None


def unsupported_reason(hf_checkpoint: str) -> str | None:
    """None when the GPU path can run this checkpoint, else why not."""
    try:
        cfg = load_config(hf_checkpoint)
    except Exception as e:  # noqa: BLE001 (reported as the fallback reason)
        return f"its config could not be read ({e})"
    return spec_from_config(cfg)[1]


class GPUEngine(InProcessEngine):
    def __init__(self, hf_checkpoint: str, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                 max_batch: int = 0, mem_fraction: float = 0.4, cuda_graph: bool = True, block_size: int = 16,
                 max_prefill_tokens: int = 16384, num_kv_blocks: int | None = None, max_model_len: int | None = None,
                 use_triton: bool | None = None, decode_splits: int | None = None, ignore_eos: bool = False,
                 profile: bool = False, quantization: str = "none", kv_cache_dtype: str = "auto"):
        """max_batch: most sequences decoding at once (0: MAX_RUNNING). mem_fraction: share of the
        GPU's memory for weights + KV cache + workspace; the KV cache gets what is left
        (num_kv_blocks overrides it, e.g. on CPU). ignore_eos: never stop on EOS (benchmarks
        with random weights). profile: time GPU work with events (last_stats). quantization: "fp8" keeps the decoder
        linears in FP8 with block scales and runs them with FP8 kernels (--rollout-quantization fp8; the memory saved
        goes to the KV cache), and update_weights takes the quantized stream as it is. kv_cache_dtype: "auto" (the
        model dtype) or "fp8_e4m3" (E4M3 with per-token, per-head scales: about twice the tokens in the same memory;
        kv_cache.KVCache)."""
        if quantization not in ("none", "fp8"):
            raise ValueError(f"--rollout-quantization {quantization!r}: the GPU engine runs none or fp8")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: the GPU engine keeps its KV cache in one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        self.kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or dtype
        cfg = load_config(hf_checkpoint)
        spec, why = spec_from_config(cfg)
        if spec is None:
            raise ValueError(f"{hf_checkpoint}: the GPU engine does not support this model: {why}")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.dtype, self.spec = dtype, spec
        self.tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        self.eos_id = None if ignore_eos else self.tokenizer.eos_token_id
        self.version = 0
        if use_triton is None:
            use_triton = self.is_cuda
        if use_triton:
            from polyrl.rollout.gpu import triton_ops
            self.ops = triton_ops
        else:
            self.ops = ref_ops
        self.cuda_graph = cuda_graph and self.is_cuda
        self.profile = profile and self.is_cuda
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_running = max_batch or MAX_RUNNING
        self.max_len = min(spec.max_pos, max_model_len or spec.max_pos)

        self.model = DenseLM(spec, self.device, dtype, self.ops, fp8=quantization == "fp8")
        self.model.load(iter_checkpoint(hf_checkpoint), strict=True)
        cos, sin = rope_tables(cfg, spec, self.max_len, dtype)
        if num_kv_blocks is None:
            num_kv_blocks = self._blocks_from_budget(mem_fraction)
        self.kv = KVCache(spec.layers, spec.kv_heads, spec.head_dim, num_kv_blocks, block_size, dtype, self.device,
                          cos.to(self.device), sin.to(self.device), kv_dtype=self.kv_dtype)
        self.alloc = BlockAllocator(num_kv_blocks)

        R, W = self.max_running, -(-self.max_len // block_size)
        dev = self.device
        self.tokens = torch.zeros(R, dtype=torch.long, device=dev)
        self.ctx = torch.ones(R, dtype=torch.int32, device=dev)
        self.bt = torch.zeros(R, W, dtype=torch.int32, device=dev)
        self.inv_temp = torch.ones(R, dtype=torch.float32, device=dev)
        self.noise = torch.zeros(R, dtype=torch.int32, device=dev)
        self.thresh = torch.full((R,), float("-inf"), dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(R, dtype=torch.long, device=dev)
        self.live = torch.zeros(R, dtype=torch.int32, device=dev)  # 1 for running rows, 0 for a graph's dummy rows
        self._state = (self.tokens, self.ctx, self.bt, self.inv_temp, self.noise, self.thresh, self.seeds, self.live)
        self.step_tok = torch.zeros(R, dtype=torch.long, device=dev)  # a decode step's sampled tokens and log-probs
        self.step_lp = torch.zeros(R, dtype=torch.float32, device=dev)
        self.top_k_dev = torch.zeros(1, dtype=torch.int32, device=dev)  # the call's top-k / top-p, read by the
        self.top_p_dev = torch.ones(1, dtype=torch.float32, device=dev)  # graphs' threshold kernel at each replay
        pin = self.is_cuda
        self.h_tok = torch.zeros(3, R, dtype=torch.long, pin_memory=pin)  # prefill, and two alternating decode steps
        self.h_lp = torch.zeros(3, R, dtype=torch.float32, pin_memory=pin)
        self.split_len = torch.full((1,), 1 << 30, dtype=torch.int32, device=dev)
        self.route_buf = self.h_routes = None
        if spec.moe_layers:  # every decode step (graph) writes its routes here; copied out when a request asks
            shape, rdt = (R, spec.layers, spec.top_k), routes_dtype(spec.experts)
            self.route_buf = torch.full(shape, -1, dtype=rdt, device=dev)  # -1 stays in the layers without experts
            self.h_routes = torch.full((3, *shape), -1, dtype=rdt, pin_memory=pin)
        self._want_routes = False
        self._split_val = -1
        self.sm_count = torch.cuda.get_device_properties(dev).multi_processor_count if self.is_cuda else 1
        self.decode_splits = decode_splits
        self.buckets = [b for b in BUCKETS if b < R] + [R]
        self._graph_sets = GraphSets()  # decode graphs per (weights, KV cache) addresses: a graph reads them baked in
        self.graph_pool = None
        self._capture_s = 0.0  # seconds of decode-graph capture since stats()
        self.logits_buf: torch.Tensor | None = None
        self._cpu_flat: torch.Tensor | None = None
        self.asleep = False
        self._stale = False  # awake, but the GPU buffer does not hold the weights yet (see wake)
        self._host_valid = True  # False after a sleep that kept no host copy, until a full update
        self._graph_sets.use(self._addresses())
        self.running: list[_Seq] = []
        self.last_stats: dict = {}
        self.rescore = None  # --true-on-policy: polyrl.backends.true_on_policy.EngineScorer
        self._watch: GenerateWatch | None = None
        self._forced_eos: int | None = None
        self._generate_s = 0.0  # generate calls' wall time since stats(), the scoring pass apart
        log.info("GPU rollout engine: %s, %d layers, weights %.2f GiB%s, KV cache %d blocks x %d tokens (%.2f GiB%s), "
                 "CUDA graphs %s, Triton kernels %s", spec.arch, spec.layers, self.model.nbytes / 2**30,
                 " (linears FP8)" if self.model.fp8 else "", num_kv_blocks, block_size, self.kv.nbytes / 2**30,
                 ", FP8" if self.kv.fp8 else "",
                 self.cuda_graph, use_triton)

    @property
    def loads_fp8_weights(self) -> bool:
        """Whether update_weights should get the FP8 stream as it is (its linears are FP8), not dequantized."""
        return self.model.fp8

    @property
    def reports_routed_experts(self) -> bool:
        """Whether generate() can fill Sample.routed_experts (SamplingParams.return_routed_experts)."""
        return bool(self.spec.moe_layers)

    # ---- memory budget ---------------------------------------------------------------------
    def _workspace_bytes(self) -> int:
        s, el = self.spec, torch.empty((), dtype=self.dtype).element_size()
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        mlp = 3 * s.inter
        if s.moe_layers:  # k (token, expert) rows per token: gathered input, gate|up, activation, output, sorted copy
            mlp = max(mlp, s.top_k * (3 * s.moe_inter + 3 * s.hidden))
        prefill = self.max_prefill_tokens * (6 * s.hidden + 3 * qkv + 2 * s.heads * s.head_dim + mlp) * el
        logits = self.max_running * s.vocab * (2 * el + 8)  # graph logits + sampler / filter temporaries
        if self.model.fp8:  # prefill's FP8 linears on cuBLAS: one weight dequantized, or the activations in E4M3
            mats = [(qkv, s.hidden), (s.hidden, s.heads * s.head_dim), (2 * s.inter, s.hidden), (s.hidden, s.inter)]
            prefill += max(max(n * k for n, k in mats) * el, self.max_prefill_tokens * max(k for _, k in mats) * 33 // 32)
            if s.moe_layers:  # prefill's FP8 experts: one layer's gate|up experts dequantized (fp8.EXPERTS_DEQUANT_MIN_ROWS)
                prefill += s.experts * 2 * s.moe_inter * s.hidden * el
        return prefill + logits + 512 * 2**20

    def _blocks_from_budget(self, mem_fraction: float) -> int:
        if not self.is_cuda:
            return 1 + 4 * self.max_running * -(-256 // self.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        s = self.spec
        per_block = KVCache.bytes_per_block(s.layers, s.kv_heads, s.head_dim, self.block_size, self.kv_dtype)
        kv_bytes = mem_fraction * total - self.model.nbytes - self._workspace_bytes()
        blocks = int(kv_bytes // per_block)
        need = 2 + -(-self.max_len // self.block_size)
        if blocks < min(need, 64):
            raise RuntimeError(
                f"--rollout-mem-fraction {mem_fraction} gives {mem_fraction * total / 2**30:.1f} GiB, but weights take "
                f"{self.model.nbytes / 2**30:.1f} GiB and the workspace ~{self._workspace_bytes() / 2**30:.1f} GiB: no room "
                f"for a KV cache; raise --rollout-mem-fraction or lower --rollout-batch-generate")
        free = torch.cuda.mem_get_info(self.device)[0]
        if blocks * per_block > free - 256 * 2**20:
            raise RuntimeError(
                f"--rollout-mem-fraction {mem_fraction} asks for a {blocks * per_block / 2**30:.1f} GiB KV cache but only "
                f"{free / 2**30:.1f} GiB of GPU memory is free; lower --rollout-mem-fraction (or offload the trainer first)")
        return blocks

    # ---- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, should_stop=None,
                 watch: GenerateWatch | None = None) -> list[Sample]:
        """should_stop(prompt index): asked between decode steps; True ends that prompt's rows with the tokens they
        have (finish reason "abort"): an aborted server request. watch: told of each sample as it finishes; its stop
        ends every unfinished row the same way (rows not admitted yet come back empty)."""
        if self.asleep:
            raise RuntimeError("generate() on a sleeping engine; call wake() first")
        self._restore()
        sp, M = params, params.max_new_tokens
        if M < 1:
            raise ValueError("max_new_tokens must be >= 1")
        for i, p in enumerate(prompts):
            if not p or len(p) + sp.max_new_tokens_of(i) > self.max_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + {sp.max_new_tokens_of(i)} new tokens must be in "
                                 f"[1, {self.max_len}] (the model's max positions)")
        if sp.return_routed_experts and not self.reports_routed_experts:
            raise ValueError("return_routed_experts: this model has no MoE router to report")
        if sp.top_logprobs:
            raise ValueError(NO_TOP_LOGPROBS)
        self._want_routes = sp.return_routed_experts
        self._sp = sp
        self._stop_ids = set(sp.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set())
        self._base_seed = sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self._filter = not sp.greedy and (0 < sp.top_k < self.spec.vocab or sp.top_p < 1.0)
        # the Triton threshold kernel reads top-k / top-p from device memory, so a filtered step is one graph too
        self._filter_in_graph = self._filter and self.ops is not ref_ops and self.dtype in (torch.bfloat16, torch.float16)
        if self._filter_in_graph:
            self.top_k_dev.fill_(sp.top_k)
            self.top_p_dev.fill_(sp.top_p)
        self._results: list[Sample | None] = [None] * (len(prompts) * sp.n)
        R = self.max_running
        waiting = deque(_Group(i, list(p), j, min(sp.n - j, R), sp.max_new_tokens_of(i)) for i, p in enumerate(prompts)
                        for j in range(0, sp.n, R))
        self._watch, self._forced_eos = watch, self.tokenizer.eos_token_id
        self.running = []
        self._max_ctx = 0
        self.alloc = BlockAllocator(self.alloc.num_blocks)  # nothing outlives a call (also after an exception)
        self.ctx.fill_(1)
        self.bt.zero_()
        self.tokens.zero_()
        self.live.zero_()
        st = self.last_stats = {"prefill_s": 0.0, "steps": 0, "graph_capture_s": 0.0, "ttft_s": [], "prefill_tokens": 0,
                                "events": []}
        self._t0 = time.perf_counter()
        self._pending: _Step | None = None
        self._nsteps = 0
        self._detok = Detokenizer(self.tokenizer)
        while waiting or self.running or self._pending:
            stop_all = watch is not None and watch.stop.is_set()
            # a server's per-request check every STOP_CHECK_STEPS decode steps: a Python call per prompt each step
            # would cost a few percent of a 2 ms step; a stopped row's extra tokens are its own, and kept
            if stop_all or (should_stop is not None and self._nsteps % STOP_CHECK_STEPS == 0):
                self._stop_rows(waiting, should_stop, stop_all)
            if waiting and self._fits(waiting[0]):
                self._drain()
                self._admit(waiting)
            if not self.running:
                if self._pending:
                    self._drain()
                elif waiting and not self._fits(waiting[0]):
                    g = waiting[0]
                    raise RuntimeError(
                        f"prompt {g.index} ({len(g.prompt)} tokens, {g.n} samples x {g.max_new} new tokens) needs "
                        f"{self._blocks_needed(len(g.prompt), g.n)} KV blocks but the cache has {self.alloc.num_blocks - 1}; "
                        f"raise --rollout-mem-fraction or lower --n-samples-per-prompt / --rollout-max-response-len")
                continue
            # launch step t+1 before reading step t's tokens: the host's bookkeeping overlaps the GPU's work
            # (a row that finished at step t gets one extra, discarded token)
            launched = self._launch_step()
            prev, self._pending = self._pending, launched
            if prev is not None:
                self._process(prev)
        self._detok.finish()
        self._finish_stats()
        self._generate_s += self.last_stats["wall_s"]
        if self.rescore is not None:  # --true-on-policy: report the trainer's scoring of each sample, not the decode's
            self.rescore(self._results, sp)
            if self._watch is not None:  # only now do the samples carry the log-probs they report
                for i, smp in enumerate(self._results):
                    if smp.finish_reason != "abort":
                        self._watch.finished(i, smp)
        return self._results  # type: ignore[return-value]

    def stats(self) -> dict[str, float]:
        """Since the last call: the generate calls' wall time (prefill and decode; with --true-on-policy the scoring
        pass is rollout/score_s), the decode CUDA graphs captured (for new batch buckets, or for weights and a KV cache
        that came back at a place no kept set was captured for) and their capture time; with --true-on-policy, the
        scorer's figures."""
        out = {"rollout/generate_s": self._generate_s, **self.occupancy_stats()} if self._generate_s else {}
        self._generate_s = 0.0
        if self.cuda_graph:
            out.update({"rollout/graph_captures": float(self._graph_sets.drain()[0]),
                        "rollout/graph_capture_s": self._capture_s})
            self._capture_s = 0.0
        if self.rescore is not None:
            out.update(self.rescore.stats())
        return out

    def _stop_rows(self, waiting: deque, should_stop, stop_all: bool) -> None:
        """End the rows the caller stopped (all of them, or those should_stop names) with the tokens they have."""
        if not stop_all and not any(should_stop(i) for i in {seq.group.index for seq in self.running}
                                    | {g.index for g in waiting}):
            return
        self._drain()  # the look-ahead step's tokens are the rows' own: keep them
        stopped = lambda i: stop_all or should_stop(i)  # noqa: E731
        for g in [g for g in waiting if stopped(g.index)]:
            waiting.remove(g)
            for j in range(g.n):
                self._results[g.index * self._sp.n + g.first + j] = Sample(
                    prompt_ids=list(g.prompt), response_ids=[], rollout_logprobs=[], finish_reason="abort",
                    group_index=g.index)
        done = [(seq, "abort") for seq in self.running if not seq.done and stopped(seq.group.index)]
        for seq, _ in done:
            seq.done = True
        self._retire(done)

    def _fits(self, g: _Group) -> bool:
        return (g.n <= self.max_running - len(self.running)
                and self._blocks_needed(len(g.prompt), g.n, g.max_new) <= self.alloc.num_free)

    def _blocks_needed(self, P: int, n: int, max_new: int | None = None) -> int:
        bs = self.block_size
        full = P // bs
        return full + n * (-(-(P + (max_new or self._sp.max_new_tokens) - 1) // bs) - full)

    def _admit(self, waiting: deque) -> int:
        batch, tokens, admitted = [], 0, 0
        free_slots = self.max_running - len(self.running)
        free_blocks = self.alloc.num_free
        while waiting:
            g = waiting[0]
            need = self._blocks_needed(len(g.prompt), g.n, g.max_new)
            if g.n > free_slots or need > free_blocks:
                break
            if batch and tokens + len(g.prompt) > self.max_prefill_tokens:
                self._prefill(batch)
                batch, tokens = [], 0
            waiting.popleft()
            batch.append(g)
            tokens += len(g.prompt)
            free_slots -= g.n
            free_blocks -= need
            admitted += 1
        if batch:
            self._prefill(batch)
        return admitted

    def _prefill(self, groups: list[_Group]) -> None:
        t = time.perf_counter()
        ev = self._event()
        bs, sp, dev = self.block_size, self._sp, self.device
        new: list[_Seq] = []
        ids, slots, lens, bt_rows, seeds, ctxs = [], [], [], [], [], []
        copy_src, copy_dst = [], []
        for g in groups:
            P, M = len(g.prompt), g.max_new
            full = P // bs
            own_n = -(-(P + M - 1) // bs) - full
            shared = self.alloc.allocate(full)
            self.alloc.share(shared, g.n - 1)
            owns = [self.alloc.allocate(own_n) for _ in range(g.n)]
            table = torch.tensor(shared + owns[0], dtype=torch.long)
            p = torch.arange(P)
            slots.append(table[p // bs] * bs + p % bs)
            ids.append(torch.tensor(g.prompt, dtype=torch.long))
            lens.append(P)
            if P % bs and g.n > 1:
                copy_src += [owns[0][0]] * (g.n - 1)
                copy_dst += [o[0] for o in owns[1:]]
            for j in range(g.n):
                k = g.index * sp.n + g.first + j
                new.append(_Seq(k, g, shared, owns[j], stop_len=sp.stop_length_of(g.index, g.first + j)))
                bt_rows.append(shared + owns[j])
                seeds.append(sample_seed(sp, self._base_seed, g.index, g.first + j))
                ctxs.append(P)
        lens_t = torch.tensor(lens)
        pos = torch.cat([torch.arange(n) for n in lens])
        last = (torch.cumsum(lens_t, 0) - 1).to(dev)
        routes = None
        if self._want_routes:
            routes = torch.full((sum(lens), *self.route_buf.shape[1:]), -1, dtype=self.route_buf.dtype, device=dev)
        logits = self.model.forward(torch.cat(ids).to(dev), pos.to(dev), torch.cat(slots).to(dev), self.kv,
                                    PrefillAttn(self.ops, lens, dev, self.dtype), logits_rows=last, routes=routes)
        if routes is not None:  # every prompt token is forwarded: its route is the sample's first P rows
            per_prompt = routes.cpu().split(lens)
            for seq, r in zip(new, (r for r, g in zip(per_prompt, groups) for _ in range(g.n))):
                seq.routes.append(r)
        self.kv.copy_blocks(copy_src, copy_dst)
        rows = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([g.n for g in groups])).to(dev)
        logits = logits[rows]
        # sampling settings of the new rows, written into their slots [b0, b0 + N)
        b0, N = len(self.running), len(new)
        sl = slice(b0, b0 + N)
        widths = torch.tensor([len(row) for row in bt_rows])
        bt = torch.zeros(N, int(widths.max()), dtype=torch.int32)  # one scatter, not a tensor per row
        bt[torch.arange(bt.shape[1]) < widths[:, None]] = torch.tensor(list(itertools.chain.from_iterable(bt_rows)),
                                                                      dtype=torch.int32)
        self.bt[sl] = 0
        self.bt[sl, :bt.shape[1]] = bt.to(dev)
        self.inv_temp[sl] = 1.0 if sp.greedy else 1.0 / sp.temperature
        self.noise[sl] = 0 if sp.greedy else 1
        self.seeds[sl] = torch.tensor(seeds, dtype=torch.long).to(dev)
        counters = torch.tensor(ctxs, dtype=torch.int32).to(dev)
        if self._filter:
            self.thresh[sl] = self.ops.filter_thresholds(logits, self.inv_temp[sl], sp.top_k, sp.top_p)
        else:
            self.thresh[sl] = float("-inf")
        tok, lp = self.ops.sample(logits, self.inv_temp[sl], self.noise[sl], self.thresh[sl], self.seeds[sl], counters)
        self.tokens[sl] = tok
        self.ctx[sl] = counters + 1
        self.live[sl] = 1
        self.running.extend(new)
        self._max_ctx = max(self._max_ctx, max(ctxs) + 1)
        self._record(ev, "prefill")
        self.h_tok[0, :N].copy_(tok, non_blocking=True)
        self.h_lp[0, :N].copy_(lp, non_blocking=True)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.last_stats["prefill_tokens"] += sum(lens)
        now = time.perf_counter() - self._t0
        self.last_stats["ttft_s"] += [now] * N
        self._retire(self._consume(new, self.h_tok[0, :N].tolist(), self.h_lp[0, :N].tolist()))
        self.last_stats["prefill_s"] += time.perf_counter() - t

    def _launch_step(self) -> _Step:
        b = len(self.running)
        self.count_decode_step(b)
        ev = self._event()
        # the top-k / top-p thresholds, the sampler and the state update are part of the step (of its CUDA graph):
        # one launch per step. Without the Triton threshold kernel (FP32 logits, CPU) the filters run after it.
        fused = not self._filter or self._filter_in_graph
        logits = self._run_decode(b, fused)
        if fused:
            tok, lp = self.step_tok[:b], self.step_lp[:b]
        else:
            tok, lp = self._sample_and_advance(logits, b)
        self._max_ctx += 1
        self._record(ev, "decode")
        k = 1 + self._nsteps % 2  # host buffers 1 and 2 alternate (0 is the prefill's)
        self._nsteps += 1
        self.h_tok[k, :b].copy_(tok, non_blocking=True)
        self.h_lp[k, :b].copy_(lp, non_blocking=True)
        if self._want_routes:
            self.h_routes[k, :b].copy_(self.route_buf[:b], non_blocking=True)
        copied = None
        if self.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        self.last_stats["steps"] += 1
        return _Step(list(self.running), k, copied)

    def _process(self, step: _Step) -> None:
        if step.copied is not None:
            step.copied.synchronize()
        n = len(step.seqs)
        routes = self.h_routes[step.buf, :n].clone() if self._want_routes else None  # the buffer is reused two steps on
        self._retire(self._consume(step.seqs, self.h_tok[step.buf, :n].tolist(), self.h_lp[step.buf, :n].tolist(), routes))

    def _drain(self) -> None:
        if self._pending is not None:
            step, self._pending = self._pending, None
            self._process(step)

    def _consume(self, seqs: list[_Seq], toks: list[int], lps: list[float],
                 routes: torch.Tensor | None = None) -> list[tuple[_Seq, str]]:
        """Append each live row's new token (and, for a decode step that recorded them, the routes [rows, layers, k]
        of the token it forwarded); return the sequences that finished, with why."""
        stops, stop_ids = self._sp.stop, self._stop_ids
        streams = self._watch is not None and self._watch.streams
        done = []
        for j, (seq, t, lp) in enumerate(zip(seqs, toks, lps)):
            if seq.done:  # finished a step earlier; this was the look-ahead step's extra token
                continue
            if routes is not None:
                seq.routes.append(routes[j])
            if seq.stop_len and len(seq.out) + 1 == seq.stop_len and self._forced_eos is not None:
                # the drawn length: EOS in place of the sampled token; the device's next input is that token, but the
                # row is done and its look-ahead token dropped, so nothing else changes
                t, lp = self._forced_eos, FORCED_LOGPROB
                reason = "stop"
                seq.out.append(t)
                seq.lps.append(lp)
                if streams:
                    self._watch.token(seq.sample, t)
                seq.done = True
                done.append((seq, reason))
                continue
            seq.out.append(t)
            seq.lps.append(lp)
            if streams:
                self._watch.token(seq.sample, t)
            if t in stop_ids or (stops and self._hit_stop_string(seq.out, stops)):
                reason = "stop"
            elif len(seq.out) >= seq.group.max_new:
                reason = "length"
            else:
                continue
            seq.done = True
            done.append((seq, reason))
        return done

    def _hit_stop_string(self, response: list[int], stops: list[str]) -> bool:
        tail = self.tokenizer.decode(response[-16:], skip_special_tokens=True)  # a stop string ends in the tail
        return any(s in tail for s in stops)

    def _retire(self, done: list[tuple[_Seq, str]]) -> None:
        """Store finished samples, free their blocks, and compact the running rows to [0, b)."""
        if not done:
            return
        finished = []
        for seq, reason in done:
            g = seq.group
            finished.append(Sample(
                prompt_ids=list(g.prompt), response_ids=seq.out, rollout_logprobs=seq.lps, finish_reason=reason,
                group_index=g.index,
                routed_experts=(torch.cat([seq.routes[0], *([torch.stack(seq.routes[1:])] if len(seq.routes) > 1 else [])])
                                if self._want_routes else None)))
            mark_forced(finished[-1], seq.stop_len)
            self._results[seq.sample] = finished[-1]
            # its reader (a reward function, a server's answer) needs the text now; a sample to be rescored waits
            if self._watch is not None and reason != "abort" and self.rescore is None:
                finished[-1].response = self.tokenizer.decode(seq.out, skip_special_tokens=True)
                self._watch.finished(seq.sample, finished.pop())
            self.alloc.release(seq.shared)
            self.alloc.release(seq.own)
        self._detok.add(finished)  # their texts, on worker threads while the next steps run
        b = len(self.running)
        keep = [r for r, seq in enumerate(self.running) if not seq.done]
        self.running = [self.running[r] for r in keep]
        m = len(keep)
        if keep != list(range(m)):
            idx = torch.tensor(keep, device=self.device)
            for buf in self._state:
                buf[:m] = buf[idx]
        self.ctx[m:b] = 1  # dummy rows: one cached token, in the scratch block
        self.bt[m:b] = 0
        self.tokens[m:b] = 0
        self.live[m:b] = 0
        if not self.running:
            self._max_ctx = 0

    # ---- decode forward, CUDA graphs -------------------------------------------------------
    def _num_splits(self, b: int) -> int:
        if self.ops is ref_ops:
            return 1
        if self.decode_splits is not None:
            return self.decode_splits
        progs = b * self.spec.kv_heads
        if progs * 2 >= self.sm_count:
            return 1
        return min(16, 1 << math.ceil(math.log2(self.sm_count / progs)))

    def _decode_forward(self, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self.ctx[:b]
        pos = (ctx - 1).long()
        blk = self.bt[:b].gather(1, (pos // self.block_size)[:, None]).squeeze(1).long()
        slots = blk * self.block_size + pos % self.block_size
        attn = DecodeAttn(self.ops, self.bt[:b], ctx, self.block_size, self._num_splits(b), self.split_len,
                          self.model.fp8_attention_out(b))
        routes = self.route_buf[:b] if self.route_buf is not None else None
        return self.model.forward(self.tokens[:b], pos, slots, self.kv, attn, out=out, routes=routes)

    def _sample_and_advance(self, logits: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample rows [0, b) and make the tokens the next step's input; a dummy row's context stays one token."""
        if self._filter:
            k, p = (self.top_k_dev, self.top_p_dev) if self._filter_in_graph else (self._sp.top_k, self._sp.top_p)
            self.thresh[:b] = self.ops.filter_thresholds(logits, self.inv_temp[:b], k, p)
        tok, lp = self.ops.sample(logits, self.inv_temp[:b], self.noise[:b], self.thresh[:b], self.seeds[:b], self.ctx[:b])
        self.tokens[:b] = tok
        self.ctx[:b] += self.live[:b]
        return tok, lp

    def _decode_step(self, b: int, sample: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._decode_forward(b, out)
        if sample:
            tok, lp = self._sample_and_advance(logits, b)
            self.step_tok[:b] = tok
            self.step_lp[:b] = lp
        return logits

    def _run_decode(self, b: int, sample: bool) -> torch.Tensor:
        """One decode step of the b running rows: its logits; with `sample`, also the sampled tokens (step_tok,
        step_lp) made the next step's input."""
        B = next(x for x in self.buckets if x >= b) if self.cuda_graph else b
        ns = self._num_splits(B)
        if ns > 1:  # keep split_len * ns >= the longest context, in 64-token steps
            want = -(-self._max_ctx // (ns * 64)) * 64
            if want > self._split_val or 2 * want < self._split_val:
                self._split_val = want
                self.split_len.fill_(want)
        if not self.cuda_graph:
            return self._decode_step(b, sample)
        key = (B, sample, sample and self._filter)  # a filtered step's graph also holds the threshold kernel
        self._graph_sets.get(key, lambda: self._capture(B, sample)).replay()
        return self.logits_buf[:b]

    def _capture(self, B: int, sample: bool) -> torch.cuda.CUDAGraph:
        t = time.perf_counter()
        if self.logits_buf is None:
            self.logits_buf = torch.empty(self.max_running, self.spec.vocab, dtype=self.dtype, device=self.device)
            self.graph_pool = torch.cuda.graph_pool_handle()
        out = self.logits_buf[:B]

        def warmup():  # the step it takes is undone
            saved = (self.tokens[:B].clone(), self.ctx[:B].clone())
            self._decode_step(B, sample, out)
            self.tokens[:B].copy_(saved[0])
            self.ctx[:B].copy_(saved[1])
        g, _ = capture(lambda: self._decode_step(B, sample, out), warmup=warmup, pool=self.graph_pool, device=self.device)
        dt = time.perf_counter() - t
        self.last_stats["graph_capture_s"] = self.last_stats.get("graph_capture_s", 0.0) + dt
        self._capture_s += dt
        return g

    # ---- timing ------------------------------------------------------------------------------
    def _event(self):
        if not self.profile:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _record(self, start, kind: str) -> None:
        if start is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.last_stats["events"].append((kind, start, e))

    def _finish_stats(self) -> None:
        st = self.last_stats
        st["wall_s"] = time.perf_counter() - self._t0
        st["decode_s"] = st["wall_s"] - st["prefill_s"]
        st["tokens"] = sum(len(s.response_ids) for s in self._results)
        ev = st.pop("events")
        if ev:
            torch.cuda.synchronize(self.device)
            st["gpu_prefill_s"] = sum(a.elapsed_time(b) for k, a, b in ev if k == "prefill") / 1e3
            st["gpu_decode_s"] = sum(a.elapsed_time(b) for k, a, b in ev if k == "decode") / 1e3
            busy = st["gpu_prefill_s"] + st["gpu_decode_s"]
            st["python_overhead_share"] = max(0.0, 1.0 - busy / st["wall_s"])
            st["decode_python_overhead_share"] = max(0.0, 1.0 - st["gpu_decode_s"] / max(st["decode_s"], 1e-9))
        ttft = st.pop("ttft_s")
        st["ttft_first_s"], st["ttft_mean_s"] = (min(ttft), sum(ttft) / len(ttft)) if ttft else (0.0, 0.0)

    # ---- weights & memory --------------------------------------------------------------------
    @property
    def graphs(self) -> dict:
        """The decode graphs captured for where the weights and the KV cache are now, by (batch bucket, sample, filter)."""
        return self._graph_sets.current

    def _addresses(self) -> tuple[int, int]:
        return self.model.flat.data_ptr(), self.kv.data.data_ptr() if self.kv.data is not None else 0

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """In place (same storage, so captured graphs stay valid); while asleep, into the host copy (an engine that
        slept beside the trainer has none: wake its weights first)."""
        if self.model.flat.is_meta:
            raise RuntimeError("update_weights while the weights sleep without a host copy (the engine shares this "
                               "process with the trainer): wake(('weights',)) first, then push every weight")
        # an in-process trainer's export writes straight into the views (polyrl.weight_sync.direct), else name by name
        # (not into FP8 views: the direct copy knows no scales; nor for a model with ignored tensors, which it would
        # refuse by name)
        direct = hasattr(weights, "copy_into") and not self.model.fp8 and not self.model.spec.ignored
        seen = weights.copy_into(self.model.hf) if direct else None
        if seen is None:
            seen = self.model.load(weights, strict=False)
        if self._stale or not self._host_valid:
            # woken without its weights (or asleep without a host copy): the weights this update did not write come
            # from the host copy, which a sleep beside the trainer did not take
            missing = self.model.missing(seen)
            if missing and not self._host_valid:
                raise RuntimeError(
                    f"update_weights after a sleep that kept no host copy of the weights (the engine shares this "
                    f"process with the trainer, which pushes them all) must write every weight; it lacks "
                    f"{len(missing)}, e.g. {sorted(missing)[:3]}")
            if self._stale:
                for name in missing:
                    v = self.model.hf[name]
                    host = self._cpu_flat.view(torch.uint8).view(v.dtype)  # FP8 views count offsets in their dtype
                    v.copy_(host.as_strided(v.shape, v.stride(), v.storage_offset()), non_blocking=True)
            self._stale, self._host_valid = False, True
        n = len(seen)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.version = version
        log.debug("GPU engine weights updated to version %d (%d tensors)", version, n)

    def _restore(self) -> None:
        """Bring back the weights a wake() left on the host, unless an update has written them all since."""
        if not self._host_valid and (self._stale or self.asleep):
            raise RuntimeError("the engine slept beside the trainer without a host copy of its weights (the trainer "
                               "holds them): push a full weight update (update_weights) before generating or reading")
        if self._stale:
            self.model.flat.copy_(self._cpu_flat)
            self._stale = False

    def sleep(self) -> None:
        """Free the weights' and the KV cache's GPU memory. The weights go to pinned host memory first, unless the
        trainer shares this process (shares_allocator): it holds them and pushes them all after every wake (as SGLang
        drops them without --enable-weights-cpu-backup), which saves a device-to-host copy of the model per RL step.
        The captured CUDA graphs are kept, with their pool and the logits buffer: a wake that gets the weights and the
        KV cache back at addresses they had before (the last two places are remembered) replays that place's graphs
        instead of capturing."""
        if not self.is_cuda:
            return
        if self.model.flat.is_cuda:
            if self.shares_allocator:  # no host buffer at all (it would be model-sized pinned RAM, never filled)
                self._host_valid = False
                self.model.bind(torch.empty(self.model.numel, dtype=self.dtype, device="meta"))
            else:
                if self._cpu_flat is None:
                    self._cpu_flat = torch.empty(self.model.numel, dtype=self.dtype, pin_memory=True)
                if not self._stale:  # a stale GPU buffer holds nothing the host copy lacks
                    self._cpu_flat.copy_(self.model.flat)
                self.model.bind(self._cpu_flat)
            self._stale = False
        self.kv.release()
        if self.rescore is not None:  # its views of the weights would keep the whole buffer allocated
            self.rescore.release()
        self.asleep = True
        self.release_cached_memory()

    def wake(self, tags: Sequence[str] | None = None) -> None:
        tags = wake_tags(tags)
        if not self.is_cuda:
            return
        if "weights" in tags and not self.model.flat.is_cuda:  # on the host, or on meta (slept without a host copy)
            # the host copy goes back lazily (_restore): the RL loop wakes the engine to push a full weight update,
            # which makes copying the old weights in first (a full host-to-device copy of the model) wasted time
            self.model.bind(torch.empty(self.model.numel, dtype=self.dtype, device=self.device))
            self._stale = True
        if "kv_cache" in tags and self.kv.data is None:
            self.kv.allocate()
            self._split_val = -1
        self.asleep = not self.model.flat.is_cuda or self.kv.data is None
        if not self.asleep:
            self._graph_sets.use(self._addresses())

    def score_trajectories(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """--true-on-policy: each sample's rollout log-probs, over its whole response, from the trainer's scoring
        function (EngineScorer): an agent's sample, assembled from several calls and the tokens between them."""
        if self.rescore is None:
            raise RuntimeError("score_trajectories: this engine was not built with true_on_policy")
        self._restore()
        return self.rescore(samples, params)

    # ---- reading weights back (engine servers: /get_weights_by_name, --check-weight-update-equal) ----
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every weight update_weights accepts."""
        return self.model.wire_shapes()

    def get_weight(self, name: str) -> torch.Tensor:
        """A CPU copy of one HF-named weight (a view into the flat buffer, awake or asleep), in the engine's dtype (an
        FP8 linear dequantized, as its kernel multiplies by it)."""
        self._restore()
        return self.model.read(name).detach().to("cpu", copy=True)
