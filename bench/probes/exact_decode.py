"""Feasibility of a decode whose log-probs are the --true-on-policy trainer's bits, with no scoring pass.

The mode today samples with the engine's own decode and then scores every sample with the trainer's arithmetic (one
more forward, the mode's main cost). This prototype decodes with the trainer's module code instead (the HF model of a
Qwen2.5 shape, random BF16 weights, prepare()d, eager) and checks every sampled token's log-prob against the scoring
function (`sequences_logprobs`, the trainer's forward) bit for bit:

- prefill: the prompts packed as the trainer packs them (fixed 2048-row GEMM blocks), each layer's keys and values
  written into a per-sample slot of a KV store;
- decode step: the B running samples' last tokens as B rows. A Linear runs one GEMM of M rows (the B rows and zero
  padding) with the trainer's per-block call (`BlockBatches._launch`, one block), at the smallest M of a ladder whose
  rows give, for this weight, the bits of the same rows inside a 2048-row block (checked once per weight shape on
  random data, as `BlockBatches` checks its counts); RMSNorm the row kernel; attention the varlen FlashAttention call
  with one query row per sample against its slot's keys (the slots laid out as sequences, the unused tail of each slot
  a sequence with no queries); the LM head a GEMM checked the same way against the trainer's 1024-row head chunks, and
  the log-sum-exp by the trainer's row kernel on a 1024-row chunk;
- tokens drawn by Gumbel-max from those logits (so from the trainer's distribution).

Prints one table: per shape, the tokens compared, how many differ from the scoring function (and of those, the
prefill's first tokens), the M chosen per weight shape, the eager and CUDA-graphed decode step times, and the eager
scoring of the same samples. On CPU (FP32, `--shape tiny`) it
checks the plumbing only: CPU attention over a decode row is not the trainer's per-sequence call, so values agree to
FP32 rounding, not bit for bit.

    python3 bench/probes/exact_decode.py --shape qwen2.5-0.5b qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

LADDER = (64, 128, 256, 384, 512, 768, 1024, 2048)
IMPL = "polyrl_exact_decode"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs="+", default=["qwen2.5-0.5b"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--new", type=int, default=256, help="new tokens per sample")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--graph-steps", type=int, default=32, help="decode steps timed from a CUDA graph (0: none)")
    p.add_argument("--profile", action="store_true", help="CUDA: one more eager decode step under torch.profiler: "
                   "its kernels' device ms by class and its kernel count (two more columns)")
    return p.parse_args(argv)


class Decoder:
    """The prototype: a prepare()d HF causal LM decoded step by step with the trainer's arithmetic."""

    def __init__(self, lm, batch: int, capacity: int, device):
        import torch

        import polyrl.backends.true_on_policy as top
        self.torch, self.top = torch, top
        self.lm, self.B, self.C, self.device = lm, batch, capacity, device
        cfg = lm.config
        kvh, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        dt = next(lm.parameters()).dtype
        # one slot of `capacity` rows per sample, and a scratch row that the prefill's padding rows write
        self.K = [torch.zeros(batch * capacity + 1, kvh, hd, dtype=dt, device=device) for _ in range(cfg.num_hidden_layers)]
        self.V = [torch.zeros_like(k) for k in self.K]
        self.decoding = False
        self.rows: dict[tuple, int] = {}  # (weight shape, bias, rows wanted) -> M
        for m in lm.modules():
            if isinstance(m, torch.nn.Linear):
                m.forward = types.MethodType(self._linear, m)
        from transformers import AttentionInterface, AttentionMaskInterface
        AttentionInterface.register(IMPL, self._attention)
        AttentionMaskInterface.register(IMPL, top._mask)
        lm.set_attn_implementation(IMPL)

    # ---- the GEMMs: the trainer's per-block call on M rows, M checked against a 2048-row block -----------------
    def _check(self, weight, bias, m: int, head: bool) -> bool:
        torch, top = self.torch, self.top
        gen = torch.Generator(weight.device).manual_seed(m)
        ref_rows = top.HEAD_ROWS["cuda"] if head else top.ROWS["cuda"]
        if self.device.type == "cpu":
            ref_rows = top.HEAD_ROWS["cpu"] if head else top.ROWS["cpu"]
        x = torch.randn(max(ref_rows, m), weight.shape[1], device=weight.device, dtype=weight.dtype, generator=gen)
        ref = self._gemm(x[:ref_rows], weight, bias, head)
        return bool(torch.equal(self._gemm(x[:m], weight, bias, head), ref[:m]))

    def _gemm(self, x, weight, bias, head: bool):
        if head:  # the trainer's head: hidden[s:s + HEAD_ROWS] @ W^T (chunked_logprobs)
            return x @ weight.t()
        out = x.new_empty(x.shape[0], weight.shape[0])
        self.top.BATCHED._launch(x, weight, bias, out, x.shape[0])
        return out

    def rows_for(self, weight, bias, n: int, head: bool = False) -> int:
        key = (tuple(weight.shape), bias is not None, n, head)
        if key not in self.rows:
            cap = self.top.HEAD_ROWS if head else self.top.ROWS
            limit = cap["cpu" if self.device.type == "cpu" else "cuda"]
            self.rows[key] = next((m for m in LADDER if n <= m <= limit and self._check(weight, bias, m, head)), limit)
        return self.rows[key]

    def gemm(self, x, weight, bias, head: bool = False):
        n = x.shape[0]
        m = self.rows_for(weight, bias, n, head)
        if m > n:
            x = self.torch.cat([x, x.new_zeros(m - n, x.shape[1])])
        return self._gemm(x.contiguous(), weight, bias, head)[:n]

    def _linear(self, module, x):
        if not self.decoding:
            return self.top._linear_forward(module, x)
        y = self.gemm(x.reshape(-1, x.shape[-1]), module.weight, module.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    # ---- attention: keys and values into the slots; decode rows against their slots ------------------------------
    def _attention(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        torch, top = self.torch, self.top
        st = kw.pop("polyrl_kv", None)
        if st is None:
            return top._attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
        K, V = self.K[module.layer_idx], self.V[module.layer_idx]
        k, v = (t[0].transpose(0, 1) for t in (key, value))
        K.index_copy_(0, st["write"], k)
        V.index_copy_(0, st["write"], v)
        if not self.decoding:  # the prefill: the pack's own attention, as the trainer's
            return top._attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kw)
        q = query[0].transpose(0, 1)
        if self.device.type == "cuda":
            from polyrl.backends import varlen
            return varlen.causal(q, K, V, st["cu_q"], st["cu_k"], 1, self.C, scale=scaling)[None], None
        outs = []  # CPU (plumbing only: not the trainer's bits there)
        for i, n in enumerate((st["pos"] + 1).tolist()):
            ks, vs = (t[i * self.C:i * self.C + n].transpose(0, 1)[None] for t in (K, V))
            outs.append(torch.nn.functional.scaled_dot_product_attention(q[i:i + 1].transpose(0, 1)[None], ks, vs,
                                                                         scale=scaling, enable_gqa=True))
        return torch.cat(outs, dim=2).transpose(1, 2), None

    # ---- the head: logits by the checked GEMM, the log-sum-exp on a trainer-sized chunk ---------------------------
    def head(self, hidden):
        torch, top = self.torch, self.top
        from polyrl.backends.logprobs import _row_stats
        w = self.lm.get_output_embeddings().weight
        logits = self.gemm(hidden, w, None, head=True)
        chunk = top.HEAD_ROWS["cpu" if self.device.type == "cpu" else "cuda"]
        full = logits.new_zeros(max(chunk, logits.shape[0]), logits.shape[1])
        full[:logits.shape[0]] = logits
        lse, _ = _row_stats(full, 1.0, False)
        return logits, lse[:logits.shape[0]]

    def sample(self, logits, lse, gen):
        """Gumbel-max over the logits (a draw from their softmax) and the drawn tokens' log-probs, the trainer's way:
        logit as FP32 minus the log-sum-exp."""
        z = logits.float()
        u = self.torch.rand(z.shape, device=z.device, generator=gen).clamp_(1e-20, 1.0)
        tok = (z - (-u.log()).log()).argmax(-1)
        return tok, z.gather(1, tok[:, None]).squeeze(1) - lse

    def prefill(self, prompts):
        torch, top = self.torch, self.top
        lens = [len(p) for p in prompts]
        pad = top.packed_tokens(lens, self.device) - sum(lens)
        dummy = top.dummies(pad, max(max(lens), top.MIN_BOUND))
        pos, cu, rows, *_ = top.pack_layout(lens, [n - 1 for n in lens], None, dummy)
        ids = torch.tensor([t for p in prompts for t in p] + [0] * pad, dtype=torch.long)
        write = torch.tensor([i * self.C + j for i, p in enumerate(prompts) for j in range(len(p))]
                             + [self.B * self.C] * pad, dtype=torch.long)
        last = torch.cumsum(torch.tensor(lens), 0) - 1
        ids, pos, cu, write, last = (t.to(self.device) for t in (ids, pos, cu, write, last))
        with top.invariant():
            h = top_base(self.lm)(input_ids=ids[None], position_ids=pos[None], attention_mask=None, use_cache=False,
                                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens + dummy),
                                  max_length_k=max(lens + dummy), polyrl_kv={"write": write}).last_hidden_state[0]
        return h.index_select(0, last)

    def step_inputs(self, lens):
        torch = self.torch
        B, C = self.B, self.C
        i = torch.arange(B)
        L = torch.tensor(lens)
        cu_k = torch.stack([i * C, i * C + L], 1).flatten()
        cu_k = torch.cat([cu_k, torch.tensor([B * C])]).to(torch.int32)
        cu_q = torch.cat([torch.stack([i, i + 1], 1).flatten(), torch.tensor([B])]).to(torch.int32)
        return {"write": (i * C + L - 1), "cu_q": cu_q, "cu_k": cu_k, "pos": L - 1}

    def step(self, tok, st):
        top = self.top
        self.decoding = True
        try:
            with top.invariant():
                h = top_base(self.lm)(input_ids=tok[None], position_ids=st["pos"][None], attention_mask=None,
                                      use_cache=False, polyrl_kv=st).last_hidden_state[0]
        finally:
            self.decoding = False
        return h


def top_base(lm):
    return getattr(lm, lm.base_model_prefix)


def run_shape(a, shape: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import polyrl.backends.true_on_policy as top
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # score_pass, beside it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/common.py
    from common import QWEN_SHAPES
    dev = torch.device(a.device)
    top.pin_threads(dev)
    dims = QWEN_SHAPES[shape] if shape in QWEN_SHAPES else dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, tie_word_embeddings=True)
    cfg = Qwen2Config(**dims, max_position_embeddings=4096)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=top.register_attention()).to(dev)
    lm.eval().requires_grad_(False)
    top.prepare(lm)
    B = a.prompts * a.samples
    C = a.prompt + a.new
    dec = Decoder(lm, B, C, dev)
    g = torch.Generator().manual_seed(1)
    groups = [torch.randint(0, cfg.vocab_size, (a.prompt,), generator=g).tolist() for _ in range(a.prompts)]
    prompts = [groups[i // a.samples] for i in range(B)]
    gen = torch.Generator(dev).manual_seed(2)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        h = dec.prefill(prompts)
        logits, lse = dec.head(h)
        tok, lp = dec.sample(logits, lse, gen)
        sync()
        prefill_s = time.perf_counter() - t0
        toks, lps, step_s = [tok], [lp], []
        lens = [a.prompt] * B
        for _ in range(a.new - 1):
            lens = [n + 1 for n in lens]
            st = {k: v.to(dev) for k, v in dec.step_inputs(lens).items()}
            sync()
            t0 = time.perf_counter()
            logits, lse = dec.head(dec.step(tok, st))
            tok, lp = dec.sample(logits, lse, gen)
            sync()
            step_s.append(time.perf_counter() - t0)
            toks.append(tok)
            lps.append(lp)
        resp = torch.stack(toks, 1).cpu()
        got = torch.stack(lps, 1).cpu()
        # the reference: the trainer's scoring function over the finished samples (eager, fixed blocks)
        seqs = top.sequences_to_device([(torch.tensor(p + r.tolist(), dtype=torch.long), len(p))
                                        for p, r in zip(prompts, resp)], dev)
        sync()
        t0 = time.perf_counter()
        want = torch.cat([top.sequences_logprobs(lm, seqs[i:i + 32], temperature=1.0)[0] for i in range(0, B, 32)])
        sync()
        score_s = time.perf_counter() - t0
        want = want.cpu().view(B, a.new)
        differ = int((got != want).sum())
        differ_first = int((got[:, 0] != want[:, 0]).sum())  # the prefill's tokens (then the decode's)
        worst = float((got - want).abs().max())
        by_class = None
        if dev.type == "cuda" and a.profile:
            by_class = step_kernels(dec, tok, lens)
        graph_ms = None
        if dev.type == "cuda" and a.graph_steps:
            graph_ms = graphed_step_ms(dec, tok, lens, a.graph_steps)
    M = {f"{k[0][0]}x{k[0][1]}{'h' if k[3] else ''}": m for k, m in dec.rows.items() if k[2] == B}
    return {"shape": shape, "tokens": B * a.new, "differ": differ, "differ_first": differ_first, "max_abs_diff": worst,
            "rows_M": M, "prefill_s": round(prefill_s, 4), "eager_step_ms": round(statistics.median(step_s) * 1e3, 2),
            "graphed_step_ms": graph_ms, "score_s_eager": round(score_s, 3), "device": str(dev),
            **({"step_device_ms_by_class": by_class[0], "step_kernels": by_class[1]} if by_class else {})}


def step_kernels(dec, tok, lens) -> tuple[dict[str, float], int]:
    """One eager decode step (its bounds not advanced: timing only) under torch.profiler: ({kernel class: device ms},
    kernels launched)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from score_pass import kernel_class
    st = {k: v.to(dec.device) for k, v in dec.step_inputs(lens).items()}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.head(dec.step(tok.clone(), st))
        torch.cuda.synchronize()
    by: dict[str, float] = {}
    n = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[kernel_class(e.name)] = by.get(kernel_class(e.name), 0.0) + e.device_time_total / 1e3
            n += 1
    return {k: round(v, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}, n


def graphed_step_ms(dec, tok, lens, steps: int) -> float | None:
    """One decode step (B rows, the slots' bounds as device tensors) captured in a CUDA graph and replayed `steps`
    times: its time per step (the values are not checked here: the bounds do not advance between replays)."""
    import torch

    from polyrl.rollout.gpu.graphs import capture
    st = {k: v.to(dec.device) for k, v in dec.step_inputs(lens).items()}
    tok = tok.clone()

    def fn():
        return dec.head(dec.step(tok, st))
    try:
        g, _ = capture(fn, device=dec.device, stream=torch.cuda.Stream(dec.device))
    except Exception as e:  # report, do not hide: the table says why there is no graphed figure
        print(f"capture failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        g.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / steps * 1e3, 3)


def main(argv=None) -> int:
    a = parse_args(argv)
    rows = [run_shape(a, s) for s in a.shape]
    cols = ["shape", "tokens", "differ", "differ_first", "max_abs_diff", "prefill_s", "eager_step_ms", "graphed_step_ms",
            "score_s_eager", "rows_M", "device"] + (["step_device_ms_by_class", "step_kernels"] if a.profile else [])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
