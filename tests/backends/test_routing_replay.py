"""MoE routing replay (R2 / R3) and routing metrics on a tiny Qwen3-MoE, CPU, FP32.

Equalities here are exact, not toleranced: replaying a forward's own routes hands every expert the same indices
and gate values (softmax of the same logits, gathered at the same indices, normalised in the same order), so the
arithmetic is the recording forward's, operation for operation.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model_dir
from polyrl.backends.routing_replay import MoERouting

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import fixed_batch  # noqa: E402

E, K, LAYERS = 8, 2, 2  # polyrl.tasks.arithmetic.build_model(arch="qwen3_moe"): 8 experts, top-2


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3_moe"), arch="qwen3_moe", layers=LAYERS)


def _batch(n: int = 6):
    return fixed_batch(n)  # the FSDP equivalence tests' batch: mixed prompt/response lengths, +-1 advantages


def _packed_forward(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """One packed row (restarted positions, block-diagonal causal mask): logits [sum L, V]."""
    lens = [int(s.numel()) for s in seqs]
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = (seg[:, None] == seg[None, :]) & torch.ones(sum(lens), sum(lens), dtype=torch.bool).tril()
    pos = torch.cat([torch.arange(l) for l in lens])
    return model(input_ids=torch.cat(seqs)[None], position_ids=pos[None], attention_mask=mask[None, None]).logits[0]


def test_replay_reproduces_recorded_routes_and_logits(tiny_moe):
    """Bridge level: record a packed forward, replay it (in a different sample order and micro-batch): identical
    routes per sample and identical logits; shapes and dtype are SGLang's routed_experts layout in int16."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, attn_implementation="sdpa").eval()
    r = MoERouting(model)
    seqs = _batch().input_ids
    with torch.no_grad():
        r.begin([len(s) for s in seqs], "packed", "cpu", record=True)
        ref = _packed_forward(model, seqs)
        rec = r.recorded()
        assert [tuple(x.shape) for x in rec] == [(len(s) - 1, LAYERS, K) for s in seqs] and rec[0].dtype == torch.int16
        assert int(rec[0].min()) >= 0 and int(rec[0].max()) < E
        # replay the same forward: same indices, same gates, same logits, bit for bit
        r.begin([len(s) for s in seqs], "packed", "cpu", routes=rec, replay=True, record=True)
        again = _packed_forward(model, seqs)
        assert torch.equal(again, ref)
        assert all(torch.equal(a, b) for a, b in zip(r.recorded(), rec))
        # a different micro-batch (reversed subset, other offsets): each sample still takes its recorded routes
        sub = [4, 1, 0]
        r.begin([len(seqs[i]) for i in sub], "packed", "cpu", routes=[rec[i] for i in sub], replay=True, record=True)
        _packed_forward(model, [seqs[i] for i in sub])
        assert all(torch.equal(a, rec[i]) for a, i in zip(r.recorded(), sub))
    r.end()


def test_replaying_other_routes_changes_output_and_router_still_learns(tiny_moe):
    """Replaying a *different* route changes the logits, and the router weight gets a nonzero gradient through the
    gates recomputed from its logits at the replayed experts."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, attn_implementation="sdpa")
    r = MoERouting(model)
    seqs = _batch().input_ids
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        r.begin(lens, "packed", "cpu", record=True)
        ref = _packed_forward(model, seqs)
        rec = r.recorded()
    other = [(x + 1) % E for x in rec]  # every token, every layer: the next experts over
    r.begin(lens, "packed", "cpu", routes=other, replay=True, record=True)
    out = _packed_forward(model, seqs)
    assert all(torch.equal(a, b) for a, b in zip(r.recorded(), other))
    # O(1e-2) shifts at this init (std 0.02 weights); 1e-4 is far above fp32 rounding (~1e-7 of logits O(1))
    assert (out.detach() - ref).abs().max() > 1e-4
    out.logsumexp(-1).sum().backward()
    for layer in range(LAYERS):
        g = model.model.layers[layer].mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0
    r.end()


def test_wrong_route_shape_names_the_layout(tiny_moe):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    r = MoERouting(model)
    with pytest.raises(ValueError, match="tokens - 1, num_hidden_layers, top-k"):
        r.begin([5], "packed", "cpu", routes=[torch.zeros(5, LAYERS, K, dtype=torch.int16)], replay=True)


def _backend(model_dir: str, **model_kw):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    init_distributed("cpu")
    return FSDPBackend(ModelConfig(hf_checkpoint=model_dir, **model_kw), OptimizerConfig(lr=1e-2),
                       BatchConfig(micro_batch_size=4, micro_batch_layout="packed"), device="cpu")


class _Spy:
    """A forward hook after MoERouting's on every router: sees the indices the experts actually get."""

    def __init__(self, lm):
        self.seen: list[dict[int, torch.Tensor]] = []
        for i, layer in enumerate(lm.model.layers):
            layer.mlp.gate.register_forward_hook(functools.partial(self._hook, i))

    def _hook(self, layer, mod, args, out):
        if torch.is_grad_enabled() and (not self.seen or layer in self.seen[-1]):
            self.seen.append({})
        if torch.is_grad_enabled():
            self.seen[-1][layer] = out[2].detach().clone()


def _routes_of_forward(seen: dict, lens: list[int]) -> list[torch.Tensor]:
    """Per-sample [L - 1, layers, k] routes out of one packed forward's spied indices."""
    full = torch.stack([seen[i] for i in range(LAYERS)], 1)
    return [x[:-1].to(torch.int16) for x in full.split(lens)]


def _perturb_router(be, scale: float = 0.05):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in be.model.lm.model.layers:
            w = layer.mlp.gate.weight
            w.add_(scale * torch.randn(w.shape, generator=g))


def _capture_loss(store: list):
    def loss_fn(logp, ent, fields, *, num_tokens, num_seqs):
        store.append((logp.detach(), fields["old_logprobs"]))
        return logp.sum() / num_tokens, {}
    return loss_fn


def test_fsdp_r2_train_forward_replays_the_logprob_pass(tiny_moe):
    """R2 on the FSDP backend: compute_logprobs records routes into batch.recorded_routed_experts; after the
    router weights move, train_step's forwards (another micro-batch plan) still route every token exactly as
    recorded. Without replay the same perturbation changes routes (the test is sensitive)."""
    from polyrl.config import BatchConfig
    be = _backend(tiny_moe, use_routing_replay=True)
    batch = _batch()
    lens = [len(x) for x in batch.input_ids]
    batch.token_fields["old_logprobs"] = be.compute_logprobs(batch)
    rec = batch.recorded_routed_experts
    assert rec is not None and [tuple(x.shape) for x in rec] == [(l - 1, LAYERS, K) for l in lens]
    _perturb_router(be)
    be.bcfg = BatchConfig(micro_batch_size=3, micro_batch_layout="packed")  # another plan than the recording pass
    spy = _Spy(be.model.lm)
    store: list = []
    m = be.train_step(batch, _capture_loss(store))
    plans = be._micro_batches(batch)
    got = {}
    for idx, seen in zip(plans, spy.seen):
        for i, r in zip(idx, _routes_of_forward(seen, [lens[i] for i in idx])):
            got[i] = r
    assert all(torch.equal(got[i], rec[i]) for i in range(len(batch)))
    assert m["moe/routed_experts_bytes"] == sum(x.numel() * 2 for x in rec)
    assert m["moe/load_max_over_mean"] >= 1.0 and "moe/layer1/load_cv" in m

    # the same perturbation without replay does change some routes
    free = _backend(tiny_moe)
    _perturb_router(free)
    with torch.no_grad():
        r = free.routing
        r.begin(lens, "packed", "cpu", routes=rec)  # compare mode
        _packed_forward(free.model.lm, batch.input_ids)
        r.end()
    assert r.drain_metrics()["moe/topk_mismatch_frac"] > 0


def test_fsdp_r3_replays_rollout_routes_and_mismatch_metric(tiny_moe):
    """R3: rollout routes (here: the unperturbed model's) are replayed in compute_logprobs and train_step; with replay
    off the same routes only feed moe/topk_mismatch_frac, 0 exactly when nothing changed and > 0 after the router
    moved."""
    be = _backend(tiny_moe, use_rollout_routing_replay=True, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    batch = _batch()
    lens = [len(x) for x in batch.input_ids]
    model = be.model.lm
    with torch.no_grad():
        be.routing.begin(lens, "packed", "cpu", record=True, count=False)
        _packed_forward(model, batch.input_ids)
        batch.rollout_routed_experts = be.routing.recorded()
        be.routing.end()
    _perturb_router(be)
    spy = _Spy(model)
    batch.token_fields["old_logprobs"] = be.compute_logprobs(batch)
    m = be.train_step(batch, _capture_loss([]))
    got = {}
    for idx, seen in zip(be._micro_batches(batch), spy.seen):
        for i, r in zip(idx, _routes_of_forward(seen, [lens[i] for i in idx])):
            got[i] = r
    assert all(torch.equal(got[i], batch.rollout_routed_experts[i]) for i in range(len(batch)))
    assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] > 0 and "moe/topk_mismatch_frac" not in m

    off = _backend(tiny_moe)
    assert off.train_step(batch, _capture_loss([]))["moe/topk_mismatch_frac"] == 0.0  # same weights as the rollout
    _perturb_router(off)
    assert off.train_step(batch, _capture_loss([]))["moe/topk_mismatch_frac"] > 0


def _grpo(model: str, data: str, run_dir, *flags: str) -> list[dict]:
    import json
    from polyrl.cli import main
    assert main(["train", "--hf-checkpoint", model, "--prompt-data", data, "--rm-type", "arithmetic", "--quiet",
                 "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--global-batch-size", "2", "--rollout-max-response-len", "4", "--lr", "1e-3",
                 "--run-dir", str(run_dir), *flags]) == 0
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_grpo_cli_with_rollout_routing_replay_and_mismatch_metric(tiny_moe, arith_data, tmp_path):
    """End to end on the tiny MoE (2 steps, 2 minibatches per step, so the old-logprob pass runs too): R3 carries the
    engine's routes into every actor forward; with replay off, --return-routed-experts reports the top-k mismatch."""
    rows = _grpo(tiny_moe, arith_data["train"], tmp_path / "r3", "--use-rollout-routing-replay")
    for r in rows:
        assert r["moe/routed_experts_bytes"] > 0 and r["moe/load_max_over_mean"] >= 1.0 and "moe/layer0/load_cv" in r
        assert "moe/topk_mismatch_frac" not in r  # replayed, not compared
    rows = _grpo(tiny_moe, arith_data["train"], tmp_path / "off", "--return-routed-experts", "--moe-aux-loss-coeff", "0.01")
    assert all(0.0 <= r["moe/topk_mismatch_frac"] <= 1.0 and r["moe/aux_loss"] > 0 for r in rows)
    rows = _grpo(tiny_moe, arith_data["train"], tmp_path / "r2", "--use-routing-replay")
    assert all(r["moe/routed_experts_bytes"] > 0 for r in rows)  # the log-prob pass's recorded routes


@pytest.mark.parametrize("flags, needle", [
    (["--use-routing-replay", "--use-rollout-routing-replay"], "keep one"),
    (["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.1"], "the FSDP backend has aux_loss"),
    (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be >= 0"),
])
def test_bad_moe_flags_are_clear_errors(tiny_moe, arith_data, flags, needle, capsys):
    from polyrl.cli import main
    assert main(["train", "--hf-checkpoint", tiny_moe, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 *flags]) == 2
    assert needle in capsys.readouterr().err


def test_replay_on_a_dense_model_is_a_clear_error(tiny_model, arith_data, capsys):
    from polyrl.cli import main
    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type", "arithmetic",
                 "--use-rollout-routing-replay"]) == 2
    assert "--use-rollout-routing-replay applies to MoE models" in capsys.readouterr().err
