"""--true-on-policy on CUDA in BF16: the GPU engine (paged KV cache, CUDA graphs) samples with its own kernels and
reports each sample's log-probs from the trainer's scoring function over its own weights; the FSDP trainer scores the
same sequences alone. Every loss-masked token of 3 GRPO steps must agree bit for bit (read from the loss's raw
per-token values, tests/test_true_on_policy.py's spy), at two batch sizes, on the Qwen2.5-0.5B shape (random weights)
and on tiny Qwen3 and Llama shapes. Run with `make test-gpu`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import make_model_dir
from test_true_on_policy import assert_every_token_exact, install_spy, rows, spy_routing

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with make test-gpu on a GPU machine)")

# partial credit from the token ids: random weights rarely write digits, and the steps must change the weights
REWARD = '''
def ids(sample):
    return (sum(sample.response_ids) % 10) / 10.0
'''


@pytest.fixture(scope="module")
def half_b(tmp_path_factory):
    """The Qwen2.5-0.5B shape with random BF16 weights (bench/common.py's builder)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    from common import build_model_dir
    out = str(tmp_path_factory.mktemp("qwen05b"))
    build_model_dir(out, "qwen2.5-0.5b")
    return out


def run_exact(model: str, data: str, tmp_path, monkeypatch, *extra: str, backend=None
              ) -> tuple[list[dict], list[dict], list[tuple]]:
    """backend: the trainer's class (FSDP's by default; extra then carries its --train-backend)."""
    from polyrl.cli import main
    from polyrl.rollout.gpu.engine import GPUEngine
    records = install_spy(monkeypatch.setattr, backend)
    engines: list[tuple] = []
    generate = GPUEngine.generate

    def seen(self, prompts, params):
        out = generate(self, prompts, params)
        scorer = self.rescore
        engines.append((self.cuda_graph, len(self.graphs),
                        scorer is not None and scorer.graphs is not None and scorer.graphs.captures > 0))
        return out
    monkeypatch.setattr(GPUEngine, "generate", seen)
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    run = tmp_path / "run"
    argv = ["train", "--hf-checkpoint", model, "--prompt-data", data, "--custom-rm-path", f"{rm}:ids",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
            "--lr", "1e-3", "--num-rollout", "3", "--quiet", "--seed", "3", "--device", "cuda", "--true-on-policy",
            "--ci-train-rollout-logprob-abs-diff-threshold", "0", "--run-dir", str(run),
            # several runs share this process: what an earlier one's caching allocator keeps is not free for the next
            "--rollout-mem-fraction", "0.1", *extra]
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    assert main(argv) == 0
    return rows(run), records, engines


def assert_exact(rs: list[dict], records: list[dict], engines: list[tuple]) -> None:
    assert [r["step"] for r in rs] == [1, 2, 3]
    for r in rs:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_logprob_abs_diff"] == 0.0, r
        assert r["grad_norm"] > 0
        # the control: the CUDA-graph decode's own log-probs differ from the reported ones (BF16 kernels of another
        # shape), so an exact zero above is the scoring function's doing
        assert r["rollout/sampler_logprob_abs_diff_max"] > 0
        # the step's allocator peaks: the engine's KV cache (a tenth of the GPU) alone is GiBs; reserved holds allocated
        assert 0.5 < r["memory/peak_allocated_gib"] <= r["memory/peak_reserved_gib"], r
    # every call went through the GPU engine with captured CUDA graphs and the scorer's graphed scoring pass
    assert engines and all(g and n > 0 and scored for g, n, scored in engines), engines
    assert 3 * 16 <= assert_every_token_exact(records) <= 3 * 16 * 16
    assert {r["call"] for r in records} == {1, 2, 3}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("extra", [["--micro-batch-size", "1"], ["--micro-batch-size", "8", "--rollout-batch-generate", "3"],
                                   ["--micro-batch-size", "4", "--gradient-checkpointing"]],
                         ids=["mbs1", "mbs8_gen3", "mbs4_checkpointing"])
def test_half_b_shape_bf16_exact_over_three_steps(half_b, arith_data, tmp_path, monkeypatch, extra):
    assert_exact(*run_exact(half_b, arith_data["train"], tmp_path, monkeypatch, *extra))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_qwen3_and_llama_bf16_exact(arch, arith_data, tmp_path, monkeypatch):
    model = make_model_dir(tmp_path / arch, arch=arch, hidden=128, layers=2, tied=arch == "qwen3")
    assert_exact(*run_exact(model, arith_data["train"], tmp_path, monkeypatch, "--micro-batch-size", "3"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_half_b_shape_a_tokens_value_does_not_depend_on_its_pack(half_b, compiled):
    """tests/test_true_on_policy.py's invariance check on CUDA in BF16 (varlen attention, 2048-row blocks, the chunked
    head): each sequence's log-probs are the same bits alone, in packs of other orders and behind leading sequences
    that move it across block boundaries, with autograd recording or not (compiled: the training graph's forward and
    the inference graph, as the trainer and the engine's scorer run them)."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import ROWS, compile_layers, compiles, prepare, sequences_logprobs
    lm = prepare(AutoModelForCausalLM.from_pretrained(half_b, dtype=torch.bfloat16).cuda().eval())
    assert compiles(lm, "cuda")
    if compiled:
        assert compile_layers(lm, "cuda")
    g = torch.Generator().manual_seed(0)
    vocab = lm.config.vocab_size
    seqs = [(torch.randint(0, vocab, (n,), generator=g).cuda(), p) for n, p in ((700, 40), (3000, 300), (90, 89), (1333, 1))]
    assert sum(len(x) for x, _ in seqs) > 2 * ROWS["cuda"]
    with torch.no_grad():
        alone = [sequences_logprobs(lm, [q], temperature=0.9)[0] for q in seqs]
        for order in ([0, 1, 2, 3], [3, 2, 0, 1], [1, 3]):
            for lead in (0, 1, 517):
                pre = [(torch.randint(0, vocab, (lead,), generator=g).cuda(), 1)] if lead else []
                got = sequences_logprobs(lm, pre + [seqs[i] for i in order], temperature=0.9)[0]
                got = got[(lead - 1 if lead else 0):].split([len(seqs[i][0]) - seqs[i][1] for i in order])
                for i, lp in zip(order, got):
                    assert torch.equal(lp, alone[i]), (order, lead, i, (lp - alone[i]).abs().max())
    lm.requires_grad_(True)
    with_grad = sequences_logprobs(lm, seqs, temperature=0.9)[0]
    assert torch.equal(with_grad.detach(), torch.cat(alone))
    with_grad.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lm.parameters())


@gpu
@pytest.mark.gpu
def test_half_b_shape_graphed_scoring_equals_the_eager_pass(half_b):
    """The engine's scoring pass replayed from CUDA graphs (GraphedScoring: packs padded to GRAPH_ROWS tokens, the
    sequence count to a slot count per pack size, the attention bound to a power of two) gives each sequence the bits of the
    eager pass (sequences_logprobs, which pads to ROWS and bounds the attention by the pack's own longest sequence),
    over packs of other compositions that share a graph and others that need a new one; a replay with the weights
    changed in place reads the new weights."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import GraphedScoring, prepare, sequences_logprobs
    lm = prepare(AutoModelForCausalLM.from_pretrained(half_b, dtype=torch.bfloat16).cuda().eval())
    graphs = GraphedScoring(lm, torch.device("cuda"))
    g = torch.Generator().manual_seed(1)
    vocab = lm.config.vocab_size

    def pack(shape):
        return [(torch.randint(0, vocab, (n,), generator=g).tolist(), p) for n, p in shape]

    packs = [pack(((300, 40), (290, 12), (257, 200))), pack(((310, 30), (100, 99), (280, 1))),  # one graph
             pack(((700, 40), (3000, 300), (90, 89), (1333, 1), (5, 2))),  # another: 6144 rows, 4096 bound
             pack(((270, 14),) * 60)]  # 60 sequences of a GRPO batch: 16384 rows
    with torch.no_grad():
        for k, seqs in enumerate(packs):
            got = graphs([x for x, _ in seqs], [p for _, p in seqs], 0.9).cpu()
            want = sequences_logprobs(lm, [(torch.tensor(x).cuda(), p) for x, p in seqs], temperature=0.9)[0].cpu()
            assert torch.equal(got, want), (k, (got - want).abs().max())
        assert graphs.captures == 3 and len(graphs.sets.current) == 3
        for p in lm.parameters():  # an in-place weight update (the engine's sync) is what the next replay reads
            p.mul_(0.5)
        seqs = packs[0]
        got = graphs([x for x, _ in seqs], [p for _, p in seqs], 0.9).cpu()
        want = sequences_logprobs(lm, [(torch.tensor(x).cuda(), p) for x, p in seqs], temperature=0.9)[0].cpu()
        assert torch.equal(got, want) and graphs.captures == 3


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_half_b_shape_a_shared_prompt_scored_once_keeps_every_tokens_bits(half_b, compiled):
    """The engine's scoring with a GRPO group's prompt rows computed once (pack_layout's shares: the other sequences
    of the group bring only their responses, attention runs over each sequence whole from the gathered rows) gives
    every response token the bits it gets alone, eager and replayed from CUDA graphs: the prompt rows' values do not
    depend on the length of the sequence they were computed in (the varlen kernel's key blocks past a row are fully
    masked for it). Prompts of 1, 40, 65 and 300 tokens, responses of 1 to 900 tokens, groups cut by other prompts."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import (GraphedScoring, compile_layers, prepare, prompt_shares,
                                                sequences_logprobs)
    lm = prepare(AutoModelForCausalLM.from_pretrained(half_b, dtype=torch.bfloat16).cuda().eval())
    if compiled:
        assert compile_layers(lm, "cuda")
    graphs = GraphedScoring(lm, torch.device("cuda"))
    g = torch.Generator().manual_seed(2)
    vocab = lm.config.vocab_size
    seqs = []
    for plen, responses in ((40, (256, 3, 900, 256)), (1, (1, 77)), (300, (12, 600)), (65, (130, 129, 1, 64))):
        prompt = torch.randint(0, vocab, (plen,), generator=g).tolist()
        seqs += [(prompt + torch.randint(0, vocab, (r,), generator=g).tolist(), plen) for r in responses]
    seqs.insert(3, seqs.pop(9))  # a group cut by another prompt's sequence: its later members still share
    shares = prompt_shares([x[:p] for x, p in seqs])
    assert sum(j is not None for j in shares) == 8
    with torch.no_grad():
        alone = torch.cat([sequences_logprobs(lm, [(torch.tensor(x).cuda(), p)], temperature=0.9)[0] for x, p in seqs])
        eager = sequences_logprobs(lm, [(torch.tensor(x).cuda(), p) for x, p in seqs], temperature=0.9, shares=shares)[0]
        assert torch.equal(eager, alone), (eager - alone).abs().max()
        for _ in range(2):  # the capture, then a replay
            got = graphs([x for x, _ in seqs], [p for _, p in seqs], 0.9, shares)
            assert torch.equal(got, alone), (got - alone).abs().max()
        # a pack where no sequence shares keeps the gathered layout, as the identity: its bits are the plain ones,
        # and the compiled layers make no graph of their own for it (one did, 3-4 s in the middle of a 1.5B run)
        lone = [q for q, j in zip(seqs, shares) if j is None]
        want = torch.cat([sequences_logprobs(lm, [(torch.tensor(x).cuda(), p)], temperature=0.9)[0] for x, p in lone])
        before = graphs.compiles
        got = graphs([x for x, _ in lone], [p for _, p in lone], 0.9, [None] * len(lone))
        assert torch.equal(got, want), (got - want).abs().max()
        assert graphs.compiles == before


# the engine and its scorer in a process of their own, so that a hung GPU fails the test at the timeout
REPLAY_DURING_DECODE = r"""
import sys
import torch
from polyrl.backends.true_on_policy import EngineScorer, prompt_shares
from polyrl.rollout.gpu.engine import GPUEngine
from polyrl.types import SamplingParams

model, shared_capture = sys.argv[1], sys.argv[2] == "shared"
eng = GPUEngine(model, dtype=torch.bfloat16, max_batch=64, mem_fraction=0.1, ignore_eos=True)
scorer = EngineScorer(model, lambda: eng.model.hf, device=eng.device, dtype=eng.dtype, cuda_graph=True)
if shared_capture:  # the control: torch's one capture stream for every graph, as before the fix
    scorer.graphs.stream = None
g = torch.Generator().manual_seed(0)
prompts = torch.randint(20, 150000, (8, 40), generator=g).tolist()
params = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=96, n=8, seed=seed)
out = eng.generate(prompts, params(0))
scorer._bind()
seqs, P = [s.prompt_ids + s.response_ids for s in out], [len(s.prompt_ids) for s in out]
shares = prompt_shares([tuple(s.prompt_ids) for s in out])
with torch.no_grad():
    alone = scorer.graphs(seqs, P, 1.0, shares).cpu()  # the capture and a first replay, with nothing else running
    side, got, launch = torch.cuda.Stream(), [], GPUEngine._launch_step

    def launch_step(self):  # replays of the scoring graph while the decode's graphs run on the engine's stream
        if self._nsteps in (8, 40):
            with torch.cuda.stream(side):
                got.append(scorer.graphs(seqs, P, 1.0, shares))
        return launch(self)
    GPUEngine._launch_step = launch_step
    eng.generate(prompts, params(1))
    side.synchronize()
assert len(got) == 2 and all(torch.equal(x.cpu(), alone) for x in got), [(x.cpu() - alone).abs().max() for x in got]
print("replayed during the decode:", len(got))
"""


@gpu
@pytest.mark.gpu
def test_scoring_graphs_replayed_during_the_decode_keep_their_bits(half_b, tmp_path):
    """The scorer's CUDA graphs are captured on a stream of their own (GraphedScoring.stream): torch keys cuBLAS's
    workspace by stream, and with the one capture stream torch gives every graph, a scoring replay launched on a
    side stream during the engine's decode hung the GPU (H200, the 1.5B shape, and this script at the 0.5B shape with
    `shared` for `own`: killed at 60 s). Replayed twice during a decode, they finish and give the bits of a replay
    with nothing else running."""
    import subprocess
    script = tmp_path / "replay.py"
    script.write_text(REPLAY_DURING_DECODE)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        res = subprocess.run([sys.executable, str(script), half_b, "own"], capture_output=True, text=True,
                             timeout=240, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("scoring graphs replayed during a decode did not finish in 240 s (a hung GPU?)")
    assert res.returncode == 0 and "replayed during the decode: 2" in res.stdout, res.stderr[-3000:]


@gpu
@pytest.mark.gpu
def test_row_kernel_rmsnorm_is_batch_invariant_and_hf_close():
    """The CUDA row kernel that the mode's RMSNorms run: a row's bits do not depend on how many rows share the launch
    or where the row sits (a 1-row, a 7-row and a 5000-row launch), and the value is HF's Qwen2RMSNorm within one BF16
    rounding of each product (HF rounds x * rsqrt(var) to BF16 before the weight, as the kernel does; the fp32 sums
    differ only in order: 2^-7 relative allowed)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from polyrl.backends.true_on_policy import _rms_op_fits, rms_rows
    torch.manual_seed(0)
    norm = Qwen2RMSNorm(896, eps=1e-6).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(896) * 0.5 + 1)
    x = (torch.randn(5000, 896, device="cuda") * 3).to(torch.bfloat16)
    assert _rms_op_fits(norm, x)
    full = rms_rows(x, norm.weight, norm.variance_epsilon)
    for rows in (slice(123, 124), slice(4990, 4997), slice(0, 5000)):
        assert torch.equal(rms_rows(x[rows].clone(), norm.weight, norm.variance_epsilon), full[rows])
    with torch.no_grad():
        ref = norm(x)
    assert ((full.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    # inside a compiled layer the op is polyrl::rms_rows_launch, whose kernel Inductor compiles and launches from its
    # own code (passing eps as fp64, which the kernel rounds to the fp32 Triton's launcher passes): the eager bits, at
    # any row count of a dynamic-shape graph or a static one (x 2 / 2 is exact in BF16)
    from polyrl.backends.true_on_policy import _ops
    _ops()
    w, eps = norm.weight.detach(), norm.variance_epsilon
    for dynamic in (True, False):
        launch = torch.compile(lambda t: torch.ops.polyrl.rms_rows_launch(t, w, eps) * 2, dynamic=dynamic)
        for rows in (slice(0, 5000), slice(123, 124), slice(4990, 4997), slice(17, 2065)):
            got = launch(x[rows].clone()) / 2
            assert torch.equal(got, full[rows]), (dynamic, rows, int((got != full[rows]).sum()))


@gpu
@pytest.mark.gpu
def test_two_runs_with_the_same_seeds_log_the_same_metrics_on_cuda(half_b, arith_data, tmp_path, monkeypatch):
    """Run-to-run determinism on one GPU: two --true-on-policy runs with the same seeds log the same metrics.jsonl,
    wall-clock figures aside (the sampler's Philox streams are seeded; the trainer's kernels must not reduce in an order
    that varies between runs, or the weights, and with them every later step, would part)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, _, _ = run_exact(half_b, arith_data["train"], tmp_path / "a", monkeypatch, "--micro-batch-size", "4")
    second, _, _ = run_exact(half_b, arith_data["train"], tmp_path / "b", monkeypatch, "--micro-batch-size", "4")

    def untimed(rs):
        # what two runs may disagree on: seconds (time/*, rollout/*_s, tokens_per_s), how many CUDA graphs the
        # engine captured (graphs are kept per address of the weights and KV cache, which the allocator may place
        # elsewhere in a second run of the same process) and the allocator's peaks (memory/*: the first run's
        # cached blocks are still in the process)
        return [{k: v for k, v in r.items()
                 if not (k.startswith(("time/", "memory/")) or k.endswith("_s") or "graph_" in k)} for r in rs]
    a, b = untimed(first), untimed(second)
    assert len(a) == 3
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert x == y, (step, {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)})


@gpu
@pytest.mark.gpu
def test_exact_through_a_launched_polyrl_serve_on_cuda(arith_data, tmp_path, monkeypatch):
    """--rollout-engine server on CUDA: the launched `polyrl serve` runs the GPU engine with the scorer over its own
    weights (--true-on-policy on its command line), the weights reach it from disk (trainer and server share the one
    GPU, where NCCL cannot pair two processes), and every loss-masked token of 3 steps agrees bit for bit."""
    model = make_model_dir(tmp_path / "qwen3", arch="qwen3", hidden=128, layers=2, tied=True)
    rs, records, _ = run_exact(model, arith_data["train"], tmp_path, monkeypatch, "--rollout-engine", "server",
                               "--weight-sync", "disk", "--micro-batch-size", "3")
    assert [r["step"] for r in rs] == [1, 2, 3]
    for r in rs:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["grad_norm"] > 0, r
    assert 3 * 16 <= assert_every_token_exact(records) <= 3 * 16 * 16


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("r3", [False, True], ids=["routed", "r3"])
def test_tiny_qwen3_moe_bf16_exact(arith_data, tmp_path, monkeypatch, r3):
    """Qwen3-MoE on CUDA in BF16: the GPU engine decodes with its own MoE kernels (CUDA graphs), its scorer runs the
    invariant router and expert loop eagerly (the loop reads the experts hit back to the host, which a graph cannot),
    the trainer runs the same; with R3 the trainer replays the scoring pass's routes. Every token exact over 3 steps."""
    model = make_model_dir(tmp_path / "moe", arch="qwen3_moe", hidden=128, layers=2)
    replays = spy_routing(monkeypatch.setattr)
    extra = ["--micro-batch-size", "3"] + (["--use-rollout-routing-replay"] if r3 else [])
    rs, records, engines = run_exact(model, arith_data["train"], tmp_path, monkeypatch, *extra)
    assert [r["step"] for r in rs] == [1, 2, 3]
    for r in rs:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["grad_norm"] > 0, r
        assert r["moe/load_max_over_mean"] >= 1.0
    assert engines and all(g and n > 0 for g, n, _ in engines), engines  # the decode ran from CUDA graphs
    assert 3 * 16 <= assert_every_token_exact(records) <= 3 * 16 * 16
    assert any(replays) == r3


@gpu
@pytest.mark.gpu
def test_sleep_frees_the_weights_the_scorer_viewed(half_b, own_process):
    """Beside the trainer (shares_allocator) the engine's sleep frees its weights and KV cache for the train phase; the
    scorer's parameters are views of that weight buffer and kept all of it allocated until they were released at
    sleep (EngineScorer.release: 0.9 GiB at this shape, 2.9 GiB at 1.5B, through every train phase). After a wake and
    a full weight update the reported log-probs are the same bits."""
    if own_process:
        return
    import gc

    from polyrl.backends.true_on_policy import EngineScorer
    from polyrl.rollout.gpu.engine import GPUEngine
    from polyrl.types import SamplingParams
    gc.collect()
    torch.cuda.empty_cache()
    # a small share of the GPU: the test runs beside other workers' engines and trainers (make test-gpu)
    eng = GPUEngine(half_b, dtype=torch.bfloat16, mem_fraction=0.03, max_batch=64)
    eng.shares_allocator = True
    eng.rescore = EngineScorer(half_b, lambda: eng.model.hf, device=eng.device, dtype=eng.dtype, cuda_graph=True)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, n=4, seed=5)
    prompts = [[3, 4, 5, 6], list(range(20, 60))]
    want = eng.generate(prompts, sp)
    weights = {n: v.clone() for n, v in eng.model.hf.items()}
    held = eng.model.nbytes + eng.kv.nbytes
    before = torch.cuda.memory_allocated()
    eng.sleep()
    assert all(p.is_meta for p in eng.rescore.lm.parameters())
    dropped = before - torch.cuda.memory_allocated()
    if dropped < 0.95 * held:  # say whether only a reference cycle kept the weights' storage
        gc.collect()
        pytest.fail(f"the sleep freed {dropped} of the {held} bytes the engine held; after gc.collect() "
                    f"{before - torch.cuda.memory_allocated()} (weights {eng.model.nbytes}, KV {eng.kv.nbytes})")
    eng.wake()
    eng.update_weights(iter(weights.items()), version=1)
    got = eng.generate(prompts, sp)
    assert [(s.response_ids, s.rollout_logprobs) for s in got] == [(s.response_ids, s.rollout_logprobs) for s in want]
