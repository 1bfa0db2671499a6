"""--true-on-policy: one scoring function for a sequence's per-token log-probs, shared by the rollout engine (the
log-probs it reports for each finished sample) and the FSDP backend (its log-prob and training forwards), so that the
two agree bit for bit (docs/true-on-policy.md). On CUDA the GPU engine keeps its own decode for sampling and reports
log-probs from an HF module shell whose parameters are views of its weight buffer (`EngineScorer`): the trainer's module
code over the same BF16 bits, with no weight copy.

Batch invariance by fixed shapes, not by special kernels: sequences are packed into one row (padded by a dummy last
sequence to a whole number of blocks), and every operation that reduces over a dimension runs on operands whose shape
does not depend on the pack. Linear layers run on fixed blocks of ROWS rows, so each GEMM has one shape whatever the
micro-batch, server batch or pack; a GEMM never mixes rows, and with one shape cuBLAS / MKL pick one kernel, so a
token's result does not depend on its neighbours or its place in the pack (tests/test_true_on_policy.py checks this
bit for bit). Several blocks share a batched launch, at batch counts checked to give each block's bits
(BlockBatches). RMSNorms run on fixed blocks too on CPU; on CUDA a Triton kernel with one program per row (`rms_rows`:
its reduction order is the compiled kernel's, whatever the launch's row count) does them in one launch. Only the
values need that: the backward of a Linear is two whole GEMMs and a norm's is its plain autograd over all rows. Attention on CUDA in BF16 is one FlashAttention varlen
call (each sequence's query blocks are their own programs, reducing over that sequence's keys in a fixed order);
elsewhere per-sequence causal SDPA. MoE routers run on the fixed blocks, each expert's GEMMs too, and a token's
expert outputs are added in expert order. The LM head and its FP32 log-sum-exp run through the chunked log-prob head
(polyrl.backends.logprobs) in chunks of exactly HEAD_ROWS rows. The engine's scoring computes a prompt that several
samples of a pack share once, where attention is the varlen kernel (pack_layout, shares_prompts). The remaining
inputs to the arithmetic are the weights (the same bits on both sides after a sync) and, on CPU, the thread count,
which MKL's GEMM splits its reduction over for some shapes: `pin_threads` fixes it in every process that scores.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import types

import torch
import torch.nn.functional as F

from polyrl.backends import varlen
from polyrl.backends.base import to_device
from polyrl.backends.logprobs import chunked_logprobs

# intra-op threads of every process in this mode: GEMM results can depend on the thread count (a 64x8192 @ 8192x512
# product differs by 1.6e-4 between 1 and 2 threads with this MKL), and the trainer ranks and a serve process would
# otherwise each pick their own (cpu_count // ranks, cpu_count)
THREADS = 1


def pin_threads(device: torch.device | str = "cpu") -> None:
    """One intra-op thread on CPU, whatever the command's thread policy (a GPU process has one already:
    polyrl.dist.host_threads)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(THREADS)


# rows per block of every GEMM (and CPU norm) in this mode: big enough for full-speed GEMMs on a GPU and few launches
# per layer, small enough that the zero padding of the last block stays cheap for the tiny CPU models (the same device
# type on both sides: one value)
ROWS = {"cpu": 64, "cuda": 2048}
# rows per chunk of the log-prob head (a divisor of ROWS): its [chunk, vocabulary] logits are the chunk's memory
HEAD_ROWS = {"cpu": 64, "cuda": 1024}
ATTENTION = "polyrl_invariant"
# scoring forwards pack this many tokens at most (the engine's pass over a whole batch; its shapes do not matter)
PACK_TOKENS = 16384

_mode = threading.local()


@contextlib.contextmanager
def invariant():
    """Linear layers and RMSNorms of prepared models run on fixed blocks (this thread, while the context is open)."""
    prev = getattr(_mode, "on", False)
    _mode.on = True
    try:
        yield
    finally:
        _mode.on = prev


def _active() -> bool:
    return getattr(_mode, "on", False)


def checkpoint_contexts() -> tuple:
    """torch.utils.checkpoint's context_fn for the trainer's activation checkpointing (--gradient-checkpointing): a
    layer recomputed in the backward, outside the scoring context (and maybe on autograd's own thread), runs the
    arithmetic its forward ran, so the recomputation saves the same tensors and the gradient its values."""
    return contextlib.nullcontext(), (invariant() if _active() else contextlib.nullcontext())


def block_rows(device: torch.device | str) -> int:
    """The rows of every block (ROWS) on `device`: a trainer's micro-batch is padded to a whole number of them. A
    torch.device is read as it is (every fixed-block Linear call asks)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return ROWS.get(kind, ROWS["cuda"])


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    pad = (-x.shape[0]) % rows
    return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x


def fixed_rows(fn, x: torch.Tensor):
    """fn over x [N, ...] in blocks of exactly ROWS rows (the last zero-padded), concatenated: [N, ...] (or a tuple of
    such, for an fn that returns one). Autograd runs through the blocks (a norm takes its cheaper gradient from
    _FixedRows instead)."""
    rows, n = block_rows(x.device), x.shape[0]
    outs = [fn(c) for c in _padded(x, rows).split(rows)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:n] for parts in zip(*outs))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out[:n] if out.shape[0] != n else out


def _blocks_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b on fixed blocks of ROWS rows (the last zero-padded): batched GEMMs whose batch is the blocks
    (BATCHED.run), written into the output in place."""
    rows, n = block_rows(x.device), x.shape[0]
    xp = _padded(x, rows)
    out = xp.new_empty(xp.shape[0], weight.shape[0])
    BATCHED.run(xp, weight, bias, out, rows)
    return out[:n] if out.shape[0] != n else out


class BlockBatches:
    """The fixed-block GEMMs as batched GEMMs: blocks of `rows` rows are the batch, the weight (and bias) broadcast
    with a zero batch stride, so a pack of B blocks costs a launch per `cap` blocks instead of one per block (the
    host's launches, not the GPU, bounded the mode's training forward on CUDA). A block's value must not depend on how
    many blocks share the launch, and cuBLAS / MKL pick their kernel by the batch count too (split-K for a small count would
    change the reduction order). So every count is checked before use, once per (weight shape, dtype, bias) and
    process: `count` blocks of random data through one launch against the same blocks one per launch (count 1, the
    arithmetic every path reduces to), bit for bit. A count that differs is never used again; a pack is cut greedily
    into the largest checked counts, and counts are never checked while a CUDA graph is being captured (the engine's
    scoring graphs run an eager warm-up first, which checks them). The random data comes from a generator of its
    own: the run's random streams are untouched."""

    def __init__(self, cap: int = 8, check_bytes: int = 1 << 31):
        self.cap = cap  # blocks per launch at most: 16k rows already fill a GPU
        self.check_bytes = check_bytes  # a count whose check (input and two outputs) would exceed this is not checked
        self.good: dict[tuple, set[int]] = {}
        self.bad: dict[tuple, set[int]] = {}
        self.plans: dict[tuple, tuple[tuple[int, int], ...]] = {}  # (key, blocks, rows, cap) -> launches (first, count)
        self.checks = 0

    @staticmethod
    def _bmm(x3: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, o3: torch.Tensor) -> None:
        """o3 [c, rows, N] = x3 [c, rows, K] @ wt [K, N] (+ bias): one launch of c blocks."""
        c, rows = x3.shape[0], x3.shape[1]
        w3 = wt.expand(c, -1, -1)
        if bias is None:
            torch.bmm(x3, w3, out=o3)
        else:
            torch.baddbmm(bias.expand(c, rows, -1), x3, w3, out=o3)

    def _launch(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                rows: int) -> None:
        c = x.shape[0] // rows
        self._bmm(x.view(c, rows, x.shape[1]), weight.t(), bias, out.view(c, rows, out.shape[1]))

    def _check(self, key: tuple, count: int, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> bool:
        """Whether `count` blocks in one launch give each block's single-launch bits (recorded in good / bad)."""
        k, dev = weight.shape[1], weight.device
        gen = torch.Generator(dev).manual_seed(count)
        x = torch.randn(count * rows, k, device=dev, dtype=weight.dtype, generator=gen)
        together, alone = (x.new_empty(count * rows, weight.shape[0]) for _ in range(2))
        self._launch(x, weight, bias, together, rows)
        for xb, ob in zip(x.split(rows), alone.split(rows)):
            self._launch(xb, weight, bias, ob, rows)
        ok = bool(torch.equal(together, alone))
        (self.good if ok else self.bad).setdefault(key, set()).add(count)
        self.checks += 1
        return ok

    def _usable(self, key: tuple, count: int, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> bool:
        if count == 1 or count in self.good.get(key, ()):
            return True
        # the check's input and its two outputs must fit in check_bytes
        size = count * rows * (weight.shape[1] + 2 * weight.shape[0]) * weight.element_size()
        if (count in self.bad.get(key, ()) or (weight.is_cuda and torch.cuda.is_current_stream_capturing())
                or size > self.check_bytes):
            return False
        return self._check(key, count, weight, bias, rows)

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            rows: int) -> None:
        """out [B x rows, N] = x [B x rows, K] W^T + b, in launches of the largest usable counts."""
        if x.data_ptr() % 16 or not x.is_contiguous():  # the kernel cuBLAS picks can depend on the alignment
            x = x.clone(memory_format=torch.contiguous_format)
        key = (weight.shape, weight.stride(), weight.dtype, bias is not None, weight.get_device())
        blocks = x.shape[0] // rows
        plan = self.plans.get((key, blocks, rows, self.cap))
        if plan is None:
            plan = self._plan(key, blocks, weight, bias, rows)
        # the views made once per call: the host's work per launch bounds the mode's training forward on CUDA
        x3, o3, wt = x.view(blocks, rows, x.shape[1]), out.view(blocks, rows, out.shape[1]), weight.t()
        for first, count in plan:
            self._bmm(x3[first:first + count], wt, bias, o3[first:first + count])

    def _plan(self, key: tuple, blocks: int, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> tuple:
        """A pack of `blocks` blocks cut greedily into the largest usable counts; kept once every count in it was
        checked (not during a capture, where unchecked counts are passed over)."""
        plan, done = [], 0
        while done < blocks:
            count = next(c for c in range(min(self.cap, blocks - done), 0, -1)
                         if self._usable(key, c, weight, bias, rows))
            plan.append((done, count))
            done += count
        plan = tuple(plan)
        if not (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.plans[(key, blocks, rows, self.cap)] = plan
        return plan


BATCHED = BlockBatches()


def _rms_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm forward (Llama / Qwen2 / Qwen3 / Mistral): weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fresh(y: torch.Tensor) -> torch.Tensor:
    """y, copied if it is a view (of the padded blocks): a custom op returns tensors of its own."""
    return y if y._base is None else y.clone()


def _define(lib, schema: str, impl, fake, backward, setup) -> None:
    """One operator of `lib` with its kernel registered straight with the dispatcher for CPU and CUDA, its fake
    (shape) function for torch.compile and its autograd formula. torch.library.custom_op would wrap the kernel in
    Python layers of its own (a dynamo-disabled wrapper, an aliasing check) on every call, and the mode's forward
    makes ~9 calls a layer (bench/history/2026-11.md#true-on-policy-gc-freeze-2026-11-29)."""
    name = schema.split("(", 1)[0]
    lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, impl, key)
    qual = f"{lib.ns}::{name}"
    torch.library.register_fake(qual, fake, lib=lib)
    torch.library.register_autograd(qual, backward, setup_context=setup, lib=lib)


_RMS_LAUNCH = False  # polyrl::rms_rows_launch registered (Triton present): set by _ops()


@functools.lru_cache(maxsize=1)
def _ops():
    """The mode's fixed-arithmetic linear and RMSNorm as torch operators (registered by prepare()): torch.compile
    keeps each as one opaque call, so a compiled layer runs the very kernels an eager one runs (their block loop and
    Triton launch are not traced; on CUDA the norm is rms_rows_launch, whose kernel Inductor launches itself with the
    eager launch's bits), and Inductor fuses only the elementwise work between them. The gradients are the
    layers' own (two whole GEMMs; the RMSNorm's closed form): only the values must not depend on the pack. Returns
    the library, which must stay alive for the operators to stay registered."""

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _fresh(_blocks_mm(x, weight, bias))

    def linear_fake(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    def linear_setup(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    def linear_backward(ctx, g):
        x, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        return (g @ weight if need[0] else None, g.t() @ x if need[1] else None,
                g.sum(0) if ctx.has_bias and need[2] else None)

    def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # HF's formula on fixed blocks: the CPU's norm (on CUDA _norm_forward calls rms_rows_launch where Triton is)
        return _fresh(fixed_rows(lambda c: _rms_formula(c, weight, eps), x))

    def rms_fake(x, weight, eps):
        return torch.empty_like(x)

    def rms_setup(ctx, inputs, output):
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    def rms_backward(ctx, g):
        # y = w * h, h = (x r).to(dtype), r = rsqrt(mean(x^2) + eps): dh = g w, dx = r (dh - n mean(dh n)), n = x r
        x, weight = ctx.saved_tensors
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        n = xf * r
        gx = gw = None
        if ctx.needs_input_grad[0]:
            dh = (g * weight).float()
            gx = (r * (dh - n * (dh * n).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g * n.to(x.dtype)).sum(0).to(weight.dtype)
        return gx, gw, None

    lib = torch.library.Library("polyrl", "FRAGMENT")
    _define(lib, "fixed_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", linear, linear_fake,
            linear_backward, linear_setup)
    _define(lib, "rms_rows(Tensor x, Tensor weight, float eps) -> Tensor", rms, rms_fake, rms_backward, rms_setup)
    if _rms_kernel() is not None:
        # the CUDA row kernel as a triton_op: in a compiled layer Inductor launches it from its own generated code
        # (the JIT launcher's per-call argument binding was the largest host cost of the exact forward,
        # bench/history/2026-11.md#true-on-policy-inductor-norm-2026-11-29); eager calls launch it as rms_rows does
        @torch.library.triton_op("polyrl::rms_rows_launch", mutates_args=())
        def rms_rows_launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return rms_rows(x, weight, eps, wrap=torch.library.wrap_triton)

        rms_rows_launch.register_autograd(rms_backward, setup_context=rms_setup)
        lib.polyrl_rms_launch = rms_rows_launch  # kept alive with the library
        global _RMS_LAUNCH
        _RMS_LAUNCH = True
    return lib


class _FixedRows(torch.autograd.Function):
    """A row-wise module (a norm) with its value from fixed blocks of ROWS rows and its gradient from the module over
    the whole x, re-run under autograd in the backward with the parameters saved here (functional_call: the backward
    must not depend on which parameter objects the module holds by then)."""

    @staticmethod
    def forward(ctx, module, names, x, *params):
        with torch.no_grad():
            out = fixed_rows(module._polyrl_plain, x)
        ctx.module, ctx.names = module, names
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        prev = getattr(_mode, "on", False)
        _mode.on = False  # the re-run is the plain module (the engine's autograd thread may have it off already)
        try:
            with torch.enable_grad():
                xd = x.detach().requires_grad_(need[0])
                ps = [p.detach().requires_grad_(n) for p, n in zip(params, need[1:])]
                y = torch.func.functional_call(ctx.module, dict(zip(ctx.names, ps)), (xd,))
                wanted = [t for t, n in zip([xd, *ps], need) if n]
                grads = iter(torch.autograd.grad(y, wanted, g) if wanted else ())
        finally:
            _mode.on = prev
        return (None, None, *(next(grads) if n else None for n in need))


# RMSNorms whose forward is weight * (x * rsqrt(mean(x^2) + eps)).to(dtype): on CUDA one Triton program per row
# computes it, a launch per norm instead of ~7 per block of ROWS rows (the mode's host time went mostly to those)
_RMS_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "MistralRMSNorm")


def _rms_op_fits(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """A known RMSNorm whose weight is a plain local tensor (not a sharded DTensor) of x's dtype: the rms_rows op."""
    w = getattr(module, "weight", None)
    return (type(module).__name__ in _RMS_CLASSES and hasattr(module, "variance_epsilon")
            and type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == x.dtype
            and tuple(w.shape) == tuple(x.shape[-1:]))


@functools.lru_cache(maxsize=1)
def _rms_kernel():
    """(triton, the row kernel), compiled on first use; None without Triton (polyrl.backends.logprobs' pattern)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def rms_rows_kernel(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
        # one program per row, the whole row in one block: its sum of squares is one tl.sum whose order is fixed
        # by the compiled kernel (H, BLOCK, warps), never by how many rows the launch has
        r = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = c < H
        # Triton's launcher passes a Python float as fp32, Inductor's as fp64, and Inductor's analysis of which
        # arguments the kernel writes traces it with eps a Python float (eps.to(...) failed there, and it treated
        # every argument as written)
        eps = tl.cast(eps, tl.float32)
        x = tl.load(x_ptr + r * H + c, mask=m, other=0.0).to(tl.float32)
        h = (x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)).to(y_ptr.dtype.element_ty)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        tl.store(y_ptr + r * H + c, (w.to(tl.float32) * h.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=m)

    return triton, rms_rows_kernel


def rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, *, wrap=None) -> torch.Tensor:
    """weight * rmsnorm(x) [N, H] by the row kernel (values only). x is made contiguous and 16-byte aligned (by its
    offset: allocations start aligned, and a traced fake tensor has no address) so that every call, the engine's and
    the trainer's, eager or compiled, runs the same specialization of the kernel. wrap: torch.library.wrap_triton
    inside the rms_rows_launch op."""
    triton, kernel = _rms_kernel()
    weight = weight.contiguous()
    if not x.is_contiguous() or x.storage_offset() * x.element_size() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    n, h = x.shape[0], int(x.shape[1])  # the width a constant of the kernel in a dynamic-shape graph too, as in eager
    y = torch.empty_like(x)
    if n:
        block = triton.next_power_of_2(h)
        (wrap(kernel) if wrap else kernel)[(n,)](x, weight, y, h, eps, BLOCK=block,
                                                 num_warps=max(1, min(8, block // 256)))
    return y


def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _active():
        return F.linear(x, self.weight, self.bias)
    y = torch.ops.polyrl.fixed_rows_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _active():
        return self._polyrl_plain(x)
    if _rms_op_fits(self, x):
        op = torch.ops.polyrl.rms_rows_launch if x.is_cuda and _RMS_LAUNCH else torch.ops.polyrl.rms_rows
        return op(x.reshape(-1, x.shape[-1]), self.weight, self.variance_epsilon).reshape(x.shape)
    names = [n for n, _ in self.named_parameters(recurse=False)]
    params = [p for _, p in self.named_parameters(recurse=False)]
    return _FixedRows.apply(self, names, x.reshape(-1, x.shape[-1]), *params).reshape(x.shape)


def _router_forward(self, hidden_states: torch.Tensor):
    """A top-k router (row-wise: each token's route is its own) run on fixed blocks of ROWS rows, under autograd, its
    outputs (logits, gates, indices) concatenated: the router GEMM then has one shape whatever the pack."""
    if not _active():
        return self._polyrl_plain(hidden_states)
    return fixed_rows(self._polyrl_plain, hidden_states.reshape(-1, hidden_states.shape[-1]))


def _experts_fit(m: torch.nn.Module) -> bool:
    """HF's stacked-experts layout the invariant forward implements: gate_up_proj [E, 2I, H] ([gate; up]),
    down_proj [E, H, I], no biases (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral in transformers 5)."""
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
            and not getattr(m, "is_transposed", False) and not getattr(m, "has_bias", False)
            and getattr(m, "has_gate", True) and getattr(m, "is_concatenated", True) and hasattr(m, "act_fn"))


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """HF's eager expert loop with every expert GEMM on fixed blocks (the fixed-rows linear op). A token's output is the sum of
    its experts' outputs added in increasing expert order (one index_add_ per expert, each token once per call), so it
    depends on its own hidden state and route only, not on which other tokens an expert got."""
    if not _active():
        return self._polyrl_plain(hidden_states, top_k_index, top_k_weights)
    out = torch.zeros_like(hidden_states)
    with torch.no_grad():
        hit = torch.unique(top_k_index[(top_k_index >= 0) & (top_k_index < self.gate_up_proj.shape[0])]).tolist()
    linear = torch.ops.polyrl.fixed_rows_linear
    for e in hit:
        tok, pos = torch.where(top_k_index == e)
        gate, up = linear(hidden_states[tok], self.gate_up_proj[e], None).chunk(2, dim=-1)
        h = linear(self.act_fn(gate) * up, self.down_proj[e], None)
        out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def prepare(lm: torch.nn.Module) -> torch.nn.Module:
    """Route lm's Linear layers, RMSNorms, MoE routers and stacked experts through fixed blocks inside `invariant()`
    (outside it, as before: the engine's own generation is untouched) and make its attention the per-sequence one.
    Idempotent. A stacked-experts layout the mode does not implement is refused."""
    _ops()  # registered here, outside any compiled region: the forwards call them as torch.ops.polyrl.*
    for m in lm.modules():
        if getattr(m, "_polyrl_invariant", False):
            continue
        name = type(m).__name__
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(_linear_forward, m)
        elif name.endswith("RMSNorm"):
            m._polyrl_plain = m.forward
            m.forward = types.MethodType(_norm_forward, m)
        elif name.endswith("TopKRouter"):
            m._polyrl_plain = m.forward
            m.forward = types.MethodType(_router_forward, m)
        elif name.endswith("Experts") and hasattr(m, "gate_up_proj"):
            if not _experts_fit(m):
                raise ValueError(f"--true-on-policy: {name}'s expert layout (transposed, biased or interleaved "
                                 f"weights) has no batch-invariant forward in polyrl")
            m._polyrl_plain = m.forward
            m.forward = types.MethodType(_experts_forward, m)
        else:
            continue
        m._polyrl_invariant = True
    register_attention()
    lm.set_attn_implementation(ATTENTION)
    return lm


def compiles(lm: torch.nn.Module, device) -> bool:
    """Whether the mode runs lm's decoder layers compiled: on CUDA for a dense model, in the trainer and in the engine's
    scorer alike (both sides decide it from the model and the device, so they always agree). MoE layers stay eager:
    their expert loop reads the experts hit back to the host; so does a model with an RMSNorm the rms_rows op does not
    know (its fallback re-runs the module in its backward)."""
    prepared = [type(m).__name__ for m in lm.modules() if getattr(m, "_polyrl_invariant", False)]
    return torch.device(device).type == "cuda" and not any(
        n.endswith("Experts") or (n.endswith("RMSNorm") and n not in _RMS_CLASSES) for n in prepared)


def compile_layers(lm: torch.nn.Module, device) -> bool:
    """Where compiles(lm, device): torch.compile each decoder layer of a prepare()d model (dynamic shapes, as the FSDP
    backend's default) and return True; the trainer and the engine's scorer both call this, so both decide alike.
    Inductor rounds every intermediate to its eager dtype (emulate_precision_casts): a fused kernel then gives each
    op's value as if it were materialised, so the training graph's forward (which keeps other tensors for the backward
    and fuses differently) and the scorer's inference graph agree bit for bit. The fixed-block GEMMs and the row
    RMSNorm stay their own kernels (custom ops; the norm's Triton kernel launched, never fused, by Inductor),
    attention its varlen call; Inductor fuses the elementwise work between them (RoPE, SiLU * up, residual adds). On
    an H100 in BF16 the mode's GPU tests pass compiled (tests/backends/test_true_on_policy_gpu.py: pack invariance,
    3-step GRPO runs of the 0.5B shape, Qwen3, Llama, through polyrl serve); on CPU in BF16 (bench/probes/exact_compiled_cpu.py) compiled inference == compiled
    training forward == eager for Qwen3, while without the setting two compiled Qwen2 graphs differed by 2e-3. The
    setting is process-wide: every compiled graph of a process in this mode rounds like eager."""
    if not compiles(lm, device):
        return False
    import torch._inductor.config as inductor_config

    from polyrl.backends.fsdp.parallelize import apply_compile
    inductor_config.emulate_precision_casts = True
    apply_compile(lm)
    return True


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Per-sequence causal SDPA over a packed row (cu_seq_lens_q in kwargs: the sequences' bounds); any other call
    (generation with a KV cache and a padding mask) is HF's SDPA path. polyrl_gather (a pack whose sequences share
    their prompt's rows, pack_layout): each sequence's keys and values are gathered whole from the pack rows, so that
    every token reduces over exactly the keys it has in the trainer's pack."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or not _active():
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gather = kwargs.get("polyrl_gather")
    if varlen.usable(query.device, query.dtype):
        # one FlashAttention varlen call over the pack: each (sequence, head, query block) is its own program that
        # reduces over that sequence's keys in a fixed order, so a token's value does not depend on the pack
        # (tests/backends/test_true_on_policy_gpu.py checks it bit for bit)
        n = kwargs["max_length_q"]
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        if gather is None:
            return varlen.causal(q, k, v, cu, cu, n, n, scale=scaling)[None], None
        # shared prompt rows: a sequence's queries are its own rows (polyrl_cu_q), its keys the whole sequence, the
        # causal mask aligned at the end; a key block past a query row is fully masked for it and adds exact zeros,
        # so the row keeps the bits of the whole sequence's call (bench/probes/prefix_attention.py, and the GPU tests)
        k, v = k.index_select(0, gather), v.index_select(0, gather)
        return varlen.causal(q, k, v, kwargs["polyrl_cu_q"], cu, n, n, scale=scaling)[None], None
    if gather is not None:  # CPU: the queries gathered whole too, the output taken back to the pack rows
        query, key, value = (t.index_select(2, gather) for t in (query, key, value))
    gqa = query.shape[1] != key.shape[1]
    bounds = cu.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):  # contiguous copies: the kernel's choice must not see the pack offset
        q, k, v = (t[:, :, s:e].contiguous() for t in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa))
    out = torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    return (out if gather is None else out.index_select(1, kwargs["polyrl_scatter"])), None


def _mask(*args, **kwargs):
    if _active():  # a packed scoring row: boundaries travel as cu_seqlens, no [T, T] mask
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, **kwargs)


def register_attention() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _mask)
    return ATTENTION


def _packed_logprobs(lm: torch.nn.Module, ids, pos, cu, max_len: int, rows, targets, temperature: float,
                     with_entropy: bool = False, gather=None, scatter=None, cu_q=None):
    """The scoring arithmetic over one pack (ids / pos [T], T a whole number of ROWS; cu the int32 sequence bounds;
    rows [N] the pack rows whose next token is targets [N]; gather / scatter / cu_q: None, or the layout of a pack
    whose sequences share prompt rows, pack_layout): log-probs [N rounded up to HEAD_ROWS] and entropy | None.
    sequences_logprobs and the engine's CUDA graphs (GraphedScoring) both run exactly this."""
    base = getattr(lm, lm.base_model_prefix)
    head = lm.get_output_embeddings()
    if head.bias is not None:
        raise ValueError("--true-on-policy: an LM head with a bias is not supported by the log-prob head")
    with invariant():
        hidden = base(input_ids=ids[None], position_ids=pos[None], attention_mask=None, use_cache=False,
                      cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len,
                      **({} if gather is None else {"polyrl_gather": gather, "polyrl_scatter": scatter,
                                                    "polyrl_cu_q": cu_q})
                      ).last_hidden_state[0].index_select(0, rows)
    # the head in chunks of exactly HEAD_ROWS rows (zero rows pad the last): the GEMM and the row statistics then have
    # one shape whatever the pack, and no [T, V] logits are kept for the backward
    chunk = HEAD_ROWS.get(ids.device.type, HEAD_ROWS["cuda"])
    return chunked_logprobs(_padded(hidden, chunk), head.weight, _padded(targets, chunk), temperature=temperature,
                            chunk_size=chunk, with_entropy=with_entropy)


def packed_tokens(lens: list[int], device: torch.device) -> int:
    """The token count of sequences_logprobs' pack of sequences of `lens` tokens (a dummy last sequence pads it to a
    whole number of ROWS: every layer then sees whole blocks, no per-layer pad)."""
    return sum(lens) + (-sum(lens)) % block_rows(device)


def pack_positions(lens: list[int], device: torch.device) -> tuple[list[torch.Tensor], int]:
    """(each sequence's token positions in sequences_logprobs' pack, the pack's token count): what MoERouting.begin_at
    takes to count, record or replay the routes of one scoring forward."""
    starts = itertools.accumulate(lens, initial=0)
    return [torch.arange(s, s + n) for s, n in zip(starts, lens)], packed_tokens(lens, device)


def pack_layout(lens: list[int], prompts: list[int], shares: list[int | None] | None = None,
                dummy: list[int] = ()) -> tuple[torch.Tensor, ...]:
    """The layout of a scoring pack of sequences of lens[i] tokens (prompt lengths `prompts`) and dummy sequences of
    `dummy` tokens after them, as a few vector ops on the host (for the eager pack and the graphed one alike) ->
    (each pack row's position, the int32 bounds of the sequences whole, the pack rows whose next token is scored
    [sum of the responses], gather | None, scatter | None, cu_q | None).

    shares[i] = j (an earlier sequence with the same prompt, itself sharing nothing) puts only sequence i's response
    rows in the pack: its prompt is j's rows, computed once (a GRPO group's prompt, once instead of n times). Every
    operation but attention works row by row on fixed blocks, so a row's value does not depend on which sequences
    use it; attention then runs over each sequence whole, its rows gathered from the pack (`gather` [sum of lens and
    dummies]: the pack row of each position of each sequence), and its output goes back to the pack rows (`scatter`
    [pack rows]: where each row is in that layout), or on CUDA the queries stay the pack rows, each sequence's own rows
    one segment (`cu_q`, int32 bounds) against its whole keys. With shares None the pack is the sequences one after
    the other and gather / scatter / cu_q are None; shares that are all None keep the gathered layout (each one the
    identity), so that the engine's compiled layers see one set of arguments whether a pack shares or not (a pack
    without sharing would otherwise compile graphs of its own mid-run)."""
    n = len(lens)
    L = torch.tensor(list(lens) + list(dummy), dtype=torch.long)
    P = torch.tensor(prompts, dtype=torch.long)
    idx = torch.arange(L.numel())
    src = idx.clone()
    if shares is not None:
        src[:n] = torch.tensor([i if j is None else j for i, j in enumerate(shares)], dtype=torch.long)
    pre = torch.zeros_like(L)  # each sequence's first rows that are another's (its shared prompt)
    pre[:n] = torch.where(src[:n] != idx[:n], P, 0)
    own = L - pre
    start = torch.cumsum(own, 0) - own  # where each sequence's own rows begin in the pack
    T = int(own.sum())
    pos = torch.arange(T) - torch.repeat_interleave(start - pre, own)
    bounds = torch.cat([L.new_zeros(1), torch.cumsum(L, 0)])
    # response token t of sequence i is predicted by its position q = P_i - 1 + t: a row of its own, or (q < pre_i,
    # the first response token of a sharing sequence) the last row of the prompt it shares
    R = L[:n] - P
    t = torch.arange(int(R.sum())) - torch.repeat_interleave(torch.cumsum(R, 0) - R, R)  # each token's place in R_i
    q = torch.repeat_interleave(P - 1, R) + t
    pre_r = torch.repeat_interleave(pre[:n], R)
    rows = torch.where(q < pre_r, torch.repeat_interleave(start[src[:n]], R) + q,
                       torch.repeat_interleave(start[:n], R) + q - pre_r)
    if shares is None:
        return pos, bounds.to(torch.int32), rows, None, None, None
    p = torch.arange(int(bounds[-1])) - torch.repeat_interleave(bounds[:-1], L)  # each position in its sequence
    pre_g = torch.repeat_interleave(pre, L)
    gather = torch.where(p < pre_g, torch.repeat_interleave(start[src], L) + p,
                         torch.repeat_interleave(start, L) + p - pre_g)
    scatter = torch.arange(T) + torch.repeat_interleave(bounds[:-1] + pre - start, own)
    cu_q = torch.cat([own.new_zeros(1), torch.cumsum(own, 0)]).to(torch.int32)
    return pos, bounds.to(torch.int32), rows, gather, scatter, cu_q


def own_rows(seqs: list, prompts: list[int], shares: list[int | None] | None) -> tuple[list[int | None] | None, list]:
    """(shares; each sequence's tokens that are rows of the pack: all of them, or a sharing sequence's response).
    seqs: token lists or tensors."""
    if shares is None:
        return None, list(seqs)
    return shares, [x if j is None else x[p:] for x, p, j in zip(seqs, prompts, shares)]


def prompt_shares(prompts: list) -> list[int | None]:
    """For each sequence, the first earlier one with the same prompt tokens (None: the first of its prompt). prompts:
    token lists, or tuples of them."""
    first: dict[tuple, int] = {}
    keys = [p if isinstance(p, tuple) else tuple(p) for p in prompts]
    return [None if first.setdefault(k, i) == i else first[k] for i, k in enumerate(keys)]


def dummies(pad: int, longest: int) -> list[int]:
    """The lengths of the dummy sequences that fill `pad` tokens of a pack, none longer than `longest`: attention's
    cost grows with the square of a sequence's length, and one dummy of up to ROWS - 1 tokens cost ~9% of a GRPO
    pack's attention (a real token's value does not depend on how the padding is cut: it attends to its own
    sequence)."""
    return [longest] * (pad // longest) + ([pad % longest] if pad % longest else [])


def sequences_to_device(sequences: list[tuple[torch.Tensor, int]], device) -> list[tuple[torch.Tensor, int]]:
    """(host ids [L_i], P_i) -> the same with the ids on `device`, all of them in one pinned copy (one per sequence
    would be a launch each, and a host sync each when the memory is pageable)."""
    ids = to_device([torch.cat([x for x, _ in sequences])], device)[0].split([int(x.numel()) for x, _ in sequences])
    return [(x, p) for x, (_, p) in zip(ids, sequences)]


def sequences_logprobs(lm: torch.nn.Module, sequences: list[tuple[torch.Tensor, int]], *, temperature: float,
                       with_entropy: bool = False, shares: list[int | None] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm: a prepare()d HF causal LM; sequences: (ids [L_i] prompt + response, P_i), on lm's device
    (sequences_to_device) -> log-probs [sum of L_i - P_i] (fp32) of the response tokens under softmax(logits /
    temperature) (temperature 0, greedy: 1), and their entropy | None. One packed forward; each token's value is the
    one it gets alone or in any other pack. Differentiable. shares: prompt_shares of the sequences (the engine's
    scoring: a shared prompt's rows computed once; pack_layout). The pack's positions, bounds and rows are built on
    the host with a few vector ops and cross in pinned copies: no launch per sequence, no host sync."""
    device = sequences[0][0].device
    lens = [int(x.numel()) for x, _ in sequences]
    shares, own = own_rows([x for x, _ in sequences], [p for _, p in sequences], shares)
    n_own = sum(int(x.numel()) for x in own)
    pad = packed_tokens([n_own], device) - n_own
    dummy = dummies(pad, max(max(lens), MIN_BOUND))
    ids = torch.cat(own + ([sequences[0][0].new_zeros(pad)] if pad else []))
    pos, cu, rows, *shared = pack_layout(lens, [p for _, p in sequences], shares, dummy)
    pos, cu, rows, *shared = to_device([pos, cu, rows] + ([] if shares is None else shared), device)
    targets = ids[rows + 1] if shares is None else torch.cat([x[p:] for x, p in sequences])
    n = targets.numel()
    logp, ent = _packed_logprobs(lm, ids, pos, cu, max(lens + dummy), rows, targets, temperature, with_entropy,
                                 *shared)
    return logp[:n], (ent[:n] if ent is not None else None)


# graphed scoring packs are padded to a whole number of this many tokens (a multiple of ROWS["cuda"]): few pack sizes,
# so that a few CUDA graphs serve a run
GRAPH_ROWS = 2048
# sequence slots per graphed pack: one per SLOT_TOKENS tokens; the attention bound: at least MIN_BOUND tokens
SLOT_TOKENS, MIN_BOUND = 32, 256
# the engine's scoring computes a prompt shared by several samples once, where that is exact (score_samples)
SHARE_PROMPTS = True


def graph_inputs(seqs: list[list[int]], prompts: list[int], shares: list[int | None] | None = None
                 ) -> tuple[tuple[int, int | None, int, int], tuple[torch.Tensor, ...]]:
    """A graphed pack's key (pack rows T, gathered positions G or None, sequence slots, longest-sequence bound) and
    its inputs on the host: ids and positions [T], the int32 sequence bounds [slots + 1], the rows whose next token is
    scored and those targets [T] (zero past the real ones), and with shared prompts (shares, pack_layout) gather [G]
    and the int32 bounds of each sequence's own rows [slots + 1] (no scatter: only the CPU attention reads it, and the
    graphs are CUDA's). Built with array operations: a Python loop over every token of a step's packs was the graphed
    pass's largest host cost (bench/history/2026-11.md#true-on-policy-idle-2026-11-28)."""
    import numpy as np
    shares, own = own_rows(seqs, prompts, shares)
    lens = [len(x) for x in seqs]
    total = sum(len(x) for x in own)
    T = -(-total // GRAPH_ROWS) * GRAPH_ROWS
    bound = max(MIN_BOUND, 1 << (max(lens) - 1).bit_length())
    dummy = dummies(T - total, bound)  # dummy sequences no longer than `bound`: they never decide the bound
    G = None
    if shares is not None:  # the whole sequences' layout padded too, by dummies that no pack row reads back
        whole = sum(lens) + sum(dummy)
        G = -(-whole // GRAPH_ROWS) * GRAPH_ROWS
        spare = dummies(G - whole, bound)
    segments = len(lens) + len(dummy) + (len(spare) if G else 0)
    # one slot count per pack size, so that a step's sampled lengths do not make new graphs (a pack of many short
    # sequences takes the next power of two); the empty slots only add programs that exit at once
    slots = max((G or T) // SLOT_TOKENS, 1 << (segments - 1).bit_length())
    ids = torch.zeros(T, dtype=torch.long)
    ids[:total] = torch.from_numpy(np.fromiter((t for x in own for t in x), dtype=np.int64, count=total))
    pos, bounds, want, gather, _, own_bounds = pack_layout(lens, prompts, shares, dummy)
    cu = torch.full((slots + 1,), G or T, dtype=torch.int32)
    if G:  # the spare positions: sequences with keys and no queries
        bounds = torch.cat([bounds, bounds[-1] + torch.cumsum(torch.tensor(spare, dtype=torch.int32), 0)])
        gather = torch.cat([gather, gather.new_zeros(G - gather.numel())])
        cu_q = torch.full((slots + 1,), T, dtype=torch.int32)
        cu_q[:own_bounds.numel()] = own_bounds
    cu[:bounds.numel()] = bounds
    rows, targets = torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    n = want.numel()
    rows[:n] = want
    targets[:n] = torch.from_numpy(np.fromiter((t for x, p in zip(seqs, prompts) for t in x[p:]), dtype=np.int64,
                                               count=n))
    return (T, G, slots, bound), (ids, pos, cu, rows, targets) + ((gather, cu_q) if G else ())


class GraphedScoring:
    """The engine's scoring pass on CUDA (no autograd) replayed from CUDA graphs, one per (pack tokens, sequence slots,
    longest-sequence bucket, temperature), captured on first use over static input buffers. A replay launches the
    kernels the eager pass launches, on the same shapes, so no value changes; what goes is the host's per-op work (the
    eager layers' Python, a launch per GEMM block), which left the GPU idle for most of the pass. A pack is padded to a
    whole number of GRAPH_ROWS tokens, its sequence count to T / SLOT_TOKENS (or the next power of two) with empty
    sequences, and the attention's longest-sequence bound to a power of two of at least MIN_BOUND (the padding is cut into
    dummy sequences no longer than the real ones, so it never raises the bound): the attention reduces
    each sequence over its own keys whatever the bound and the count, which only size its grid. All graphs share one
    memory pool (replays run one at a time). The weights' addresses are baked in: `use(addresses)` names where they
    are now, and the graphs of the last two places are kept (GraphSets)."""

    def __init__(self, lm: torch.nn.Module, device: torch.device):
        from polyrl.rollout.gpu.graphs import GraphSets
        self.lm, self.device = lm, device
        self.sets = GraphSets()  # weights' addresses -> (pack key -> (inputs, output, graph))
        self.pool = None
        self.stream = torch.cuda.Stream(device)  # captures here: a cuBLAS workspace apart from the decode graphs'
        self.capture_s = 0.0  # wall seconds of warm-ups and captures since the last stats()
        self.compiles = 0  # graphs torch.compile made during those warm-ups (a new shape can recompile the layers)

    def use(self, addresses: tuple) -> None:
        """The weights are at `addresses` now: replay the graphs captured for them, if any."""
        self.sets.use(addresses)

    @property
    def captures(self) -> int:
        return self.sets.captures

    def __call__(self, seqs: list[list[int]], prompts: list[int], temperature: float,
                 shares: list[int | None] | None = None) -> torch.Tensor:
        """seqs: each sequence's token ids (prompt + response), prompts: their prompt lengths, shares: prompt_shares
        (a shared prompt's rows computed once) -> the response tokens' log-probs [sum of responses] on the device, a
        copy queued after the replay (no host sync: the next pack's inputs are built on the host while this one runs;
        a copy of them into the graph's input buffers waits for the replay before)."""
        (T, G, slots, bound), host = graph_inputs(seqs, prompts, shares)
        bufs, logp, graph = self.sets.get((T, G, slots, bound, temperature),
                                          lambda: self._capture(T, G, slots, bound, temperature))
        for buf, t in zip(bufs, host):
            buf.copy_(t, non_blocking=True)
        graph.replay()
        return logp[:sum(len(x) - p for x, p in zip(seqs, prompts))].clone()

    def _capture(self, T: int, G: int | None, slots: int, bound: int, temperature: float) -> tuple:
        import time

        from torch._dynamo.utils import counters

        from polyrl.rollout.gpu.graphs import capture
        t0, d = time.perf_counter(), self.device
        compiled = counters["stats"]["unique_graphs"]
        # until the first replay's inputs are copied in: sequences of `bound` tokens (T <= slots x bound holds for
        # every pack of this key, so the warm-up and the capture see a valid pack), unshared
        ids, rows, targets = (torch.zeros(T, dtype=torch.long, device=d) for _ in range(3))
        pos = torch.arange(T, device=d) % bound
        cu = (torch.arange(slots + 1, device=d) * bound).clamp(max=G or T).to(torch.int32)
        shared = (torch.arange(G, device=d) % T,
                  (torch.arange(slots + 1, device=d) * bound).clamp(max=T).to(torch.int32)) if G else ()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        layout = (shared[0], None, shared[1]) if G else ()  # gather, scatter (CPU attention only), cu_q
        graph, (logp, _) = capture(lambda: _packed_logprobs(self.lm, ids, pos, cu, bound, rows, targets, temperature,
                                                            False, *layout), pool=self.pool, device=d,
                            stream=self.stream)
        self.capture_s += time.perf_counter() - t0  # capture() waited for the warm-up; a capture runs nothing
        self.compiles += counters["stats"]["unique_graphs"] - compiled
        return (ids, pos, cu, rows, targets, *shared), logp, graph


def shares_prompts(lm: torch.nn.Module, device) -> bool:
    """Whether the engine's scoring computes a prompt shared by several samples once (SHARE_PROMPTS, and attention is
    the varlen kernel: a prompt row's output does not depend on the length of the sequence after it, since a key
    block past the row is fully masked for it and adds exact zeros; CPU SDPA tiles a sequence's keys by its length)."""
    return SHARE_PROMPTS and varlen.usable(torch.device(device), next(lm.parameters()).dtype)


def score_samples(lm: torch.nn.Module, samples: list, temperature: float, device,
                  graphs: GraphedScoring | None = None, routing=None) -> list[torch.Tensor]:
    """The engine's side: each sample's response log-probs [R_i] (on the device, queued: no host sync),
    packed PACK_TOKENS at a time (through `graphs`, CUDA graphs of the same arithmetic, when given). routing: lm's
    MoERouting, to set each sample's routed_experts to the routes of this pass (what the trainer's forward computes
    too, so R3 replays its own routes)."""
    parts: list[torch.Tensor] = []
    group: list = []
    share = routing is None and shares_prompts(lm, device)  # MoE routes are recorded per sequence's rows

    def flush():
        if group:
            shares = prompt_shares(keys) if share else None
            if graphs is not None:
                lp = graphs([s.prompt_ids + s.response_ids for s in group], [len(s.prompt_ids) for s in group],
                            temperature, shares)
            else:
                seqs = sequences_to_device([(torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long),
                                             len(s.prompt_ids)) for s in group], device)
                if routing is not None:
                    routing.begin_at(*pack_positions([len(x) for x, _ in seqs], device), device, record=True,
                                     count=False)
                try:
                    lp = sequences_logprobs(lm, seqs, temperature=temperature, shares=shares)[0]
                    if routing is not None:
                        for s, routes in zip(group, routing.recorded(drop_last=True)):
                            s.routed_experts = routes
                finally:
                    if routing is not None:
                        routing.end()
            parts.append(lp)
            group.clear()

    # a pack holds PACK_TOKENS rows: a prompt already in it costs none (keys: its samples' prompts, once as tuples)
    used, keys, seen = 0, [], set()
    for s in samples:
        key = tuple(s.prompt_ids) if share else None
        n = len(s.response_ids) + (0 if key in seen else len(s.prompt_ids))
        if group and used + n > PACK_TOKENS:
            flush()
            used, keys, seen = 0, [], set()
            n = len(s.prompt_ids) + len(s.response_ids)
        keys.append(key)
        if share:
            seen.add(key)
        group.append(s)
        used += n
    flush()
    if not parts:
        return []
    # left on the device: report() builds the sampler's values on the host while the packs run, then copies once
    return list(torch.cat(parts).split([len(s.response_ids) for s in samples]))


def report(samples: list, logps: list[torch.Tensor]) -> float:
    """Each sample's rollout_logprobs replaced by its scored log-probs (logps, from score_samples); returns the
    largest |sampler's log-prob - scored one| over the tokens the sampler drew (loss mask 1: an agent's sample also
    holds template and tool tokens, logged 0.0) (rollout/sampler_logprob_abs_diff_max), over all samples at once."""
    lens = [int(x.numel()) for x in logps]
    bad = next((i for i, (s, n) in enumerate(zip(samples, lens)) if len(s.rollout_logprobs) != n), None)
    if bad is not None:
        raise ValueError(f"--true-on-policy: sample {bad}'s sampler reported {len(samples[bad].rollout_logprobs)} "
                         f"log-probs for {lens[bad]} scored response tokens")
    decoded = [x for s in samples for x in s.rollout_logprobs]
    if not decoded:
        return 0.0
    decoded = torch.tensor(decoded, dtype=torch.float32)  # host work while the device still scores
    drawn = torch.tensor([m for s, n in zip(samples, lens) for m in (getattr(s, "loss_mask", None) or [1] * n)], dtype=torch.bool)
    scored = torch.cat(logps).cpu()  # the one wait for the scoring pass
    worst = float((scored - decoded).abs()[drawn].max()) if bool(drawn.any()) else 0.0
    flat, start = scored.tolist(), 0
    for s, n in zip(samples, lens):
        s.rollout_logprobs = flat[start:start + n]
        start += n
    return worst


def check_sampling(sp, vocab: int) -> None:
    """ValueError for a request whose sampled distribution is not the one the trainer scores."""
    if not sp.greedy and (0 < sp.top_k < vocab or sp.top_p < 1.0):
        raise ValueError("--true-on-policy: top-p / top-k sampling draws from a renormalised distribution, not the "
                         "one the trainer scores; send top_p 1 and top_k -1")


def scoring_shell(config, dtype: torch.dtype, device, *, checkpointing: bool = False) -> torch.nn.Module:
    """An HF causal LM of `config` built on the meta device, prepare()d, its layers compiled where compiles() says:
    the scoring function's module code with no weights of its own (bind_weights gives it some). Its rotary buffers
    are real, computed on the CPU as the trainer's from_pretrained computes them, then moved to `device`. In eval
    mode. checkpointing: a trainer's shell whose layers recompute in the backward (in train mode), with the
    arithmetic of their forward (checkpoint_contexts), as the FSDP backend's model does."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=register_attention())
    lm.eval().requires_grad_(False)
    prepare(lm)
    for name, mod in list(lm.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):  # rotary inv_freq: rebuilt on the CPU, then moved
            fresh = type(mod)(config=mod.config).to(device)
            parent, _, leaf = name.rpartition(".")
            setattr(lm.get_submodule(parent) if parent else lm, leaf, fresh)
    if checkpointing:
        from polyrl.backends.fsdp.parallelize import apply_ac
        apply_ac(lm, checkpoint_contexts)
    compile_layers(lm, device)  # the trainer's model and every shell decide it alike
    return lm


def bind_weights(lm: torch.nn.Module, tensors, who: str) -> None:
    """Every parameter of the shell `lm` becomes tensors[its HF name] (a tied LM head: the embedding's), no copy. A
    tensor that requires grad (one derived under autograd from a trainer's own parameters) goes in as it is, so that
    the shell's forward trains those parameters, as torch.func.functional_call does; any other as a frozen
    Parameter over it. who: the holder, for the errors."""
    tied = getattr(lm.config.get_text_config(), "tie_word_embeddings", False)
    for name, p in list(lm.named_parameters(remove_duplicate=False)):
        src = tensors.get(name)
        if src is None and tied and name == "lm_head.weight":
            src = tensors.get("model.embed_tokens.weight")
        if src is None:
            raise KeyError(f"--true-on-policy: {who} has no weight {name!r} for the scoring model")
        if tuple(src.shape) != tuple(p.shape) or src.dtype != p.dtype:
            raise ValueError(f"--true-on-policy: {name}: {who} holds {tuple(src.shape)} {src.dtype}, the "
                             f"scoring model wants {tuple(p.shape)} {p.dtype}")
        _put(lm, name, src if src.requires_grad else torch.nn.Parameter(src, requires_grad=False))


def unbind_weights(lm: torch.nn.Module) -> None:
    """The shell's parameters back on the meta device: it holds no tensor of its owner's any more."""
    for name, p in list(lm.named_parameters(remove_duplicate=False)):
        _put(lm, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))


def _put(lm: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    lm.get_submodule(parent)._parameters[leaf] = t


class EngineScorer:
    """The GPU engine's reporter (polyrl.rollout.gpu.engine.GPUEngine.rescore): an HF causal LM built on the meta
    device whose parameters are the engine's HF-named weight views (`weights()` -> name -> tensor), so the log-probs it
    reports come from `sequences_logprobs` over the very bits the engine samples with. Costs no weight memory: only the
    rotary buffers (computed on the CPU, as the trainer's from_pretrained computes them) and one sequence's
    activations. The views are re-read whenever the engine's buffer moved (sleep / wake rebinds them)."""

    def __init__(self, hf_checkpoint: str, weights, *, device: torch.device, dtype: torch.dtype,
                 cuda_graph: bool = False):
        from transformers import AutoConfig
        self.lm = scoring_shell(AutoConfig.from_pretrained(hf_checkpoint), dtype, device)
        self.weights, self.device, self._bound = weights, device, None
        from polyrl.backends.routing_replay import MoERouting
        self.routing = MoERouting.attach(self.lm)  # MoE: the routes of the scoring pass, for a request that asks (R3)
        # an MoE layer's expert loop reads which experts were hit back to the host: not capturable, so MoE scores eagerly
        graphed = cuda_graph and torch.device(device).type == "cuda" and self.routing is None
        self.graphs = GraphedScoring(self.lm, device) if graphed else None
        self.sampler_diff: float | None = None  # the largest |decode log-prob - reported log-prob| since stats()
        self.score_s = 0.0

    def _bind(self) -> None:
        views = self.weights()
        key = tuple(v.data_ptr() for v in views.values())
        if key == self._bound:
            return
        bind_weights(self.lm, views, "the engine")
        self._bound = key
        if self.graphs is not None:  # graphs read the weights where they were captured
            self.graphs.use(key)

    def release(self) -> None:
        """Drop the views of the engine's weights (the engine sleeps): a Parameter that views the engine's buffer keeps
        all of it allocated, a copy of the model held through the train phase beside the trainer. The next call binds
        the views again; the graphs of the last two places stay (GraphedScoring.use)."""
        unbind_weights(self.lm)
        self._bound = None

    @torch.no_grad()
    def __call__(self, samples: list, sp) -> list:
        """Replace each sample's rollout_logprobs with the scoring function's (the decode's are kept apart only to
        measure how far the sampler was from them)."""
        import time
        check_sampling(sp, self.lm.get_output_embeddings().weight.shape[0])
        t = time.perf_counter()
        self._bind()
        temperature = 0.0 if sp.greedy else sp.temperature
        todo = [s for s in samples if s.response_ids]
        routing = self.routing if sp.return_routed_experts else None  # R3: this pass's routes, not the decode's
        worst = report(todo, score_samples(self.lm, todo, temperature, self.device, self.graphs, routing))
        self.sampler_diff = max(self.sampler_diff or 0.0, worst)
        self.score_s += time.perf_counter() - t
        return samples

    def stats(self) -> dict[str, float]:
        """rollout/sampler_logprob_abs_diff_max (the sampler's distance from exact) and rollout/score_s (the scoring
        passes' wall time) since the last call; with CUDA graphs, those captured for new pack shapes, the sets dropped
        for a new place of the weights, the seconds the captures took (part of rollout/score_s), and the graphs
        torch.compile made in their warm-ups (a capture that compiles takes seconds, one that does not ~0.2 s)."""
        if self.sampler_diff is None:
            return {}
        out = {"rollout/sampler_logprob_abs_diff_max": self.sampler_diff, "rollout/score_s": self.score_s}
        if self.graphs is not None:
            captures, resets = self.graphs.sets.drain()
            out["rollout/score_graph_captures"], out["rollout/score_graph_resets"] = float(captures), float(resets)
            out["rollout/score_graph_capture_s"], self.graphs.capture_s = self.graphs.capture_s, 0.0
            out["rollout/score_graph_compiles"], self.graphs.compiles = float(self.graphs.compiles), 0
        self.sampler_diff, self.score_s = None, 0.0
        return out


def refuse_unsupported(cfg, command: str) -> None:
    """ConfigError for a setting that --true-on-policy cannot keep exact (after config.validate). The backend kind is
    checked with the other capabilities (polyrl.capabilities.NEEDS); the engine kind, the device, the dtype and the
    settings that change the arithmetic or the sampled distribution here."""
    if not cfg.model.true_on_policy:
        return
    from polyrl.config import ConfigError
    from polyrl.dist import resolve_device
    from polyrl.placement import engine_kind
    from polyrl.rollout.base import ENGINE_CAPABILITIES

    def no(what: str, why: str) -> ConfigError:
        return ConfigError(f"--true-on-policy with {what}: {why}; drop one of them (docs/true-on-policy.md)")

    m, r, b = cfg.model, cfg.rollout, cfg.batch
    cuda = resolve_device(cfg.cluster.device) != "cpu"
    if not cuda and m.dtype("cpu") != torch.float32:
        raise no("--fp16" if m.fp16 else "--bf16", "on CPU the mode computes in FP32")
    if cuda and m.fp16:
        raise no("--fp16", "on CUDA the mode is proved in BF16 (the default) and FP32")
    if m.attn_implementation not in ("auto", "sdpa", "eager"):
        raise no(f"--attn-implementation {m.attn_implementation}", "every sequence is scored as one unpadded row "
                 "through SDPA (or eager), which reads no packed sequence boundaries")
    if m.compile and not cuda:
        raise no("--compile", "on CPU the mode runs its layers eagerly in the engine and the trainer")
    if m.compile is False and cuda:
        raise no("--no-compile", "on CUDA the mode compiles the dense decoder layers of the engine's scorer and of the "
                 "trainer alike (the engine does not read the flag), so that both run the same kernels")
    if m.use_routing_replay:
        raise no("--use-routing-replay", "R2 records the routes of the trainer's old-log-prob pass, which this mode "
                 "skips (the rollout's log-probs are the old policy's); --use-rollout-routing-replay (R3) replays the "
                 "routes of the engine's scoring pass")
    if m.lora_rank:
        raise no("--lora-rank", "the engine runs merged weights while the trainer adds the adapters, a different "
                 "arithmetic")
    if cfg.cluster.train_backend == "megatron":
        from polyrl.backends.megatron.exact import problem
        from polyrl.hf_families import checkpoint_config
        why = problem(checkpoint_config(m.hf_checkpoint), cfg.megatron)
        if why is not None:
            raise no("--train-backend megatron", why)
    if command not in ("train", "eval"):
        return
    kind = engine_kind(cfg)
    shown = {"external": "--rollout-external", "none": "--debug-train-only"}.get(kind, f"--rollout-engine {kind}")
    if "true_on_policy" not in ENGINE_CAPABILITIES[kind]:
        who = ", ".join(k for k, c in ENGINE_CAPABILITIES.items() if "true_on_policy" in c)
        raise no(shown, f"only engines that score with the trainer's function honour it ({who})")
    if r.rollout_top_p < 1.0:
        raise no(f"--rollout-top-p {r.rollout_top_p:g}", "nucleus sampling draws from a renormalised distribution, "
                 "not the one the trainer scores")
    if r.rollout_top_k != -1:
        raise no(f"--rollout-top-k {r.rollout_top_k}", "top-k sampling draws from a renormalised distribution, not "
                 "the one the trainer scores")
    if b.micro_batch_layout != "auto":
        raise no(f"--micro-batch-layout {b.micro_batch_layout}", "the mode lays every sample out as its own unpadded "
                 "row, whatever the micro-batch")
    if r.async_training:
        raise no("--async", "the rollout runs on weights older than the trainer's")
    if r.custom_generate_function_path:
        raise no("--custom-generate-function-path", "each engine call scores its own turn, the trainer the whole sample")
    if r.agent_function_path and kind != "embedded":
        raise no(f"--agent-function-path and {shown}", "an agent's sample is scored once whole after its calls, by "
                 "the engine in the trainer's process only (a server has no route that scores given tokens)")
    if cfg.data.multimodal_keys:
        raise no("--multimodal-keys", "the scoring function reads token ids only, not pixel inputs")
    if r.rollout_max_context_len is not None:
        raise no("--rollout-max-context-len", "a sample cut after generation is not the sequence the engine scored")
