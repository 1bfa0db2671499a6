"""--enable-mtp-training on the FSDP backend (MiMo's MTP layers): the MTP loss equals one computed by hand from the
same weights on the same batch (every op written out: norms, projection, attention with RoPE, MLP, output layer),
--mtp-detach-encoder keeps the policy untouched by it, a GRPO step through the CLI trains the MTP layers and exports
them under their names, and the settings that cannot hold are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch



@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    from conftest import tiny_mimo
    path = str(tmp_path_factory.mktemp("mimo_mtp"))
    model = tiny_mimo(path).float()
    with torch.no_grad():  # norms are ones at init: random, so a swapped or missing norm changes the loss
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def _backend(path, mbs=None, detach=True, lr=1e-2, layout="auto"):
    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    from polyrl.dist import init_distributed

    init_distributed("cpu")
    return FSDPBackend(ModelConfig(hf_checkpoint=path, enable_mtp_training=True, mtp_detach_encoder=detach,
                                   mtp_loss_scaling_factor=0.5),
                       OptimizerConfig(lr=lr, weight_decay=0.0), BatchConfig(micro_batch_size=mbs, micro_batch_layout=layout),
                       device="cpu")


def _batch(vocab: int):
    from polyrl.types import TrainBatch

    g = torch.Generator().manual_seed(1)
    lens, plens = [9, 6, 11], [3, 4, 2]
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lens]
    masks = [torch.ones(n - p) for n, p in zip(lens, plens)]
    masks[2][3:5] = 0  # a tool-output span: neither loss counts it
    return TrainBatch(input_ids=ids, prompt_lens=plens, token_fields={"loss_mask": masks})


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [heads, L, d], HF's rotate-half layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _mtp_layer_by_hand(sd, pre, cfg, h, emb):
    """One MiMo MTP layer on one sequence, [L, H] -> [L, H], from its weights alone."""
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    L = h.shape[0]
    x = torch.cat([_rms(h, sd[pre + "hidden_layernorm.weight"], eps), _rms(emb, sd[pre + "token_layernorm.weight"], eps)],
                  -1) @ sd[pre + "input_proj.weight"].T
    a = _rms(x, sd[pre + "input_layernorm.weight"], eps)
    q = (a @ sd[pre + "self_attn.q_proj.weight"].T + sd[pre + "self_attn.q_proj.bias"]).view(L, nh, hd).transpose(0, 1)
    k = (a @ sd[pre + "self_attn.k_proj.weight"].T + sd[pre + "self_attn.k_proj.bias"]).view(L, nkv, hd).transpose(0, 1)
    v = (a @ sd[pre + "self_attn.v_proj.weight"].T + sd[pre + "self_attn.v_proj.bias"]).view(L, nkv, hd).transpose(0, 1)
    pos = torch.arange(L)
    theta = cfg.rope_parameters["rope_theta"]
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
    scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, nh * hd) @ sd[pre + "self_attn.o_proj.weight"].T
    x = x + att
    m = _rms(x, sd[pre + "post_attention_layernorm.weight"], eps)
    x = x + (torch.nn.functional.silu(m @ sd[pre + "mlp.gate_proj.weight"].T) * (m @ sd[pre + "mlp.up_proj.weight"].T)) \
        @ sd[pre + "mlp.down_proj.weight"].T
    return _rms(x, sd[pre + "final_layernorm.weight"], eps)


def _mtp_loss_by_hand(path, batch) -> list[float]:
    """Per depth: the mean over every counted token of every sample of -log p(token t + d + 2)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sd, cfg = model.state_dict(), model.config
    D = cfg.num_nextn_predict_layers
    nll, count = [0.0] * D, [0.0] * D
    with torch.no_grad():
        for ids, p, mask in zip(batch.input_ids, batch.prompt_lens, batch.token_fields["loss_mask"]):
            L = ids.numel()
            h = model.model(input_ids=ids[None]).last_hidden_state[0]
            for d in range(D):
                nxt = torch.cat([ids[d + 1:], ids[:d + 1]])  # token t + d + 1 at t (the tail is never read)
                h = _mtp_layer_by_hand(sd, f"model.mtp_layers.{d}.", cfg, h, sd["model.embed_tokens.weight"][nxt])
                logp = torch.log_softmax(h @ sd["lm_head.weight"].T, -1)
                for t in range(p - 1, L - d - 2):  # predicts response token t + d + 2 (response index t + d + 2 - p)
                    if mask[t + d + 2 - p] > 0:
                        nll[d] -= float(logp[t, ids[t + d + 2]])
                        count[d] += 1
    return [n / c for n, c in zip(nll, count)]


def _zero_policy_loss(logp, ent, fields, *, num_tokens, num_seqs):
    return logp.sum() * 0.0, {}


@pytest.mark.parametrize("mbs, layout", [(None, "padded"), (1, "padded"), (None, "packed")])
def test_mtp_loss_equals_a_hand_computation(mimo_dir, mbs, layout):
    """One micro-batch or one per sample, padded rows or one packed row (block-diagonal mask): the reported MTP loss (the mean over depths of each depth's token mean) is
    the hand computation's. FP32 with different op orders (fused vs written-out attention, chunked log-softmax): the
    per-token log-probs agree to ~1e-6, so 1e-5 on a mean of O(1) values."""
    be = _backend(mimo_dir, mbs=mbs, layout=layout)
    batch = _batch(be.hf_config.vocab_size)
    want = _mtp_loss_by_hand(mimo_dir, batch)
    out = be.train_step(batch, _zero_policy_loss)
    assert out["mtp_loss"] == pytest.approx(sum(want) / len(want), rel=1e-5, abs=1e-5)
    assert out["loss"] == 0.0  # reported apart from the policy loss


@pytest.mark.parametrize("detach", [True, False])
def test_detach_encoder_keeps_the_policy_out_of_the_mtp_loss(mimo_dir, detach):
    """With a zero policy loss, one step moves the MTP layers, and moves the main model only without
    --mtp-detach-encoder (AdamW without weight decay: a zero gradient leaves a weight bit for bit)."""
    be = _backend(mimo_dir, detach=detach)
    before = {n: t.clone() for n, t in be.export_weights()}
    be.train_step(_batch(be.hf_config.vocab_size), _zero_policy_loss)
    after = dict(be.export_weights())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    mtp = {n for n in before if ".mtp_layers." in n}
    assert mtp <= moved
    main = moved - mtp
    if detach:
        assert not main, sorted(main)
    else:  # the hidden states, the embeddings and the shared output layer all get the MTP loss's gradient
        assert {"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"} <= main


def test_grpo_step_trains_and_exports_the_mtp_layers(mimo_dir, arith_data, tmp_path):
    from safetensors.torch import load_file

    from polyrl.cli import main

    rm = tmp_path / "rm.py"  # random weights answer nothing right: a reward that differs within a group instead
    rm.write_text("def r(sample):\n    return float(sum(sample.rollout_logprobs))\n")
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--hf-checkpoint", mimo_dir, "--prompt-data", arith_data["train"], "--custom-rm-path",
                 f"{rm}:r", "--quiet", "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "6", "--enable-mtp-training", "--lr", "1e-2", "--run-dir", str(run),
                 "--save-hf", str(out)]) == 0
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert all(r["mtp_loss"] > 0 and r["grad_norm"] > 0 for r in rows), rows
    before, after = load_file(os.path.join(mimo_dir, "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(after) == set(before)
    mtp = [n for n in before if ".mtp_layers." in n]
    assert mtp and all(not torch.equal(before[n], after[n]) for n in mtp if n.endswith("proj.weight"))


@pytest.mark.parametrize("argv, needle", [
    (["--train-backend", "megatron", "--enable-mtp-training", "--pipeline-model-parallel-size", "2"],
     "--enable-mtp-training with --pipeline-model-parallel-size > 1"),
    (["--mtp-loss-scaling-factor", "0.5"], "add it, or drop them"),
    (["--enable-mtp-training", "--lora-rank", "4"], "--enable-mtp-training with --lora-rank"),
])
def test_mtp_settings_that_cannot_hold_are_refused(mimo_dir, arith_data, argv, needle, capsys):
    from polyrl.cli import main

    assert main(["train", "--hf-checkpoint", mimo_dir, "--prompt-data", arith_data["train"], "--rm-type",
                 "arithmetic", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_model, arith_data, capsys):
    from polyrl.cli import main

    assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rm-type",
                 "arithmetic", "--enable-mtp-training"]) == 2
    assert "has no multi-token-prediction layers" in capsys.readouterr().err


def test_mtp_layers_of_a_family_polyrl_does_not_build_are_named(tiny_model, tmp_path, arith_data, capsys):
    """Qwen3.5 checkpoints carry MTP layers that transformers drops on load: the refusal says so instead of calling
    the checkpoint MTP-free (the refusal comes at start-up, before any weight is loaded)."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from polyrl.cli import main
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.save_pretrained(tmp_path / "q35")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        vocab_size=len(tok), mtp_num_hidden_layers=1)).save_pretrained(tmp_path / "q35")
    assert main(["train", "--hf-checkpoint", str(tmp_path / "q35"), "--prompt-data", arith_data["train"],
                 "--rm-type", "arithmetic", "--enable-mtp-training"]) == 2
    assert "carries 1 multi-token-prediction layer(s), but polyrl builds and trains MTP layers for MiMo" in \
        capsys.readouterr().err
