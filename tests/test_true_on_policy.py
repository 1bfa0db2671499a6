"""--true-on-policy on CPU, FP32: the engine's reported log-probs and the trainer's are bit-identical, whatever the
micro-batch size, the number of ranks, the engine's batching (in process or through `polyrl serve`), and they stay so
over steps whose updates change the weights. The per-token values are read where the loss compares them
(polyrl.algorithms.losses.rl_loss, spied here), not only through the logged mean and max.

Run as a script (under torchrun) this file is the per-rank worker of the two-rank cases: it installs the same spy, runs
`polyrl train` and saves each rank's records.
"""

from __future__ import annotations

import json
import os
import sys
import types
import weakref

import pytest
import torch

from conftest import make_model_dir

REWARD = '''
def digits(sample):
    """partial credit, so an untrained model gets non-zero advantages and every step changes the weights"""
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
TIMING = ("time/", "tokens_per_s")  # wall-clock metrics: the only ones two identical runs may disagree on


# ---- the spy: every token the loss compares, per train_step ------------------------------------------------------
def install_spy(patch, backend=None) -> list[dict]:
    """patch(obj, name, value): monkeypatch.setattr, or setattr in the worker. Returns the list the records go to:
    one per rl_loss call with the train_step it belongs to, the trainer's log-probs, the rollout's, the loss mask and
    the step's global count of loss-masked tokens. backend: the backend class whose train_step calls count (FSDP's
    by default)."""
    import polyrl.step.learner as learner
    if backend is None:
        from polyrl.backends.fsdp.backend import FSDPBackend as backend
    records: list[dict] = []
    calls = [0]
    rl_loss, train_step = learner.rl_loss, backend.train_step

    def spy_loss(logprobs, entropy, mb, s, *, num_tokens, num_seqs):
        records.append({"call": calls[0], "logp": logprobs.detach().clone(), "rollout": mb["rollout_logprobs"].clone(),
                        "mask": mb["loss_mask"].clone(), "num_tokens": num_tokens, "samples": int(mb["seq_ids"].max()) + 1,
                        "old": mb["old_logprobs"].clone() if "old_logprobs" in mb else None})
        return rl_loss(logprobs, entropy, mb, s, num_tokens=num_tokens, num_seqs=num_seqs)

    def spy_step(self, *a, **kw):
        calls[0] += 1
        return train_step(self, *a, **kw)
    patch(learner, "rl_loss", spy_loss)
    patch(backend, "train_step", spy_step)
    return records


def assert_every_token_exact(records: list[dict], first_minibatch_only: int = 0) -> int:
    """Every loss-masked token of every train_step: trainer log-prob == rollout log-prob, bit for bit; the tokens
    compared add up to each step's global token count. first_minibatch_only=K: K optimizer steps per RL step, only the
    first of each runs on the weights that sampled (the later ones train updated weights). Returns tokens compared."""
    by_call: dict[int, list[dict]] = {}
    for r in records:
        by_call.setdefault(r["call"], []).append(r)
    compared = 0
    for call, rs in sorted(by_call.items()):
        masked = sum(float(r["mask"].sum()) for r in rs)
        assert masked == rs[0]["num_tokens"], (call, masked, rs[0]["num_tokens"])  # every masked token reaches the loss
        if first_minibatch_only and (call - 1) % first_minibatch_only:
            continue
        for r in rs:
            keep = r["mask"].bool()
            assert bool(keep.all()) or r["mask"].numel() == 1  # no loss mask in this task: every token counts
            assert torch.equal(r["logp"][keep], r["rollout"][keep]), (r["logp"] - r["rollout"]).abs().max()
            compared += int(keep.sum())
    return compared


def spy_routing(setattr_) -> list[bool]:
    """Whether each MoE routing forward (MoERouting.begin_at) replayed given routes, in call order."""
    from polyrl.backends.routing_replay import MoERouting
    replays: list[bool] = []
    begin_at = MoERouting.begin_at

    def seen(self, positions, n, device, **kw):
        replays.append(bool(kw.get("replay")))
        return begin_at(self, positions, n, device, **kw)
    setattr_(MoERouting, "begin_at", seen)
    return replays


def base_args(model: str, data: str, rm: str, run) -> list[str]:
    return ["train", "--hf-checkpoint", model, "--prompt-data", data, "--custom-rm-path", f"{rm}:digits",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--lr", "1e-2",
            "--num-rollout", "3", "--quiet", "--rollout-shuffle", "--seed", "3", "--device", "cpu",
            "--true-on-policy", "--ci-train-rollout-logprob-abs-diff-threshold", "0", "--run-dir", str(run)]


def rows(run) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def untimed(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rs]


@pytest.fixture
def args(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    return lambda run, *extra: base_args(tiny_model, arith_data["train"], str(rm), tmp_path / run) + list(extra)


def train(argv: list[str]) -> list[dict]:
    from polyrl.cli import main
    assert main(argv) == 0
    return rows(argv[argv.index("--run-dir") + 1])


def assert_exact_rows(rs: list[dict]) -> None:
    assert [r["step"] for r in rs] == [1, 2, 3]
    for r in rs:
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_logprob_abs_diff"] == 0.0, r
    assert all(r["grad_norm"] > 0 for r in rs)  # the weights move: steps 2 and 3 check the synced weights


# ---- one rank, the embedded engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mbs", ["1", "3", "8", "budget"])
def test_exact_at_every_micro_batch_size(args, monkeypatch, mbs):
    """budget: token-budget micro-batches, laid out to pad to fewer blocks (fewer_blocks) than token-balanced bins."""
    fewer: list[bool] = []
    if mbs == "budget":
        import polyrl.backends.fsdp.backend as fsdp_backend
        from polyrl.backends.base import fewer_blocks
        monkeypatch.setattr(fsdp_backend, "fewer_blocks", lambda plans, *a, **kw: (
            lambda out: fewer.append(out is not plans) or out)(fewer_blocks(plans, *a, **kw)))
    records = install_spy(monkeypatch.setattr)
    sizes = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "128"] if mbs == "budget" else ["--micro-batch-size", mbs]
    rs = train(args(f"mbs{mbs}", *sizes))
    assert any(fewer) == (mbs == "budget"), fewer  # two-block budgets: some step's plan padded to fewer blocks
    assert_exact_rows(rs)
    # 3 steps x 16 samples x 1..6 tokens: every one compared
    assert 3 * 16 <= assert_every_token_exact(records) <= 3 * 16 * 6
    assert {r["call"] for r in records} == {1, 2, 3}
    assert all(0 < r["rollout/sampler_logprob_abs_diff_max"] < 1e-4 for r in rs)  # the sampler: decode's rounding


def test_micro_batches_pad_to_fewer_blocks():
    """fewer_blocks: as many micro-batches, every sample once, each within the budget once padded, and never more
    blocks than the token-balanced plan; the GRPO bench's 128 x 296 tokens in two 24,576-token micro-batches pad to
    19 blocks of 2,048 rows instead of 20."""
    import random

    from polyrl.backends.base import fewer_blocks, padded_blocks, plan_micro_batches
    lens = [296] * 128
    balanced = plan_micro_batches(lens, max_tokens=24576)
    assert len(balanced) == 2 and padded_blocks(balanced, lens, 2048) == 20
    plans = fewer_blocks(balanced, lens, max_tokens=24576, block=2048)
    assert len(plans) == 2 and padded_blocks(plans, lens, 2048) == 19
    rng = random.Random(0)
    improved = 0
    for _ in range(200):
        lens = [rng.randint(20, 700) for _ in range(rng.randint(1, 60))]
        budget, block = rng.choice([(4096, 1024), (3000, 1024), (16384, 2048), (700, 64)])
        balanced = plan_micro_batches(lens, max_tokens=budget, num_micro_batches=rng.randint(1, 4))
        plans = fewer_blocks(balanced, lens, max_tokens=budget, block=block)
        assert len(plans) == len(balanced) and sorted(i for p in plans for i in p) == list(range(len(lens)))
        assert padded_blocks(plans, lens, block) <= padded_blocks(balanced, lens, block)
        if plans is not balanced:
            improved += 1
            assert all(-(-sum(lens[i] for i in p) // block) * block <= budget for p in plans)
    assert improved > 20
    # a budget below one block, or a sample longer than the budget's whole blocks: the plan as it was
    one = [[0], [1]]
    assert fewer_blocks(one, [30, 30], max_tokens=50, block=64) is one
    assert fewer_blocks(one, [3000, 30], max_tokens=3000, block=1024) is one


def test_activation_checkpointing_recomputes_the_modes_arithmetic(args):
    """--gradient-checkpointing with the mode: each layer's recomputation in the backward (outside the scoring context)
    runs the fixed-block arithmetic its forward ran (checkpoint_contexts), so the run neither fails torch's check of the
    saved tensors nor changes a value: every metric of 3 steps (losses, gradient norms, rewards), timings aside, equals
    the run without it, and the mismatch is 0 at every step."""
    plain = train(args("plain", "--micro-batch-size", "3"))
    ac = train(args("ac", "--micro-batch-size", "3", "--gradient-checkpointing"))
    assert_exact_rows(ac)
    assert untimed(ac) == untimed(plain)


def test_a_resumed_run_continues_exactly(args, tmp_path):
    """A run saved after step 2 and resumed (--load) for step 3 logs step 3 as the uninterrupted run does, every metric
    but timings, with the mismatch still exactly 0: the engine gets the resumed weights' bits."""
    ck = str(tmp_path / "ck")
    full = train(args("full"))
    train(args("first", "--num-rollout", "2", "--save", ck, "--save-interval", "1"))
    resumed = train(args("resumed", "--load", ck))
    assert [r["step"] for r in resumed] == [3] and resumed[0]["train_rollout_logprob_abs_diff_max"] == 0.0
    assert untimed(resumed) == untimed(full[2:])


def test_without_the_mode_the_same_run_differs_by_rounding(args, monkeypatch):
    """The control: the packed/padded forwards and the KV-cache decode agree only to FP32 rounding, which is what the
    mode removes (if this were exact too, the exact-zero tests above would prove nothing)."""
    argv = args("plain", "--micro-batch-size", "8")
    argv.remove("--true-on-policy")
    argv[argv.index("--ci-train-rollout-logprob-abs-diff-threshold") + 1] = "1e-4"
    rs = train(argv)
    assert any(r["train_rollout_logprob_abs_diff_max"] > 0 for r in rs)


def test_rollout_logprobs_are_the_old_policy_and_the_old_forward_is_skipped(args, monkeypatch):
    """Two optimizer steps per RL step need the pre-update log-probs: with the mode they are the rollout's (no actor
    log-prob pass); they equal what the trainer computes on the first minibatch, bit for bit."""
    from polyrl.backends.fsdp.backend import FSDPBackend
    passes: list[str] = []
    compute = FSDPBackend.compute_logprobs

    def counted(self, batch, *, model="actor", temperature=1.0):
        passes.append(model)
        return compute(self, batch, model=model, temperature=temperature)
    monkeypatch.setattr(FSDPBackend, "compute_logprobs", counted)
    records = install_spy(monkeypatch.setattr)
    argv = without_gate(args("two_minibatches", "--global-batch-size", "8"))  # later minibatches train moved weights
    rs = train(argv)
    assert passes == [] and all(r["old_logprobs_from_rollout"] == 1.0 for r in rs)
    assert all(torch.equal(r["old"], r["rollout"]) for r in records)
    assert assert_every_token_exact(records, first_minibatch_only=2) > 0
    plain = without_gate(args("two_minibatches_plain", "--global-batch-size", "8"))
    plain.remove("--true-on-policy")
    assert all(r["old_logprobs_from_rollout"] == 0.0 for r in train(plain)) and passes == ["actor"] * 3


def without_gate(argv: list[str]) -> list[str]:
    i = argv.index("--ci-train-rollout-logprob-abs-diff-threshold")
    return argv[:i] + argv[i + 2:]


def test_two_runs_with_the_same_seeds_log_the_same_metrics(args):
    a = train(args("first", "--micro-batch-size", "3"))
    b = train(args("second", "--micro-batch-size", "3"))
    assert_exact_rows(a)
    assert untimed(a) == untimed(b)


def test_the_gate_stops_a_run_whose_engine_computes_in_another_dtype(args, monkeypatch, capsys):
    """An engine forced to FP64 (the trainer stays FP32): its log-probs differ by rounding, and the threshold-0 gate
    stops the run at step 1."""
    from polyrl.rollout.embedded import EmbeddedEngine
    init = EmbeddedEngine.__init__

    def fp64(self, *a, **kw):
        init(self, *a, **{**kw, "dtype": torch.float64})
    monkeypatch.setattr(EmbeddedEngine, "__init__", fp64)
    from polyrl.cli import main
    argv = args("fp64")
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("polyrl train: error: step 1, sample ") and "threshold 0" in err
    assert ", response token " in err and ": train_rollout_logprob_abs_diff_max " in err
    (row,) = rows(argv[argv.index("--run-dir") + 1])
    assert 0 < row["train_rollout_logprob_abs_diff_max"] < 1e-4  # FP32 vs FP64 rounding, nothing else


def test_the_gate_names_the_step_the_sample_and_the_token(args, monkeypatch, capsys):
    """One token of one sample is moved by 0.5 in the second step's batch (every other token is exact): the gate
    stops the run at that step naming that sample's index in the batch and that token's position in its response."""
    import polyrl.step.learner as learner
    to_batch, calls, moved = learner.to_train_batch, [0], []

    def nudged(samples):
        batch = to_batch(samples)
        calls[0] += 1
        if calls[0] == 2:
            lp = batch.token_fields["rollout_logprobs"][5]
            moved.append(lp.numel() - 1)  # the last token of sample 5
            lp[-1] += 0.5
        return batch
    monkeypatch.setattr(learner, "to_train_batch", nudged)
    from polyrl.cli import main
    argv = args("nudged")
    argv[argv.index("--ci-train-rollout-logprob-abs-diff-threshold") + 1] = "0.1"
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"polyrl train: error: step 2, sample 5 of the step's batch, response token {moved[0]}: "
                          "train_rollout_logprob_abs_diff_max 0.5"), err
    r1, r2 = rows(argv[argv.index("--run-dir") + 1])
    assert r1["train_rollout_logprob_abs_diff_max"] == 0.0
    assert (r2["train_rollout_logprob_abs_diff_max_sample"], r2["train_rollout_logprob_abs_diff_max_token"]) == (5, moved[0])


def test_the_gpu_engines_scorer_reports_the_scoring_function_over_its_own_weights(tiny_model):
    """The GPU engine's reporter (run here on CPU in FP32 with its reference ops): an HF shell whose parameters are the
    engine's weight views reports exactly what sequences_logprobs gives on the checkpoint's HF model, follows the views
    when the engine's buffer moves (sleep / wake rebind it), and sees weight updates made in place."""
    from transformers import AutoModelForCausalLM

    from polyrl.backends.true_on_policy import EngineScorer, pin_threads, prepare, sequences_logprobs
    from polyrl.rollout.gpu.engine import GPUEngine
    from polyrl.types import SamplingParams
    pin_threads()
    eng = GPUEngine(tiny_model, device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4)
    eng.rescore = EngineScorer(tiny_model, lambda: eng.model.hf, device=eng.device, dtype=eng.dtype)
    shell_params = sum(p.numel() for p in eng.rescore.lm.parameters())
    hf = prepare(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=1)

    def check(model):
        out = eng.generate(prompts, sp)
        assert len(out) == 4
        for s in out:
            with torch.no_grad():
                want = sequences_logprobs(model, [(torch.tensor(s.prompt_ids + s.response_ids), len(s.prompt_ids))],
                                          temperature=1.0)[0]
            assert s.rollout_logprobs == want.tolist()
        st = eng.stats()
        assert 0 <= st["rollout/sampler_logprob_abs_diff_max"] < 1e-4 and eng.stats() == {}  # decode's FP32 rounding
        assert st["rollout/generate_s"] > 0 and st["rollout/score_s"] > 0  # the decode's time, the scoring's apart
    check(hf)
    # the shell holds views, no copy: the engine's buffer is the only storage of its weights
    ptrs = {p.untyped_storage().data_ptr() for p in eng.rescore.lm.parameters()}
    assert ptrs == {eng.model.flat.untyped_storage().data_ptr()} and shell_params == sum(
        p.numel() for p in hf.parameters())
    eng.model.bind(eng.model.flat.clone())  # the buffer moves, as a wake gives it a new one
    with torch.no_grad():
        for name, p in hf.named_parameters():  # an in-place update of every weight
            p.mul_(0.5)
    eng.update_weights(((n, p.detach()) for n, p in hf.named_parameters()), version=1)
    check(hf)
    assert {p.untyped_storage().data_ptr() for p in eng.rescore.lm.parameters()} == {
        eng.model.flat.untyped_storage().data_ptr()}
    # the engine's sleep releases the views (a view keeps the whole buffer allocated through the train phase): none
    # is left, and the next call binds them again
    held = weakref.ref(eng.model.flat)
    eng.rescore.release()
    assert all(p.is_meta for p in eng.rescore.lm.parameters())
    eng.model.bind(eng.model.flat.clone())
    assert held() is None  # nothing but the engine held the old buffer
    check(hf)
    # with CUDA graphs (GPU only: a stand-in here) the stats also carry the scoring graphs captured, the sets dropped
    # and the captures' seconds, each counted from the last stats()
    eng.generate(prompts, sp)
    eng.rescore.graphs = types.SimpleNamespace(sets=types.SimpleNamespace(drain=lambda: (2, 1)), capture_s=1.5,
                                               compiles=3)
    st = eng.stats()
    assert [st[f"rollout/score_graph_{k}"] for k in ("captures", "resets", "capture_s", "compiles")] == [2.0, 1.0, 1.5,
                                                                                                     3.0]
    assert eng.rescore.graphs.capture_s == 0.0 and eng.rescore.graphs.compiles == 0


# ---- the shared function ----------------------------------------------------------------------------------------
def test_engine_reports_the_scoring_function_whatever_its_batch(tiny_model):
    """A sample's reported log-probs are sequences_logprobs of its tokens, the same whether it was generated alone or
    in a batch of 8, and scoring the same shape again (after other shapes) gives the same bits."""
    from polyrl.backends.true_on_policy import THREADS, sequences_logprobs
    from polyrl.rollout.embedded import EmbeddedEngine
    from polyrl.types import SamplingParams
    eng = EmbeddedEngine(tiny_model, true_on_policy=True)
    assert torch.get_num_threads() == THREADS
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 2], [1]]  # the tiny vocabulary has 14 ids
    sp = SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=5)
    together = eng.generate(prompts, sp)
    alone = [s for i in range(len(prompts))
             for s in eng.generate([prompts[i]], SamplingParams(temperature=0.7, max_new_tokens=6, n=2,
                                                                prompt_seeds=[_prompt_seed(sp, i)]))]
    for a, b in zip(together, alone):
        assert a.response_ids == b.response_ids and a.rollout_logprobs == b.rollout_logprobs
        ids = torch.tensor(a.prompt_ids + a.response_ids)
        with torch.no_grad():
            want = sequences_logprobs(eng.model, [(ids, len(a.prompt_ids))], temperature=0.7)[0]
            sequences_logprobs(eng.model, [(torch.arange(20) % 10 + 3, 3)], temperature=0.7)  # another shape between
            again = sequences_logprobs(eng.model, [(ids, len(a.prompt_ids))], temperature=0.7)[0]
        assert a.rollout_logprobs == want.tolist() == again.tolist()
    with pytest.raises(ValueError, match="top-p / top-k"):
        eng.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=2))


def _prompt_seed(sp, i: int) -> int:
    from polyrl.rollout.sampling import prompt_seed
    return prompt_seed(sp, sp.seed, i)


def test_a_tokens_value_does_not_depend_on_its_pack(tiny_model):
    """The batch invariance itself: each sequence's log-probs are the same bits alone, packed with others in any order
    and grouping, behind a leading sequence of any length (which moves every token to another place in the fixed
    64-row blocks of the GEMMs and norms), and with autograd recording (the trainer) or not (the engine)."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import ROWS, prepare, sequences_logprobs
    torch.set_num_threads(1)
    lm = prepare(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(1, 14, (n,), generator=g), p) for n, p in ((9, 3), (40, 5), (17, 16), (63, 1), (25, 10))]
    assert sum(len(x) for x, _ in seqs) > 2 * ROWS["cpu"]  # the pack spans several blocks
    with torch.no_grad():
        alone = [sequences_logprobs(lm, [q], temperature=0.8)[0] for q in seqs]
        for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [3, 1]):
            for lead in (0, 1, 7, 30):
                pre = [(torch.randint(1, 14, (lead,), generator=g), 1)] if lead else []
                got = sequences_logprobs(lm, pre + [seqs[i] for i in order], temperature=0.8)[0]
                got = got[(lead - 1 if lead else 0):].split([len(seqs[i][0]) - seqs[i][1] for i in order])
                for i, lp in zip(order, got):
                    assert torch.equal(lp, alone[i]), (order, lead, i)
    with_grad = sequences_logprobs(lm, seqs, temperature=0.8)[0]
    assert torch.equal(with_grad.detach(), torch.cat(alone))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    """Qwen3-MoE, 8 experts, top-2, 2 layers, hidden 64."""
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3_moe"), arch="qwen3_moe")


def test_an_moe_tokens_value_does_not_depend_on_its_pack(tiny_moe):
    """The same invariance through MoE layers: the router runs on fixed blocks, each expert's GEMMs too (an expert
    gets another set of tokens in every pack), and a token's expert outputs are added in expert order; and the
    prepared model still computes the model (within FP32 rounding of HF's own forward: 20 ulps of values ~3)."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import prepare, sequences_logprobs
    torch.set_num_threads(1)
    lm = prepare(AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval())
    plain = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(1, 14, (n,), generator=g), p) for n, p in ((9, 3), (40, 5), (17, 16), (63, 1), (25, 10))]
    with torch.no_grad():
        alone = [sequences_logprobs(lm, [q], temperature=0.8)[0] for q in seqs]
        for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1], [3, 1]):
            for lead in (0, 7, 30):
                pre = [(torch.randint(1, 14, (lead,), generator=g), 1)] if lead else []
                got = sequences_logprobs(lm, pre + [seqs[i] for i in order], temperature=0.8)[0]
                got = got[(lead - 1 if lead else 0):].split([len(seqs[i][0]) - seqs[i][1] for i in order])
                for i, lp in zip(order, got):
                    assert torch.equal(lp, alone[i]), (order, lead, i)
        ids, p = seqs[1]
        ref = torch.log_softmax(plain(ids[None]).logits[0] / 0.8, -1)[p - 1:-1].gather(1, ids[p:, None])[:, 0]
        assert (ref - alone[1]).abs().max() < 20 * 2 ** -23 * 4
    with_grad = sequences_logprobs(lm, seqs, temperature=0.8)[0]
    assert torch.equal(with_grad.detach(), torch.cat(alone))
    with_grad.sum().backward()
    mlp = lm.model.layers[0].mlp
    assert mlp.experts.gate_up_proj.grad.abs().sum() > 0 and mlp.gate.weight.grad.abs().sum() > 0


def test_the_gpu_engines_scorer_reports_moe_logprobs_and_the_routes_of_its_scoring_pass(tiny_moe):
    """The GPU engine's reporter over a Qwen3-MoE (CPU, FP32, reference ops): its stacked expert views feed the
    invariant expert loop, the reported log-probs are sequences_logprobs of the checkpoint's HF model, and with
    return_routed_experts (R3) each sample's routes are those of that scoring pass (the trainer's forward computes the
    same ones), not the decode's."""
    from transformers import AutoModelForCausalLM

    from polyrl.backends.routing_replay import MoERouting
    from polyrl.backends.true_on_policy import EngineScorer, pack_positions, pin_threads, prepare, sequences_logprobs
    from polyrl.rollout.gpu.engine import GPUEngine
    from polyrl.types import SamplingParams
    pin_threads()
    eng = GPUEngine(tiny_moe, device="cpu", dtype=torch.float32, num_kv_blocks=256, block_size=4)
    eng.rescore = EngineScorer(tiny_moe, lambda: eng.model.hf, device=eng.device, dtype=eng.dtype)
    assert eng.rescore.routing is not None and eng.rescore.graphs is None
    hf = prepare(AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval())
    routing = MoERouting.attach(hf)
    out = eng.generate([[3, 4, 5], [6, 7, 8, 9, 10]], SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=1,
                                                                     return_routed_experts=True))
    for s in out:
        ids = torch.tensor(s.prompt_ids + s.response_ids)
        routing.begin_at(*pack_positions([len(ids)], "cpu"), "cpu", record=True, count=False)
        with torch.no_grad():
            want = sequences_logprobs(hf, [(ids, len(s.prompt_ids))], temperature=1.0)[0]
        (routes,) = routing.recorded(drop_last=True)
        routing.end()
        assert s.rollout_logprobs == want.tolist()
        assert torch.equal(s.routed_experts.long(), routes.long())


def test_moe_exact_over_three_steps_with_and_without_rollout_routing_replay(tiny_moe, arith_data, tmp_path, monkeypatch,
                                                                            capsys):
    """Qwen3-MoE through the embedded engine: every token exact at every step, with the routing counted (moe/* metrics)
    and a load-balancing loss added; with R3 (--use-rollout-routing-replay) the engine reports the routes of its
    scoring pass and the trainer replays them, still exact; R2 is refused (it records a pass the mode skips)."""
    from polyrl.cli import main
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)

    def argv(run, *extra):
        return base_args(tiny_moe, arith_data["train"], str(rm), tmp_path / run) + list(extra)
    records = install_spy(monkeypatch.setattr)
    rs = train(argv("moe", "--micro-batch-size", "3", "--moe-aux-loss-coeff", "0.01"))
    assert_exact_rows(rs)
    assert assert_every_token_exact(records) >= 3 * 16
    assert all(r["moe/load_max_over_mean"] >= 1.0 and r["moe/aux_loss"] > 0 for r in rs)  # routing counted, aux loss on
    replays = spy_routing(monkeypatch.setattr)
    records.clear()
    rs = train(argv("r3", "--micro-batch-size", "3", "--use-rollout-routing-replay"))  # R3: the scoring pass's routes
    assert_exact_rows(rs)
    assert assert_every_token_exact(records) >= 3 * 16
    assert any(replays) and all(r["moe/routed_experts_bytes"] > 0 for r in rs)
    assert main(argv("r2", "--use-routing-replay")) == 2
    assert "--true-on-policy with --use-routing-replay" in capsys.readouterr().err


def test_the_custom_ops_are_the_layers_they_replace():
    """polyrl::fixed_rows_linear and polyrl::rms_rows (what a prepared model's Linear layers and RMSNorms call in the
    mode, compiled or not): values and gradients are F.linear's and HF's Qwen2RMSNorm's, over more rows than one block
    and a ragged last block. FP32: the linear op runs the same GEMMs on row blocks and its backward is the same two
    products, so 1e-6; the norm's backward is its closed form against autograd's chain of ops, and its forward reduces
    the same 64 terms per row, both within a few FP32 roundings of values of order 1 (1e-5)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from polyrl.backends.true_on_policy import ROWS, _ops
    _ops()
    g = torch.Generator().manual_seed(0)
    n = 2 * ROWS["cpu"] + 7
    x = torch.randn(n, 64, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True)
    dy = torch.randn(n, 48, generator=g)
    got = torch.autograd.grad(torch.ops.polyrl.fixed_rows_linear(x, w, b), (x, w, b), dy)
    want = torch.autograd.grad(torch.nn.functional.linear(x, w, b), (x, w, b), dy)
    for a, e in zip(got, want):
        assert torch.allclose(a, e, atol=1e-6, rtol=1e-6)
    assert torch.allclose(torch.ops.polyrl.fixed_rows_linear(x, w, None), x @ w.t(), atol=1e-6, rtol=1e-6)

    norm = Qwen2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g) * 0.5 + 1)
    xs = (torch.randn(n, 64, generator=g) * 3).requires_grad_(True)
    dn = torch.randn(n, 64, generator=g)
    y = torch.ops.polyrl.rms_rows(xs, norm.weight, norm.variance_epsilon)
    assert torch.allclose(y, norm(xs), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(y, (xs, norm.weight), dn)
    want = torch.autograd.grad(norm(xs), (xs, norm.weight), dn)
    for a, e in zip(got, want):
        assert torch.allclose(a, e, atol=1e-5, rtol=1e-5), (a - e).abs().max()


def test_gradients_flow_through_the_scoring_function(tiny_model):
    """The trainer differentiates the very function the engine runs without grad; the forward values agree, and the
    gradient of every parameter is the plain HF model's (the fixed-block Linear / norm / head have their own backward:
    whole GEMMs, the norm re-run over all rows, the chunked head)."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import ROWS, prepare, sequences_logprobs
    lm = prepare(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    logp, ent = sequences_logprobs(lm, [(ids, 3)], temperature=1.0, with_entropy=True)
    logp.sum().backward()
    assert logp.shape == ent.shape == (4,) and lm.get_output_embeddings().weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(sequences_logprobs(lm, [(ids, 3)], temperature=1.0)[0], logp.detach())

    # several sequences spanning more than one block, temperature 0.7, a loss that weighs tokens unequally
    lm.zero_grad()
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(1, 14, (n,), generator=g), p) for n, p in ((50, 10), (31, 4), (12, 11))]
    assert sum(len(x) for x, _ in seqs) > ROWS["cpu"]
    logp, ent = sequences_logprobs(lm, seqs, temperature=0.7, with_entropy=True)
    w = torch.rand(logp.shape, generator=g)
    ((logp * w).sum() + 0.1 * ent.sum()).backward()
    parts = []
    for x, p in seqs:  # the plain model, one sequence at a time, full logits under autograd
        z = ref(input_ids=x[None]).logits[0, p - 1:-1].float() / 0.7
        lp_all = torch.log_softmax(z, -1)
        parts.append((lp_all.gather(1, x[p:, None]).squeeze(1), -(lp_all.exp() * lp_all).sum(-1)))
    want_lp, want_ent = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
    ((want_lp * w).sum() + 0.1 * want_ent.sum()).backward()
    # FP32: the two forwards differ by reassociation only (~1e-7 relative per op over a 2-layer model), so values
    # agree to 1e-5 and each gradient entry (a sum over ~80 tokens of O(1) terms) to 1e-4 absolute
    assert torch.allclose(logp.detach(), want_lp.detach(), atol=1e-5)
    assert torch.allclose(ent.detach(), want_ent.detach(), atol=1e-5)
    got = dict(lm.named_parameters())
    for name, p in ref.named_parameters():
        assert got[name].grad is not None, name
        assert torch.allclose(got[name].grad, p.grad, atol=1e-4, rtol=1e-4), (name, (got[name].grad - p.grad).abs().max())


# ---- start-up refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, words", [
    (["--train-backend", "megatron", "--recompute-granularity", "selective"],
     "--true-on-policy with --train-backend megatron: --recompute-granularity selective"),
    (["--train-backend", "megatron", "--use-megatron-fsdp"], "--true-on-policy with --train-backend megatron: --use-megatron-fsdp"),
    (["--rollout-engine", "sglang"], "--true-on-policy with --rollout-engine sglang"),
    (["--rollout-external", "--rollout-external-engine-addrs", "http://127.0.0.1:1"], "--true-on-policy with --rollout-external"),
    (["--rollout-top-p", "0.9"], "--true-on-policy with --rollout-top-p 0.9"),
    (["--rollout-top-k", "5"], "--true-on-policy with --rollout-top-k 5"),
    (["--compile"], "--true-on-policy with --compile"),
    (["--micro-batch-layout", "packed"], "--true-on-policy with --micro-batch-layout packed"),
    (["--micro-batch-layout", "padded"], "--true-on-policy with --micro-batch-layout padded"),
    (["--bf16"], "--true-on-policy with --bf16"),
    (["--async"], "--true-on-policy with --async"),
    (["--lora-rank", "4"], "--true-on-policy with --lora-rank"),
    (["--rollout-max-context-len", "32"], "--true-on-policy with --rollout-max-context-len"),
])
def test_settings_that_cannot_stay_exact_are_refused_at_start_up(args, monkeypatch, capsys, extra, words):
    from polyrl.cli import main
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("refused before set-up"))
    assert main(args("refused", *extra)) == 2
    assert words in capsys.readouterr().err


# ---- through polyrl serve, and on two ranks ---------------------------------------------------------------------
@pytest.mark.slow
def test_exact_through_a_launched_polyrl_serve_that_batches(args, monkeypatch):
    """--rollout-engine server: the server runs the mode too (--true-on-policy on its command line), batches the
    step's concurrent requests into fewer engine calls, and its log-probs reach the trainer exactly (JSON floats
    round-trip)."""
    from polyrl.rollout.http_engine import HTTPEngine
    records = install_spy(monkeypatch.setattr)
    seen: list[dict] = []
    close = HTTPEngine.close

    def read_stats_then_close(self):
        for s in self.servers:
            if s.alive and not seen:  # through the engine's client, which holds the launched server's key
                seen.append(self.http.call(s.url, "/get_server_info", method="GET", timeout=30)["internal_states"][0])
        close(self)
    monkeypatch.setattr(HTTPEngine, "close", read_stats_then_close)
    rs = train(args("served", "--rollout-engine", "server", "--micro-batch-size", "3"))
    assert_exact_rows(rs)
    assert assert_every_token_exact(records) >= 3 * 16
    (st,) = seen
    assert st["prompts"] == 3 * 4 and st["engine_calls"] < st["prompts"]  # concurrent requests shared engine calls


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--micro-batch-size", "1"], ["--micro-batch-size", "3"], ["--micro-batch-size", "8"],
                                   ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "50"]],
                         ids=["mbs1", "mbs3", "mbs8", "uneven"])
def test_exact_on_two_ranks(args, tmp_path, extra):
    """Two ranks (gloo, FSDP2 sharded): each rank's engine scores its samples, the sharded trainer its own. With
    token-budget micro-batches the ranks hold different sample counts per micro-batch: the fuller rank's count of
    per-sample forwards is matched by padding forwards on the other."""
    argv = args("two_ranks", *extra)
    if "--use-dynamic-batch-size" in extra:  # rank 0 gets a 40-token prompt's group beside a short one, rank 1 two
        data = tmp_path / "uneven.jsonl"  # short ones: 50-token bins split them 1,1,1,1,4 and 2,2,2,1,1
        data.write_text("".join(json.dumps({"prompt": p, "label": "0"}) + "\n"
                                for p in ["1+" * 19 + "1=", "12+3=", "4+56=", "7+8="] * 3))
        argv.remove("--rollout-shuffle")
        argv += ["--prompt-data", str(data)]
    out = tmp_path / "records"
    from ranks import run_ranks
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = run_ranks([__file__, str(out), *argv], 2, env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_exact_rows(rows(argv[argv.index("--run-dir") + 1]))
    per_rank = [torch.load(out / f"rank{k}.pt") for k in (0, 1)]
    records = per_rank[0] + per_rank[1]
    assert {r["call"] for r in records} == {1, 2, 3}
    counts = [[r["samples"] for r in rank] for rank in per_rank]  # samples per micro-batch, in order
    assert len(counts[0]) == len(counts[1]) and (counts[0] != counts[1]) == ("--use-dynamic-batch-size" in extra)
    assert 3 * 16 <= assert_every_token_exact(records) <= 3 * 16 * 6


if __name__ == "__main__":  # the two-rank worker: OUT_DIR, then `polyrl train`'s argv
    out_dir, argv = sys.argv[1], sys.argv[2:]
    recs = install_spy(setattr)
    from polyrl.cli import main as polyrl_main
    code = polyrl_main(argv)
    os.makedirs(out_dir, exist_ok=True)
    torch.save(recs, os.path.join(out_dir, f"rank{os.environ.get('RANK', '0')}.pt"))
    sys.exit(code)


def test_graphed_packs_lay_out_the_same_inputs_as_the_token_loop():
    """graph_inputs (the GPU scorer's pack inputs, built with array operations) against the plain loop over every
    token it replaced, on packs of one to many sequences, short and long, prompts of one token and responses of one:
    every key and input equal (integers: exact)."""
    import random

    from polyrl.backends import true_on_policy as top

    def by_loop(seqs, prompts):
        lens = [len(x) for x in seqs]
        total = sum(lens)
        T = -(-total // top.GRAPH_ROWS) * top.GRAPH_ROWS
        bound = max(top.MIN_BOUND, 1 << (max(lens) - 1).bit_length())
        pad = T - total
        seg = lens + [bound] * (pad // bound) + ([pad % bound] if pad % bound else [])
        slots = max(T // top.SLOT_TOKENS, 1 << (len(seg) - 1).bit_length())
        starts = [0]
        for n in seg:
            starts.append(starts[-1] + n)
        want = [r for st, n, p in zip(starts, lens, prompts) for r in range(st + p - 1, st + n - 1)]
        host = ([t for x in seqs for t in x] + [0] * (T - total), [i for n in seg for i in range(n)],
                starts + [T] * (slots + 1 - len(starts)), want + [0] * (T - len(want)),
                [t for x, p in zip(seqs, prompts) for t in x[p:]] + [0] * (T - len(want)))
        return (T, slots, bound), host

    rng = random.Random(0)
    cases = [([[5, 6]], [1]), ([list(range(1, 4097))], [4000])]
    for n in (1, 3, 40, 300):
        seqs = [[rng.randrange(1, 1000) for _ in range(rng.randint(2, 600))] for _ in range(n)]
        cases.append((seqs, [rng.randint(1, len(x) - 1) for x in seqs]))
    for seqs, prompts in cases:
        key, got = top.graph_inputs(seqs, prompts)
        want_key, want = by_loop(seqs, prompts)
        assert key == (want_key[0], None, *want_key[1:])
        for g, w, dtype in zip(got, want, (torch.long, torch.long, torch.int32, torch.long, torch.long)):
            assert g.dtype == dtype and g.tolist() == w


def test_a_shared_prompts_rows_are_laid_out_as_the_token_loop_does():
    """pack_layout / graph_inputs with shared prompts (a GRPO group's prompt rows once: the other sequences bring only
    their responses) against the plain loop over every token: each pack row's token and position, the scored rows
    (a sharing sequence's first response token is predicted by the shared prompt's last row) and targets, the
    gather of every sequence whole from the pack rows and (pack_layout) the scatter back (integers: exact)."""
    import random

    from polyrl.backends import true_on_policy as top

    rng = random.Random(0)
    for _ in range(40):
        prompts_tok = [[rng.randrange(1, 1000) for _ in range(rng.randint(1, 300))] for _ in range(rng.randint(1, 4))]
        seqs, prompts = [], []
        for _ in range(rng.randint(1, 12)):
            pt = rng.choice(prompts_tok)
            seqs.append(pt + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 400))])
            prompts.append(len(pt))
        shares = top.prompt_shares([x[:p] for x, p in zip(seqs, prompts)])
        (T, G, slots, bound), got = top.graph_inputs(seqs, prompts, shares)
        # the loop: a sequence that shares keeps its response rows only; its prompt is the first sequence's rows
        row_of, ids, pos = {}, [], []
        for i, (x, p) in enumerate(zip(seqs, prompts)):
            for t in range(len(x)):
                if shares[i] is not None and t < p:
                    row_of[i, t] = row_of[shares[i], t]
                else:
                    row_of[i, t] = len(ids)
                    ids.append(x[t])
                    pos.append(t)
        real = len(ids)
        assert T == -(-real // top.GRAPH_ROWS) * top.GRAPH_ROWS
        dummy = top.dummies(T - real, bound)
        for n in dummy:
            pos += list(range(n))
        rows = [row_of[i, t] for i, (x, p) in enumerate(zip(seqs, prompts)) for t in range(p - 1, len(x) - 1)]
        targets = [t for x, p in zip(seqs, prompts) for t in x[p:]]
        assert got[0].tolist() == ids + [0] * (T - real) and got[1].tolist() == pos
        assert got[3].tolist() == rows + [0] * (T - len(rows)) and got[4].tolist() == targets + [0] * (T - len(rows))
        if all(j is None for j in shares):  # the gathered layout is kept, as the identity; shares None drops it
            (key, plain) = top.graph_inputs(seqs, prompts, None)
            assert key == (T, None, slots, bound) and len(plain) == 5
            assert all(a.tolist() == b.tolist() for a, b in zip(plain, got))
            assert G == T and got[5].tolist() == list(range(T))
        whole = [row_of[i, t] for i, x in enumerate(seqs) for t in range(len(x))] + list(range(real, T))
        assert G == -(-len(whole) // top.GRAPH_ROWS) * top.GRAPH_ROWS
        gather, scatter = got[5].tolist(), top.pack_layout([len(x) for x in seqs], prompts, shares, dummy)[4].tolist()
        assert gather[:len(whole)] == whole
        assert [gather[j] for j in scatter] == list(range(T))  # each row's output comes back from its own position
        lens = [len(x) for x in seqs] + dummy
        bounds = [sum(lens[:k]) for k in range(len(lens) + 1)]
        cu = got[2].tolist()
        assert cu[:len(bounds)] == bounds and cu[-1] == G  # then the spare positions, as dummies of at most `bound`
        assert all(0 <= b - a <= bound for a, b in zip(cu[len(bounds) - 1:], cu[len(bounds):]))
        assert sorted(scatter[:real]) == sorted(bounds[i] + t for i, x in enumerate(seqs) for t in range(len(x))
                                               if shares[i] is None or t >= prompts[i])
        own = [len(x) - (p if j is not None else 0) for x, p, j in zip(seqs, prompts, shares)] + dummy
        cu_q = got[6].tolist()  # the queries: each sequence's own rows, one segment each (the spare ones empty)
        assert cu_q[:len(own) + 1] == [sum(own[:k]) for k in range(len(own) + 1)] and set(cu_q[len(own):]) == {T}


def test_a_shared_prompt_scored_once_gives_each_sequence_its_own_bits_on_cpu(tiny_model):
    """The engine's pack with a GRPO group's prompt rows computed once (sequences_logprobs(shares=...)) on the CPU:
    every token's log-prob is its bits alone when the group's sequences have one length. Across lengths CPU SDPA
    tiles a sequence's keys by its length, so a prompt row computed in a longer sequence can move by FP32 rounding
    (which is why the engine shares prompt rows only where attention is the varlen kernel, on CUDA, checked bit for
    bit in tests/backends/test_true_on_policy_gpu.py); a wrong row, position or target would move a log-prob by
    far more than the 1e-5 allowed there (rounding of a 2-layer FP32 model: ~1e-7)."""
    from transformers import AutoModelForCausalLM
    from polyrl.backends.true_on_policy import prepare, prompt_shares, sequences_logprobs
    torch.set_num_threads(1)
    lm = prepare(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
    g = torch.Generator().manual_seed(0)
    for lengths, tol in (((9, 9, 9, 9), 0.0), ((5, 9, 4, 70, 1), 1e-5)):
        seqs = []
        for plen in (7, 1):
            prompt = torch.randint(1, 14, (plen,), generator=g)
            seqs += [(torch.cat([prompt, torch.randint(1, 14, (n,), generator=g)]), plen) for n in lengths]
        shares = prompt_shares([x[:p].tolist() for x, p in seqs])
        assert sum(j is not None for j in shares) == 2 * (len(lengths) - 1)
        with torch.no_grad():
            alone = torch.cat([sequences_logprobs(lm, [q], temperature=0.8)[0] for q in seqs])
            got = sequences_logprobs(lm, seqs, temperature=0.8, shares=shares)[0]
            # a pack where no sequence shares keeps the gathered layout, as the identity: the plain pack's bits
            one = [seqs[0], seqs[len(lengths)]]
            same = sequences_logprobs(lm, one, temperature=0.8, shares=prompt_shares([x[:p].tolist() for x, p in one]))
            plain = sequences_logprobs(lm, one, temperature=0.8)
        assert got.shape == alone.shape and float((got - alone).abs().max()) <= tol
        assert torch.equal(same[0], plain[0])


def test_the_engines_packs_count_a_shared_prompt_once(tiny_model, monkeypatch):
    """score_samples with shared prompts (forced on the CPU, groups of one length, where CPU attention keeps the bits:
    see above): a pack holds PACK_TOKENS rows, a prompt already in it costing none, so a group's later samples fill
    it with their responses only; a group cut by a pack's end brings its prompt again into the next. Every sample's
    log-probs are the bits of the unshared packs."""
    from transformers import AutoModelForCausalLM
    import polyrl.backends.true_on_policy as top
    torch.set_num_threads(1)
    lm = top.prepare(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
    g = torch.Generator().manual_seed(0)
    samples = []
    for plen in (7, 3, 12):
        prompt = torch.randint(1, 14, (plen,), generator=g).tolist()
        samples += [types.SimpleNamespace(prompt_ids=prompt,
                                          response_ids=torch.randint(1, 14, (9,), generator=g).tolist())
                    for _ in range(5)]
    monkeypatch.setattr(top, "PACK_TOKENS", 60)
    packs = []
    real = top.sequences_logprobs
    monkeypatch.setattr(top, "sequences_logprobs", lambda lm, seqs, **kw: packs.append((len(seqs), kw.get("shares")))
                        or real(lm, seqs, **kw))
    with torch.no_grad():
        want = top.score_samples(lm, samples, 0.8, "cpu")
        assert [n for n, _ in packs] == [3, 4, 4, 2, 2]  # samples of 16, 12, 21 tokens whole, up to 60 a pack
        packs.clear()
        monkeypatch.setattr(top, "shares_prompts", lambda lm, device: True)
        got = top.score_samples(lm, samples, 0.8, "cpu")
    # a prompt once: 7 + 5 x 9 = 52 rows (the next prompt's 12 would pass 60), 3 + 5 x 9 = 48, 12 + 5 x 9 = 57
    assert packs == [(5, [None, 0, 0, 0, 0]), (5, [None, 0, 0, 0, 0]), (5, [None, 0, 0, 0, 0])]
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == len(samples)


def test_the_pack_built_on_the_host_is_the_one_built_sequence_by_sequence(monkeypatch):
    """sequences_logprobs builds its pack's ids, positions, bounds, scored rows and targets with a few vector ops on the
    host (one copy to the GPU, no sync): they equal the per-sequence construction, padding sequence included."""
    import random

    import polyrl.backends.true_on_policy as top
    seen = []
    monkeypatch.setattr(top, "_packed_logprobs", lambda lm, *a: seen.append(a[:6]) or (torch.zeros(a[5].numel()), None))
    rng = random.Random(0)
    for _ in range(100):
        seqs = []
        for _ in range(rng.randint(1, 9)):
            n = rng.randint(2, 200)
            seqs.append((torch.randint(0, 1000, (n,)), rng.randint(1, n)))
        seen.clear()
        top.sequences_logprobs(None, seqs, temperature=1.0)
        lens = [int(x.numel()) for x, _ in seqs]
        pad = top.packed_tokens(lens, torch.device("cpu")) - sum(lens)
        seg = lens + ([pad] if pad else [])
        starts = [sum(seg[:i]) for i in range(len(seg))]
        want = (torch.cat([x for x, _ in seqs] + [torch.zeros(pad, dtype=torch.long)]),
                torch.cat([torch.arange(n) for n in seg]), torch.tensor([0] + seg).cumsum(0).to(torch.int32), max(seg),
                torch.cat([torch.arange(s + p - 1, s + n - 1) for s, n, (_, p) in zip(starts, lens, seqs)]),
                torch.cat([x[p:] for x, p in seqs]))
        for got, exp in zip(seen[0], want):
            assert got == exp if isinstance(exp, int) else (got.dtype == exp.dtype and torch.equal(got, exp))


def test_batched_blocks_use_only_counts_whose_blocks_equal_one_block_alone():
    """The CUDA path of the fixed-block linear (BlockBatches: several blocks per batched GEMM) run on CPU tensors: each
    count of blocks per launch is checked once against one block per launch and used only if bit-identical; a count
    whose launch gives other bits (a stand-in for a kernel cuBLAS would pick for that count) is never used, the pack
    is cut into checked counts, and the result is still the one-block-per-launch arithmetic bit for bit."""
    from polyrl.backends.true_on_policy import BlockBatches

    class Skewed(BlockBatches):  # a launch of 3 blocks reduces in another order: its bits differ
        def _launch(self, x, weight, bias, out, rows):
            super()._launch(x, weight, bias, out, rows)
            if x.shape[0] == 3 * rows:
                out.add_(1e-3)

    g = torch.Generator().manual_seed(0)
    rows = 4
    x = torch.randn(7 * rows, 16, generator=g)
    w, b = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    want = torch.empty(7 * rows, 8)
    for xb, ob in zip(x.split(rows), want.split(rows)):
        BlockBatches()._launch(xb, w, b, ob, rows)
    bb = Skewed(cap=3)
    got = torch.empty_like(want)
    bb.run(x, w, b, got, rows)
    assert torch.equal(got, want)
    key = next(iter(bb.bad))
    assert bb.bad[key] == {3} and 3 not in bb.good[key] and bb.good[key] <= {1, 2}
    checks = bb.checks
    bb.run(x, w, b, got, rows)  # counts are checked once per weight shape
    assert bb.checks == checks and torch.equal(got, want)
    # a count whose check would need more memory than allowed is not used: one block per launch
    small = BlockBatches(cap=8, check_bytes=rows * 16 * 4)
    small.run(x, w, None, got, rows)
    assert small.checks == 0 and not small.good
    ref = torch.empty_like(want)
    for xb, ob in zip(x.split(rows), ref.split(rows)):
        BlockBatches()._launch(xb, w, None, ob, rows)
    assert torch.equal(got, ref)


def test_report_replaces_each_samples_logprobs_and_returns_the_samplers_largest_distance():
    """report (the engines' side of the sampler distance): every sample gets its own scored values, the distance is
    the largest over all tokens of all samples, and a sample whose sampler log-probs do not match its scored tokens
    is named, not misaligned with its neighbours."""
    from polyrl.backends.true_on_policy import report
    a = types.SimpleNamespace(rollout_logprobs=[-1.0, -2.0])
    b = types.SimpleNamespace(rollout_logprobs=[-0.5])
    worst = report([a, b], [torch.tensor([-1.0, -2.25]), torch.tensor([-0.125])])
    assert worst == 0.375 and a.rollout_logprobs == [-1.0, -2.25] and b.rollout_logprobs == [-0.125]
    assert report([], []) == 0.0
    c, d = types.SimpleNamespace(rollout_logprobs=[-1.0, -1.0]), types.SimpleNamespace(rollout_logprobs=[-1.0])
    with pytest.raises(ValueError, match="sample 0's sampler reported 2 log-probs for 1"):
        report([c, d], [torch.tensor([-1.0]), torch.tensor([-1.0, -1.0])])
    assert c.rollout_logprobs == [-1.0, -1.0]  # nothing replaced
    # an agent's sample: a template token (loss mask 0, logged 0.0) is replaced too, but is no distance of the sampler's
    e = types.SimpleNamespace(rollout_logprobs=[-1.0, 0.0, -3.0], loss_mask=[1, 0, 1])
    assert report([e], [torch.tensor([-1.0, -7.0, -3.5])]) == 0.5 and e.rollout_logprobs == [-1.0, -7.0, -3.5]
