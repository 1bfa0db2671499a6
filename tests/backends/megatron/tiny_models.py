"""The CPU tests' tiny HF models of the Megatron families, built by harness.py's builders (the GPU harness's own
models), loaded once per module in FP32."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def harness():
    """harness.py as a module (it is a script the GPU tests launch under torchrun, not a package member)."""
    spec = importlib.util.spec_from_file_location("megatron_harness", Path(__file__).with_name("harness.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_hf(tmp_path_factory, builder: str, attn: str, **kw):
    """(model dir, its config, the HF model in FP32 eval mode) of harness.<builder>."""
    from transformers import AutoConfig, AutoModelForCausalLM
    d = getattr(harness(), builder)(str(tmp_path_factory.mktemp(builder)), **kw)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation=attn).eval()
    return d, AutoConfig.from_pretrained(d), model


def grpo_smoke(tmp_path, builder: str, backend: str = "megatron") -> tuple[list[dict], dict, dict]:
    """`polyrl train --train-backend BACKEND --fp32` on harness.<builder>'s tiny model (the arithmetic tokenizer), 2
    GRPO steps with the embedded engine's transformers path and --save-hf. Checks what every family must show: real
    steps (finite loss, non-zero grad norm, none skipped), the trainer's log-probs of the sampled tokens equal to the
    engine's (FP32 both, different batching and kernels: summation order only, ~1e-6; bound 1e-3), and an export with
    every tensor of the checkpoint. Returns (metrics rows, checkpoint tensors, exported tensors) for the caller's
    family-specific checks (which tensors trained)."""
    import math

    from safetensors.torch import load_file

    from polyrl.tasks.arithmetic import build_tokenizer, write_datasets
    from test_megatron_gpu import _polyrl_train
    model = getattr(harness(), builder)(str(tmp_path / "m"), tokenizer=build_tokenizer())
    write_datasets(str(tmp_path / "d"), digits=2, n_train=64, n_eval=16)
    rm = tmp_path / "rm.py"  # random weights answer nothing right: a reward that differs within a group instead
    rm.write_text("def r(sample):\n    return float(sum(sample.rollout_logprobs))\n")
    rows = _polyrl_train(["--train-backend", backend, "--hf-checkpoint", model, "--prompt-data",
                          str(tmp_path / "d" / "train.jsonl"), "--custom-rm-path", f"{rm}:r",
                          "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
                          "--lr", "1e-3", "--fp32", "--num-rollout", "2", "--quiet", "--save-hf", str(tmp_path / "hf")],
                         1, tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and not r["skipped_step"], r
        assert r["train_rollout_logprob_abs_diff_max"] < 1e-3, r
    before = load_file(str(Path(model) / "model.safetensors"))
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(after) == set(before)
    return rows, before, after


def rms(x, w, eps):
    """megatron's (and HF's) RMSNorm, FP32: w * x / sqrt(mean(x^2) + eps)."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def assert_packed_layout_matches_hf(cfg, sd: dict, model, family: str, mlp, lens=(9, 3, 14), seed: int = 2) -> None:
    """The megatron layer layout run by hand from the bridge's state dict `sd` on one packed batch of sequences of
    `lens` (embedding; per layer: input norm, the family's HF-wrapped attention as HFMixer runs it, residual, pre-MLP
    norm, `mlp(h, layer)`, residual; final norm and the vocab-padded output layer) equals the HF model run on each
    sequence alone. FP32, summation order only: 1e-4 absolute on logits of rms ~3 is ~1000 float32 ulps, far above the
    reordering, far below any wiring error (O(0.1) and up)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from polyrl.backends.megatron import hf_wrap
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    cu = torch.tensor([0, *torch.tensor(list(lens)).cumsum(0).tolist()])
    mcfg = SimpleNamespace(context_parallel_size=1, sequence_parallel=False)
    with torch.no_grad():
        x = F.embedding(torch.cat(ids), sd["embedding.word_embeddings.weight"])
        for layer in range(cfg.num_hidden_layers):
            m = f"decoder.layers.{layer}."
            mixer = hf_wrap.HFMixer(mcfg, layer + 1, hf_config=hf_wrap.mixer_config(cfg), factory=hf_wrap.MIXERS[family])
            pre = m + "self_attention."
            mixer.load_state_dict({n[len(pre):]: t for n, t in sd.items() if n.startswith(pre)}, strict=True)
            attn, _ = mixer.eval()(rms(x, sd[m + "input_layernorm.weight"], cfg.rms_norm_eps)[:, None],
                                   packed_seq_params=SimpleNamespace(cu_seqlens_q=cu))
            x = x + attn[:, 0]
            x = x + mlp(rms(x, sd[m + "pre_mlp_layernorm.weight"], cfg.rms_norm_eps), layer)
        logits = F.linear(rms(x, sd["decoder.final_layernorm.weight"], cfg.rms_norm_eps), sd["output_layer.weight"])
        assert logits.shape[-1] == 256 and not logits[:, cfg.vocab_size:].any()  # zero padding rows
        want = torch.cat([model(s[None]).logits[0] for s in ids])
        torch.testing.assert_close(logits[:, :cfg.vocab_size], want, rtol=0, atol=1e-4)


def megatron_sigmoid_routing(logits, kw, expert_bias):
    """megatron-core 0.19's topk_routing_with_score_function(score_function="sigmoid", expert_bias=...) with
    group_limited_topk (groups scored by their top-(topk / group_topk)), renormalised, scaled: (probs, expert ids)."""
    topk, groups, gtop = kw["moe_router_topk"], kw["moe_router_num_groups"], kw["moe_router_group_topk"]
    scores = torch.sigmoid(logits.float())
    choice = scores + expert_bias
    if groups:
        t = choice.shape[0]
        gs = choice.view(t, groups, -1).topk(topk // gtop, dim=-1)[0].sum(-1)
        mask = torch.zeros_like(gs).scatter_(1, torch.topk(gs, k=gtop, dim=-1, sorted=False)[1], 1)
        keep = mask.unsqueeze(-1).expand(t, groups, choice.shape[1] // groups).reshape(t, -1).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    idx = torch.topk(choice, k=topk, dim=-1)[1]
    probs = scores.gather(1, idx)
    probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    return probs * kw["moe_router_topk_scaling_factor"], idx
