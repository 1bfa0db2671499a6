"""Megatron backend proof harness (GPU). One torchrun launch runs several layouts in turn
(megatron's parallel state is rebuilt per layout) and prints one JSON line per check.

    python tests/backends/megatron/harness.py models OUT_DIR
    python tests/backends/megatron/harness.py families OUT_DIR      (deepseek_v3, glm4_moe, glm4)
    python tests/backends/megatron/harness.py gpt-oss OUT_DIR       (OUT_DIR/gpt_oss)
    python tests/backends/megatron/harness.py fsdp-ref MODEL_DIR OUT.pt            (1 process)
    torchrun --nproc-per-node N tests/backends/megatron/harness.py layouts MODEL_DIR REF.pt \
        --layouts "tp=2;pp=2;cp=2;tp=2,pp=2,vpp=1" [--checks logprobs,export,grad]
    torchrun ... harness.py resume MODEL_DIR --save-layout tp=2,pp=2 --load-layout tp=1,pp=2
    torchrun ... harness.py sft-fsdp MODEL_DIR [--layout ...]
    torchrun ... harness.py hf-wrap OUT_DIR --layouts "tp=1;pp=2;tp=2,sp=1"   (Qwen3-Next, hf_wrap.py)
    torchrun ... harness.py hf-wrap OUT_DIR --sparse --fp32 --layouts "ep=2;tp=2;pp=2;tp=2,ep=2,etp=1"
    torchrun ... harness.py hf-wrap OUT_DIR --family qwen3_5 --fp32 --layouts "tp=1"     (Qwen3.5 text)
Results: `RESULT {json}` lines on stdout (rank 0).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from polyrl.algorithms.losses import LossSettings, rl_loss, sft_loss  # noqa: E402
from polyrl.dist import init_distributed  # noqa: E402
from polyrl.config import BatchConfig, MegatronConfig, ModelConfig, OptimizerConfig  # noqa: E402
from polyrl.types import TrainBatch  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# BF16 on both sides, derived from the rounding: BF16 keeps 8 significant bits, so each rounding of an activation is a
# relative error uniform in +-u, u = 2^-8 (std u/sqrt(3)). Two evaluations that round at different places (TP's bf16
# partial sums, qwen2's separate bias add, MoE dispatch order) differ by independent roundings; on the residual path
# of these models there are R ~ 58 of them (~14 per layer x 4 layers, final norm, head), so the final hidden state
# differs by a relative std u*sqrt(R/3) = 0.017. The heads are scaled to logits of rms 3 (build_models), so a logit
# moves by 0.052 std and a log-prob z_y - logsumexp(z) by at most sqrt(2) x that = 0.073 std: mean |diff| ~ 0.8 x
# 0.073 = 0.058 (the mean of 84 tokens: +-0.005), and the largest of 84 tokens stays under 5.5 std = 0.40 (a 3e-6
# chance per check). Measured worst (bench/RESULTS.md, 1-4 GPUs): dense 0.042 mean / 0.148 max.
LOGP_TOL = dict(mean=0.08, max=0.4)
# MoE models add a discrete effect rounding does not bound: a near-tie in a router rounds the other way and a token
# gets another expert (up to half its MoE output with top-2 renormalised); measured worst 0.059 mean / 0.713 max (TP2,
# EP2xTP2). The rounding mean still holds; the max allows one flipped token. Their FP32 checks below are the gate.
LOGP_TOL_MOE = dict(mean=0.08, max=1.0)
GRAD_TOL = 0.03  # relative grad-norm difference
# FP32 on both sides (`--fp32`): every layout only reorders fp32 sums, so the same models must
# agree to ~1e-6; this is the check that the bf16 shifts above are rounding and not a wiring error.
FP32_LOGP_TOL = dict(mean=1e-4, max=2e-3)
FP32_GRAD_TOL = 1e-3
RESUME_TOL_SAME = 1e-3  # relative loss difference, two steps after a same-layout resume
FP32 = False  # set by --fp32
HANG_DUMP = int(os.environ.get("POLYRL_HANG_DUMP", "0"))  # seconds: dump every rank's stack, exit


def emit(**kw) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("RESULT " + json.dumps(kw), flush=True)


# ---------------------------------------------------------------------------------------------
# tiny models


def build_models(out: str) -> dict[str, str]:
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
    common = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
    made = {}
    for fam in FAMILIES:
        if fam == "llama":
            cfg, cls = LlamaConfig(**common, tie_word_embeddings=False), LlamaForCausalLM
        elif fam == "qwen2":
            cfg, cls = Qwen2Config(**common, tie_word_embeddings=True), Qwen2ForCausalLM
        elif fam == "qwen3":
            cfg, cls = Qwen3Config(**common, head_dim=32, tie_word_embeddings=False), Qwen3ForCausalLM
        else:
            cfg = Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=True, mlp_only_layers=[3], tie_word_embeddings=True)
            cls = Qwen3MoeForCausalLM
        torch.manual_seed(0)
        model = cls(cfg)
        with torch.no_grad():  # peaky, non-trivial distributions; every norm / bias random so misplacement shows
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
                elif "embed_tokens" in name:  # tied: it is also the head, so keep logits O(3) (bf16-resolvable)
                    p.normal_(std=3.0 / math.sqrt(p.shape[-1]) if cfg.tie_word_embeddings else 1.0)
                elif "lm_head" in name:
                    p.normal_(std=3.0 / math.sqrt(p.shape[-1]))
                else:
                    p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
        d = os.path.join(out, fam)
        model.save_pretrained(d)
        made[fam] = d
    return made


BRIDGE_FAMILIES = ("deepseek_v3", "glm4_moe", "glm4")


def build_bridge_families(out: str) -> dict[str, str]:
    """Tiny DeepSeek-V3 (MLA, sigmoid router with e_score_correction_bias, 2 expert groups, shared expert),
    GLM4-MoE (q/k/v bias, qk-norm, partial rotate-half RoPE) and GLM4 dense (sandwich norms, interleaved
    partial RoPE): 4 layers, layer 0 dense in the MoE ones (first_k_dense_replace=1). Default RoPE (no
    yarn: the parity claim covers megatron's plain MLA RoPE). Weights random as in build_models; the
    routers' correction bias N(0, 0.3) so it changes choices."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4Config, Glm4ForCausalLM, Glm4MoeConfig,
                              Glm4MoeForCausalLM)
    common = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    moe = dict(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
               n_shared_experts=1, norm_topk_prob=True)
    made = {}
    for fam in BRIDGE_FAMILIES:
        if fam == "deepseek_v3":
            cfg, cls = DeepseekV3Config(**common, **moe, num_key_value_heads=4, n_group=2, topk_group=1, q_lora_rank=32,
                                        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                        routed_scaling_factor=2.5), DeepseekV3ForCausalLM
        elif fam == "glm4_moe":
            cfg, cls = Glm4MoeConfig(**common, **moe, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                     use_qk_norm=True, n_group=1, topk_group=1, routed_scaling_factor=1.5), Glm4MoeForCausalLM
        else:
            cfg, cls = Glm4Config(**common, num_key_value_heads=2, head_dim=16, attention_bias=True, pad_token_id=0,
                                  eos_token_id=1), Glm4ForCausalLM
        torch.manual_seed(0)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
                elif "lm_head" in name:
                    p.normal_(std=3.0 / math.sqrt(p.shape[-1]))
                elif "embed_tokens" in name:
                    p.normal_(std=1.0)
                else:  # stacked experts [E, out, in] too
                    p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(std=0.3)
        d = os.path.join(out, fam)
        model.save_pretrained(d)
        made[fam] = d
    return made


def _random_deltanet_weights(model):
    """Random weights of a gated-DeltaNet model (Qwen3-Next, Qwen3.5), drawn in parameter order from the global RNG:
    zero-centered norms around 0, the DeltaNet's plain norm around 1, A_log / dt_bias moved off their init."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p))
            elif "lm_head" in name:
                p.normal_(std=3.0 / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.normal_(std=1.0)
            elif "mlp.experts." in name:  # stacked [E, out, in]
                p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(std=1.0 / math.sqrt(p[0].numel()))
    return model


def build_qwen3_next(out: str, sparse: bool = False) -> str:
    """Tiny Qwen3-Next for HF module wrapping (hf_wrap.py): gated DeltaNet and gated full attention
    (partial RoPE) alternate; dense MLPs everywhere (mlp_only_layers = every layer), or with
    `sparse` (OUT/qwen3_next_moe) layer 0 dense and layers 1-3 sparse MoE (4 routed experts, top 2,
    and a sigmoid-gated shared expert). Every weight is random; the zero-centered norms (output
    x_norm * (1 + w)) around 0, the gated DeltaNet norm (plain x_norm * w) around 1."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_only_layers=[0] if sparse else [0, 1, 2, 3], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    model = _random_deltanet_weights(Qwen3NextForCausalLM(cfg))
    d = os.path.join(out, "qwen3_next_moe" if sparse else "qwen3_next")
    model.save_pretrained(d)
    return d


def build_qwen3_5(out: str, tokenizer=None) -> str:
    """Tiny Qwen3.5 text (OUT/qwen3_5, Qwen3_5ForCausalLM, hf_wrap.py): gated DeltaNet with unfused projections
    (in_proj_qkv / _z / _b / _a) and gated full attention alternate, dense MLPs; the released configs' RoPE (partial
    rotary 0.25, interleaved mrope sections, which text positions leave equal to plain RoPE). Weights random as in
    build_qwen3_next. With `tokenizer` (the arithmetic task's) the vocabulary is its size, saved alongside."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    tok = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.eos_token_id) if tokenizer is not None else dict(vocab_size=250)
    cfg = Qwen3_5TextConfig(
        **tok, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
    torch.manual_seed(0)
    model = _random_deltanet_weights(Qwen3_5ForCausalLM(cfg))
    d = os.path.join(out, "qwen3_5")
    model.save_pretrained(d)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    return d


def build_gpt_oss(out: str, tokenizer=None) -> str:
    """Tiny GPT-OSS (OUT/gpt_oss): layer 0 sliding (window 4, shorter than fixed_batch's sequences), layer 1 full,
    YaRN RoPE, learned sinks, 4 biased experts (top 2) behind a biased router, swiglu_limit 1 so both clamps act on
    unit-scale activations. Weights random as in build_models (stacked experts scaled by their fan-in, dim -2: HF
    computes x @ W); sinks and every bias N(0, 0.2^2). With `tokenizer` (the arithmetic task's) the vocabulary is
    its size and it is saved alongside, for GRPO through the CLI."""
    from transformers import GptOssConfig, GptOssForCausalLM
    tok = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.eos_token_id) if tokenizer is not None else dict(vocab_size=250)
    cfg = GptOssConfig(**tok, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                       swiglu_limit=1.0, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1 or name.endswith("_bias"):  # sinks, q/k/v/o and router biases, stacked expert biases
                p.copy_(0.2 * torch.randn_like(p))
            elif "lm_head" in name:
                p.normal_(std=3.0 / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.normal_(std=1.0)
            elif "mlp.experts." in name:  # gate_up_proj [E, H, 2I], down_proj [E, I, H]
                p.normal_(std=1.0 / math.sqrt(p.shape[-2]))
            else:
                p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
    d = os.path.join(out, "gpt_oss")
    model.save_pretrained(d)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    return d


def build_mimo_v2_flash(out: str, tokenizer=None) -> str:
    """Tiny MiMo-V2-Flash (OUT/mimo_v2_flash): 4 layers, full / sliding / sliding / full attention (window 4, shorter
    than fixed_batch's sequences; sliding layers with twice the k / v heads and learned sinks), q / k head_dim 16, v
    heads 8 wide, values scaled by 0.6, partial RoPE (half the channels) with a theta per layer type; layer 0 a dense
    MLP, layers 1-3 sigmoid-routed MoE (8 experts in 2 groups, top-1 group, top-2 experts, scaling 2.5, a random
    correction bias so it changes the choice). Weights random as in build_gpt_oss. With `tokenizer` (the arithmetic
    task's) the vocabulary is its size and it is saved alongside, for GRPO through the CLI."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM
    tok = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               bos_token_id=tokenizer.eos_token_id) if tokenizer is not None else dict(vocab_size=250)
    rope = {kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5}
            for kind, theta in (("full_attention", 100000.0), ("sliding_attention", 500.0))}
    cfg = MiMoV2FlashConfig(**tok, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, v_head_dim=8, attention_value_scale=0.6,
                            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], sliding_window=4,
                            moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                            topk_group=1, routed_scaling_factor=2.5, rope_parameters=rope, max_position_embeddings=128,
                            rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MiMoV2FlashForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:  # sinks
                p.copy_(0.5 * torch.randn_like(p))
            elif "lm_head" in name:
                p.normal_(std=3.0 / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name:
                p.normal_(std=1.0)
            else:  # q/k/v/o, dense MLP, router, stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]): x @ W.T
                p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    d = os.path.join(out, "mimo_v2_flash")
    model.save_pretrained(d)
    if tokenizer is not None:
        tokenizer.save_pretrained(d)
    return d


def fixed_batch(n: int = 8, vocab: int = 250, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, plens, f = [], [], {"loss_mask": [], "advantages": [], "rollout_logprobs": []}
    for i in range(n):
        p, r = 4 + (i * 5) % 9, 3 + (i * 7) % 17
        ids.append(torch.randint(0, vocab, (p + r,), generator=g))
        plens.append(p)
        f["loss_mask"].append((torch.rand(r, generator=g) > 0.1).float())
        f["advantages"].append(torch.full((r,), 1.0 if i % 2 else -0.5))
        f["rollout_logprobs"].append(torch.full((r,), -3.0))
    return TrainBatch(ids, plens, f)


def my_share(batch: TrainBatch) -> TrainBatch:
    ws, rk = dist.get_world_size(), dist.get_rank()
    per = len(batch) // ws
    return batch.select(list(range(rk * per, (rk + 1) * per)))


def gather_all(parts: list) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, parts)
    return [x for p in out for x in p]


RL = functools.partial(rl_loss, s=LossSettings(eps_clip=0.2, loss_agg_mode="token-mean", entropy_coef=0.01))


def _dtype() -> torch.dtype:
    return torch.float32 if FP32 else torch.bfloat16


def parse_layout(text: str) -> MegatronConfig:
    m = MegatronConfig()
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        if k == "p2p":  # schedule p2p mode, applied after construction (make_backend)
            m._p2p = v
            continue
        key = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
               "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
               "vpp": "num_layers_per_virtual_pipeline_stage", "sp": "sequence_parallel", "fsdp": "use_megatron_fsdp",
               "distopt": "use_distributed_optimizer"}[k]
        setattr(m, key, bool(int(v)) if key in ("sequence_parallel", "use_megatron_fsdp", "use_distributed_optimizer")
                else int(v))
    return m


def make_backend(model_dir: str, layout: MegatronConfig, *, micro: int = 3, lr: float = 1e-3, need_ref: bool = False):
    from polyrl.backends.megatron.backend import MegatronBackend
    be = MegatronBackend(ModelConfig(hf_checkpoint=model_dir, fp32=FP32), OptimizerConfig(lr=lr, clip_grad=1.0),
                         BatchConfig(micro_batch_size=micro), device="cuda", total_steps=10, need_ref=need_ref,
                         megatron_cfg=layout)
    mode = getattr(layout, "_p2p", None)
    if mode:  # diagnostics: batch (batched isend/irecv) | overlap (separate, overlapped) | plain
        be.config.batch_p2p_comm, be.config.overlap_p2p_comm = mode == "batch", mode == "overlap"
    return be


# ---------------------------------------------------------------------------------------------
# modes


def mode_fsdp_ref(models: str, outs: str) -> None:
    init_distributed("cuda")
    for model_dir, out in zip(models.split(","), outs.split(",")):
        _fsdp_ref(model_dir, out)


def _fsdp_ref(model_dir: str, out: str) -> None:
    from polyrl.backends.fsdp.backend import FSDPBackend
    be = FSDPBackend(ModelConfig(hf_checkpoint=model_dir, fp32=FP32, compile=False), OptimizerConfig(lr=1e-3, clip_grad=1.0),
                     BatchConfig(micro_batch_size=3), device="cuda", total_steps=10)
    batch = fixed_batch()
    logp = be.compute_logprobs(batch)
    m = be.train_step(batch, RL, with_entropy=True)
    hf = {k: v.detach().to(_dtype()).cpu() for k, v in be.export_weights()}
    torch.save({"logp": logp, "grad_norm": m["grad_norm"], "loss": m["loss"], "metrics": m, "hf": hf}, out)
    emit(check="fsdp_ref", model=model_dir, grad_norm=m["grad_norm"], loss=m["loss"])


def hf_reference_weights(model_dir: str, backend) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.to(_dtype()) for k, v in m.state_dict().items()}


def _is_moe(hf_config) -> bool:
    return any(getattr(hf_config, k, 0) for k in ("num_experts", "n_routed_experts", "num_local_experts"))


def check_layout(model_dir: str, ref: dict, text: str, checks: set[str]) -> None:
    layout = parse_layout(text)
    t0 = time.time()
    if HANG_DUMP:  # a stuck collective: every rank prints where it waits, then exits
        import faulthandler
        faulthandler.dump_traceback_later(HANG_DUMP, exit=True)
    be = make_backend(model_dir, layout)
    fam = os.path.basename(model_dir.rstrip("/"))
    batch = fixed_batch()
    if "logprobs" in checks:
        logp = gather_all(be.compute_logprobs(my_share(batch)))
        d = torch.cat([(a - b).abs() for a, b in zip(logp, ref["logp"])])
        tol = FP32_LOGP_TOL if FP32 else LOGP_TOL_MOE if _is_moe(be.hf_config) else LOGP_TOL
        ok = float(d.mean()) <= tol["mean"] and float(d.max()) <= tol["max"]
        emit(check="logprob_parity", family=fam, layout=text, mean_abs=float(d.mean()), max_abs=float(d.max()),
             tol=tol, ok=ok, tokens=int(d.numel()), fp32=FP32)
    if "export" in checks:
        hf = hf_reference_weights(model_dir, be)
        got, bad, n = set(), [], 0
        for name, t in be.export_weights():
            got.add(name)
            n += 1
            # (a router's expert_bias stays fp32 in a bf16 model, as HF's e_score_correction_bias)
            if name not in hf or not torch.equal(t.cpu().to(hf[name].dtype), hf[name]):
                bad.append(name)
        expected = set(hf) - ({"lm_head.weight"} if be.hf_config.tie_word_embeddings else set())
        missing = sorted(expected - got)
        emit(check="export_roundtrip", family=fam, layout=text, tensors=n, mismatched=bad[:5], missing=missing[:5],
             ok=not bad and not missing)
    if "grad" in checks:
        m = be.train_step(my_share(batch), RL, with_entropy=True)
        rel = abs(m["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        gtol = FP32_GRAD_TOL if FP32 else GRAD_TOL
        emit(check="grad_norm", family=fam, layout=text, grad_norm=m["grad_norm"], fsdp_grad_norm=ref["grad_norm"],
             rel=rel, loss=m["loss"], fsdp_loss=ref["loss"], ok=rel <= gtol, tol=gtol, fp32=FP32,
             metrics={k: m[k] for k in ("pg_loss", "entropy", "lr", "skipped_step") if k in m})
    emit(check="layout_done", family=fam, layout=text, seconds=round(time.time() - t0, 1), compiled=be.compiled)
    if HANG_DUMP:
        import faulthandler
        faulthandler.cancel_dump_traceback_later()
    del be
    torch.cuda.empty_cache()


def mode_layouts(a) -> None:
    init_distributed("cuda")
    checks = set(a.checks.split(","))
    for model_dir, ref_path in zip(a.models.split(","), a.refs.split(",")):
        ref = torch.load(ref_path, weights_only=False)
        for text in a.layouts.split(";"):
            try:
                check_layout(model_dir, ref, text, checks)
            except Exception as e:  # record and go on with the next layout
                traceback.print_exc()  # whole, on stderr: the record's text is cut to fit a RESULT line
                emit(check="error", model=model_dir, layout=text, error=f"{type(e).__name__}: {e}"[:2000],
                     tb=traceback.format_exc()[-3000:])
                if a.stop_on_error:
                    raise


def _train(be, steps: int, loss=RL, with_entropy=True) -> list[float]:
    out = []
    batch = fixed_batch(vocab=min(250, be.hf_config.vocab_size))
    for _ in range(steps):
        m = be.train_step(my_share(batch), loss, with_entropy=with_entropy)
        out.append(m["loss"])
    return out


def _weight_diff(before: dict, after: dict) -> dict:
    """Names whose tensors differ after a save / load round trip (max abs difference)."""
    out = {k: "missing" for k in set(before) ^ set(after)}
    for k in set(before) & set(after):
        if not torch.equal(before[k], after[k]):
            out[k] = float((before[k].float() - after[k].float()).abs().max())
    return dict(sorted(out.items())[:8])


def shared_tmpdir(prefix: str) -> str:
    """One directory for every rank (rank 0 makes it): checkpoints are written collectively."""
    box = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mode_resume(a) -> None:
    """Train 2 steps at --save-layout, checkpoint, train 2 more; rebuild at --load-layout, load,
    train the same 2 more: losses must match (exact layout: bitwise weights after load)."""
    from polyrl.checkpoint import load_checkpoint, save_checkpoint
    init_distributed("cuda")
    root = a.ckpt or shared_tmpdir("mg_resume_")
    be = make_backend(a.model, parse_layout(a.save_layout))
    _train(be, 2)
    before = {k: v.cpu() for k, v in be.export_weights()}
    save_checkpoint(root, 2, be, {"step": 2})
    cont = _train(be, 2)
    del be
    torch.cuda.empty_cache()
    be2 = make_backend(a.model, parse_layout(a.load_layout))
    load_checkpoint(root, be2)
    after = {k: v.cpu() for k, v in be2.export_weights()}
    diff = _weight_diff(before, after)
    same = not diff
    resumed = _train(be2, 2)
    rel = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(cont, resumed))
    # same layout: the same arithmetic, so the losses after resume match to GPU reduction noise;
    # another layout: bf16 rounding of a different TP split
    tol = RESUME_TOL_SAME if a.save_layout == a.load_layout else 0.02
    emit(check="resume", model=os.path.basename(a.model), save_layout=a.save_layout, load_layout=a.load_layout,
         weights_equal_after_load=same, diff=diff, continued=cont, resumed=resumed, max_rel=rel, tol=tol,
         ok=same and rel <= tol and adam_steps(be2) == {4.0}, sched_step=be2.sched_step, adam_steps=sorted(adam_steps(be2)))


def adam_steps(be) -> set[float]:
    """Every Adam `step` the backend's optimizer holds (one value when the state is sound)."""
    from polyrl.backends.megatron.compat import inner_optimizers
    return {float(st["step"]) for o in inner_optimizers(be.optimizer) for st in o.state.values() if "step" in st}


def _report_dtensor_keys(be) -> None:
    """DCP's uneven-DTensor save runs one collective per DTensor key: every rank must hold the
    same keys. Report keys that only some ranks have after the backend's own fill of empty-shard
    Adam state (without it: 56 vs 74 keys at DP=2 and a hung save)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import filter_unflattened_state_dict
    from torch.distributed.tensor import DTensor
    from polyrl.backends.megatron.compat import fill_empty_shard_states
    fill_empty_shard_states(be.optimizer)
    sd = be._sharded_state(is_loading=False)
    keys = sorted(str(k) for k in filter_unflattened_state_dict(sd, visit_condition=lambda x: isinstance(x, DTensor)))
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, keys)
    union = set().union(*map(set, per_rank))
    partial = sorted(k for k in union if not all(k in set(p) for p in per_rank))
    emit(check="fsdp_dtensor_keys", counts=[len(p) for p in per_rank], keys_on_some_ranks_only=len(partial),
         examples=partial[:6], ok=not partial)


def mode_sft_fsdp(a) -> None:
    """Megatron-FSDP vs plain DDP (distributed optimizer): 5 SFT steps on a fixed batch, then a
    DCP save / load round trip of the Megatron-FSDP state."""
    from polyrl.checkpoint import load_checkpoint, save_checkpoint
    init_distributed("cuda")
    curves = {}
    for name, extra in (("ddp", ""), ("megatron_fsdp", ",fsdp=1")):
        try:
            be = make_backend(a.model, parse_layout(a.layout + extra))
            curves[name] = _train(be, 5, loss=sft_loss, with_entropy=False)
            if name == "megatron_fsdp":
                _report_dtensor_keys(be)
                root = a.ckpt or shared_tmpdir("mg_fsdp_")
                before = {k: v.cpu() for k, v in be.export_weights()}
                save_checkpoint(root, 5, be, {"step": 5})
                nxt = _train(be, 2, loss=sft_loss, with_entropy=False)
                del be
                torch.cuda.empty_cache()
                be = make_backend(a.model, parse_layout(a.layout + extra))
                load_checkpoint(root, be)
                after = {k: v.cpu() for k, v in be.export_weights()}
                diff = _weight_diff(before, after)
                same = not diff
                again = _train(be, 2, loss=sft_loss, with_entropy=False)
                rel = max(abs(x - y) / abs(x) for x, y in zip(nxt, again))
                emit(check="megatron_fsdp_dcp_resume", layout=a.layout, weights_equal_after_load=same, diff=diff,
                     next_losses=nxt, next_losses_after_resume=again, max_rel=rel, adam_steps=sorted(adam_steps(be)),
                     ok=same and rel <= RESUME_TOL_SAME)
            del be
            torch.cuda.empty_cache()
        except Exception as e:
            emit(check="error", mode="sft-fsdp", variant=name, error=f"{type(e).__name__}: {e}"[:2000],
                 tb=traceback.format_exc()[-3000:])
    if len(curves) == 2:
        rel = max(abs(x - y) / abs(x) for x, y in zip(curves["ddp"], curves["megatron_fsdp"]))
        emit(check="megatron_fsdp_vs_ddp_sft", layout=a.layout, ddp=curves["ddp"], fsdp=curves["megatron_fsdp"],
             max_rel=rel, ok=rel <= 0.01 and curves["ddp"][-1] < curves["ddp"][0])


def mode_attention(a) -> None:
    """varlen flash path == dense reference, incl. CP plans (one GPU, no process group)."""
    from polyrl.backends.megatron import thd
    torch.manual_seed(0)
    ids = [torch.randint(0, 50, (n,)) for n in (37, 5, 64, 18, 1)]
    for cp in (1, 2, 4):
        packs = [thd.pack_thd(ids, [1] * len(ids), cp_size=cp, cp_rank=r, device="cuda") for r in range(cp)]
        T = int(packs[0].cu_seqlens[-1])
        q, k, v = (torch.randn(T, 4, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        lens = torch.diff(packs[0].cu_seqlens.long()).tolist()
        idx = [thd._ranges(thd.local_chunks(lens, cp, r)).cuda() for r in range(cp)]
        kg, vg = torch.cat([k[i] for i in idx]), torch.cat([v[i] for i in idx])
        worst = 0.0
        for r, pb in enumerate(packs):
            a1 = thd.varlen_attention(q[idx[r]], kg, vg, pb.plan, 0.2, impl="varlen")
            a2 = thd.varlen_attention(q[idx[r]], kg, vg, pb.plan, 0.2, impl="dense")
            g1 = torch.autograd.grad(a1.float().square().sum(), (q, k, v), retain_graph=True)
            g2 = torch.autograd.grad(a2.float().square().sum(), (q, k, v), retain_graph=True)
            for x, y in zip((a1, *g1), (a2, *g2)):  # BF16: relative to the largest magnitude
                worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-6)))
        emit(check="varlen_vs_dense_attention", cp=cp, max_rel=worst, ok=worst < 0.02)


def mode_hf_wrap(a) -> None:
    """Qwen3-Next through HF module wrapping (polyrl/backends/megatron/hf_wrap.py), one launch:
    build the tiny model (OUT_DIR/qwen3_next), FSDP reference, then every --layouts entry through
    check_layout (log-prob parity, exact export round trip, grad-norm parity; tolerances as for the
    other families: LOGP_TOL / GRAD_TOL in BF16, FP32_* with --fp32), then, with 2+ ranks, that
    --context-parallel-size 2 is refused by name.

    The FSDP reference runs padded rows with SDPA: on a packed row HF's gated DeltaNet (its torch
    fallback, without flash-linear-attention) ignores the cu_seqlens boundaries and carries state
    from one sequence into the next. With --sparse the model has sparse MoE layers (megatron's
    MoELayer with a gated shared expert; layouts may then use ep=)."""
    init_distributed("cuda")
    qwen3_5 = a.family == "qwen3_5"  # --family qwen3_5: the Qwen3.5 text model (build_qwen3_5) instead
    model_dir = os.path.join(a.arg1, "qwen3_5" if qwen3_5 else "qwen3_next_moe" if a.sparse else "qwen3_next")
    if dist.get_rank() == 0:
        build_qwen3_5(a.arg1) if qwen3_5 else build_qwen3_next(a.arg1, sparse=a.sparse)
    dist.barrier()
    from polyrl.backends.fsdp.backend import FSDPBackend
    be = FSDPBackend(ModelConfig(hf_checkpoint=model_dir, fp32=FP32, attn_implementation="sdpa", compile=False),
                     OptimizerConfig(lr=1e-3, clip_grad=1.0),
                     BatchConfig(micro_batch_size=3, micro_batch_layout="padded"), device="cuda", total_steps=10)
    batch = fixed_batch()
    logp = gather_all(be.compute_logprobs(my_share(batch)))
    m = be.train_step(my_share(batch), RL, with_entropy=True)
    ref = {"logp": logp, "grad_norm": m["grad_norm"], "loss": m["loss"]}
    emit(check="fsdp_ref", model=model_dir, grad_norm=m["grad_norm"], loss=m["loss"], layout="padded+sdpa")
    del be
    torch.cuda.empty_cache()
    for text in a.layouts.split(";"):
        try:
            check_layout(model_dir, ref, text, set(a.checks.split(",")))
        except Exception as e:
            emit(check="error", model=model_dir, layout=text, error=f"{type(e).__name__}: {e}"[:2000],
                 tb=traceback.format_exc()[-3000:])
    if dist.get_world_size() >= 2:
        try:
            make_backend(model_dir, parse_layout("cp=2"))
            err = ""
        except ValueError as e:
            err = str(e)
        emit(check="hf_wrap_refuses_cp", error=err[:300], ok="--context-parallel-size" in err)


def mode_replay(a) -> None:
    """MoE routing replay on megatron (--model: the tiny qwen3_moe, --layout e.g. ep=2, --fp32): the HF model's routes
    and log-probs are the reference. R3: replaying the HF routes gives the HF log-probs (FP32 tolerances). R2: the
    log-prob pass records routes equal to HF's (but near-ties), and a train step replays them; with replay off the
    same routes feed moe/topk_mismatch_frac."""
    from transformers import AutoModelForCausalLM

    from polyrl.backends.routing_replay import MoERouting
    init_distributed("cuda")
    batch = fixed_batch()
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).cuda().eval()
    r = MoERouting(hf)
    with torch.no_grad():  # every rank: the whole batch, one sample per forward
        ref_lp, routes = [], []
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            r.begin([len(ids)], "packed", "cuda", record=True)
            logits = hf(input_ids=ids[None].cuda()).logits[0].float()
            routes.append(r.recorded()[0])
            ref_lp.append(torch.log_softmax(logits[p - 1:-1], -1).gather(1, ids[p:, None].cuda())[:, 0].cpu())
    r.end()
    del hf
    batch.rollout_routed_experts = routes
    layout = parse_layout(a.layout)
    tol = FP32_LOGP_TOL if FP32 else LOGP_TOL
    from polyrl.backends.megatron.backend import MegatronBackend

    def backend(**flags):
        return MegatronBackend(ModelConfig(hf_checkpoint=a.model, fp32=FP32, **flags), OptimizerConfig(lr=1e-3, clip_grad=1.0),
                               BatchConfig(micro_batch_size=3), device="cuda", total_steps=10, megatron_cfg=layout)

    be = backend(use_rollout_routing_replay=True)
    logp = gather_all(be.compute_logprobs(my_share(batch)))
    d = torch.cat([(x - y).abs() for x, y in zip(logp, ref_lp)])
    emit(check="r3_logprob_parity_vs_hf", layout=a.layout, mean_abs=float(d.mean()), max_abs=float(d.max()), tol=tol,
         ok=float(d.mean()) <= tol["mean"] and float(d.max()) <= tol["max"], fp32=FP32)
    m = be.train_step(my_share(batch), RL, with_entropy=True)
    emit(check="r3_train_step", layout=a.layout, metrics={k: v for k, v in m.items() if k.startswith("moe/") and "/layer" not in k},
         ok=math.isfinite(m["grad_norm"]) and "moe/topk_mismatch_frac" not in m)
    del be
    be = backend(use_routing_replay=True)
    mine = my_share(batch)
    mine.rollout_routed_experts = None
    mine.token_fields["old_logprobs"] = be.compute_logprobs(mine)
    rec = gather_all(mine.recorded_routed_experts or [])
    same = [bool((x.long().sort(-1).values == y.long().sort(-1).values)[:, [i for i in range(y.shape[1]) if y[0, i, 0] >= 0]]
                 .all()) for x, y in zip(rec, routes)]
    emit(check="r2_recorded_equals_hf_routes", layout=a.layout, samples_equal=sum(same), samples=len(same),
         ok=len(same) == len(routes) and sum(same) >= len(same) - 1)  # one near-tie flip tolerated
    m = be.train_step(mine, RL, with_entropy=True)
    emit(check="r2_train_step", layout=a.layout, ok=math.isfinite(m["grad_norm"]),
         metrics={k: v for k, v in m.items() if k.startswith("moe/") and "/layer" not in k})
    del be
    be = backend(return_routed_experts=True)
    m = be.train_step(my_share(batch), RL, with_entropy=True)
    emit(check="mismatch_metric_no_replay", layout=a.layout, frac=m.get("moe/topk_mismatch_frac"),
         ok=m.get("moe/topk_mismatch_frac", 1.0) <= (0.02 if FP32 else 0.2))


# ---------------------------------------------------------------------------------------------
# --offload-train, --gradient-checkpointing, --optimizer-cpu-offload, --custom-model-provider-path


def build_medium_llama(out: str) -> str:
    """A Llama of ~21M parameters (hidden 512, 4 layers, vocab 8192): big enough that what stays on the GPU after an
    offload (RoPE tables, megatron's small buffers) is measured against a state of ~0.35 GB, small enough to build in
    seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
    d = os.path.join(out, "medium_llama")
    model.save_pretrained(d)
    return d


def _backend(model_dir: str, *, layout: str = "tp=1", **model_flags):
    from polyrl.backends.megatron.backend import MegatronBackend
    mg = parse_layout(layout)
    for k in [k for k in model_flags if hasattr(mg, k)]:
        setattr(mg, k, model_flags.pop(k))
    return MegatronBackend(ModelConfig(hf_checkpoint=model_dir, fp32=FP32, **model_flags),
                           OptimizerConfig(lr=1e-3, clip_grad=1.0), BatchConfig(micro_batch_size=3), device="cuda",
                           total_steps=10, megatron_cfg=mg)


def _curve(be, steps: int, vocab: int, between=None) -> tuple[list, list, dict]:
    """`steps` RL steps on one fixed batch (a log-prob pass, then the update), `between()` after each; the losses,
    grad norms and the exported weights at the end."""
    batch = fixed_batch(vocab=vocab)
    losses, norms = [], []
    for _ in range(steps):
        batch.token_fields["old_logprobs"] = be.compute_logprobs(batch)
        m = be.train_step(batch, RL, with_entropy=True)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        if between is not None:
            between()
    return losses, norms, {k: v.detach().cpu().clone() for k, v in be.export_weights()}


def _resident(be) -> int:
    """Bytes of the backend's state tensors that hold GPU memory now (released storages count 0): exact, where the
    allocator's total also holds one-time allocations (cuBLAS workspaces, compiled kernels' buffers) of whichever
    backend ran first."""
    from polyrl.backends.megatron.offload import megatron_state, plan_slots, summarize
    return summarize(plan_slots(megatron_state(be.model, be.optimizer, [be.ref_model, be.teacher_model])))["total"]


def _mem() -> dict:
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def mode_offload(a) -> None:
    """--offload-train on one GPU, FP32 and BF16, TP1 (`--layout fsdp=1`: under Megatron-FSDP): (1) after offload() at
    most 5% of the model-state bytes stay allocated (allocated / reserved before and after, the round trip's GB/s); (2)
    3 steps with offload / onload after every step give bit-identical losses, grad norms and exported weights to 3
    steps without (deterministic kernels: dense attention, torch's deterministic algorithms; should the two differ, a
    second run without offload tells nondeterminism from an offload error). DDP also (3): the default release of the
    gradient buffers between steps (--release-grad-buffers) against 3 steps that keep them: bit-identical, and the
    state between steps smaller by the buffers' bytes."""
    import gc
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    init_distributed("cuda")
    # cuBLAS and cuBLASLt keep a workspace from the first GEMM on, allocated through torch's allocator (64 MiB here):
    # made now, before the first baseline, it is not counted as the first backend's state
    m = torch.ones(64, 64, device="cuda")
    for dt in (torch.float32, torch.bfloat16):
        torch.nn.functional.linear(m.to(dt), m.to(dt), m[0].to(dt)), m.to(dt) @ m.to(dt)
    del m
    from polyrl.backends.megatron import model as mm
    mm.VarlenCoreAttention.impl = "dense"  # flash varlen's backward may accumulate in any order
    model_dir = build_medium_llama(a.arg1)
    layout = a.layout or "tp=1"
    fsdp = "fsdp=1" in layout
    global FP32

    def free():
        gc.collect()
        torch.cuda.empty_cache()

    def equal(x, y) -> tuple[bool, bool, bool]:
        return (x[0] == y[0], x[1] == y[1],
                sorted(x[2]) == sorted(y[2]) and all(torch.equal(x[2][k], y[2][k]) for k in x[2]))

    for fp32 in (True, False):
        FP32 = fp32
        free()
        empty = _mem()["allocated"]
        be = _backend(model_dir, layout=layout)
        ref = _curve(be, 3, 8192)
        state_release = _mem()["allocated"] - empty  # between steps: what the backend keeps on the GPU
        resident_release = _resident(be)
        grad_bytes = be._grads.nbytes if be._grads is not None else 0
        be = None
        free()
        if not fsdp:
            empty = _mem()["allocated"]  # again: a backend may leave some of its state behind (seen in FP32)
            be = _backend(model_dir, layout=layout, release_grad_buffers=False)
            kept_curve = _curve(be, 3, 8192)
            state_keep = _mem()["allocated"] - empty
            resident_keep = _resident(be)
            be = None
            free()
            same = equal(ref, kept_curve)
            emit(check="release_grad_buffers", fp32=fp32, layout=layout, losses=ref[0], losses_kept=kept_curve[0],
                 grad_norms=ref[1], grad_norms_kept=kept_curve[1], losses_equal=same[0], norms_equal=same[1],
                 weights_equal=same[2], grad_buffer_bytes=grad_bytes, state_bytes_released=state_release,
                 state_bytes_kept=state_keep, resident_bytes_released=resident_release,
                 resident_bytes_kept=resident_keep,
                 ok=all(same) and grad_bytes > 0 and resident_keep - resident_release == grad_bytes)
        base = _mem()
        be = _backend(model_dir, layout=layout, offload_train=True)
        timing: dict = {}

        def between():
            before = _mem()
            t0 = time.perf_counter()
            be.offload()
            t1 = time.perf_counter()
            after = _mem()
            # what the engine would do with the freed memory: fill it, so nothing can rely on its old contents
            junk = torch.full((be.offloaded_bytes["total"] // 4,), float("nan"), device="cuda")
            del junk
            t1b = time.perf_counter()
            be.onload()
            t2 = time.perf_counter()
            # the first offload also allocates the pinned host arenas; the last round trip is the steady state
            timing.setdefault("first", (t1 - t0, t2 - t1b))
            timing.update(before=before, after=after, offload_s=t1 - t0, onload_s=t2 - t1b)

        got = _curve(be, 3, 8192, between)
        sizes = dict(be.offloaded_bytes)
        kept = sum(s.nbytes for s in be._offloader.slots if s.keep)
        from polyrl.backends.megatron.offload import STEP_ONLY  # onload() leaves these for the optimizer step
        back = sum(s.nbytes for s in be._offloader.slots if s.keep and s.kind not in STEP_ONLY)
        remaining = timing["after"]["allocated"] - base["allocated"]
        n_params = sum(p.numel() for c in be.model for p in c.parameters())
        same = equal(ref, got)
        control = None
        if not all(same):
            be = None
            free()
            again = _curve(_backend(model_dir, layout=layout), 3, 8192)
            control = dict(losses_equal=again[0] == ref[0], norms_equal=again[1] == ref[1])
        emit(check="offload_memory", fp32=fp32, layout=layout, params=n_params, state_bytes=sizes, baseline=base,
             before_offload=timing["before"], after_offload=timing["after"], remaining_bytes=remaining,
             remaining_frac=remaining / sizes["total"], copied_bytes=kept,
             onload_copied_bytes=back, offload_gbps=kept / timing["offload_s"] / 1e9,
             onload_gbps=back / timing["onload_s"] / 1e9,
             round_trip_gbps=(kept + back) / (timing["offload_s"] + timing["onload_s"]) / 1e9,
             first_offload_gbps=kept / timing["first"][0] / 1e9, compiled=be.compiled,
             ok=remaining / sizes["total"] <= 0.05)
        emit(check="offload_bit_identical", fp32=fp32, layout=layout, losses=ref[0], losses_offload=got[0],
             grad_norms=ref[1], grad_norms_offload=got[1], losses_equal=same[0], norms_equal=same[1],
             weights_equal=same[2], control_without_offload=control, ok=all(same))
        be = None
        free()


def mode_recompute(a) -> None:
    """--gradient-checkpointing on megatron is full recompute of every layer: the config says so, and in FP32 one
    step's loss and grad norm equal the step without it (recompute reruns the same forward kernels on the same
    inputs)."""
    init_distributed("cuda")
    global FP32
    FP32 = True
    out = {}
    for gc_on in (False, True):
        be = _backend(a.model, gradient_checkpointing=gc_on)
        cfg = (be.config.recompute_granularity, be.config.recompute_method, be.config.recompute_num_layers)
        m = be.train_step(fixed_batch(), RL, with_entropy=True)
        out[gc_on] = (cfg, m["loss"], m["grad_norm"])
        del be
        torch.cuda.empty_cache()
    rel = abs(out[True][2] - out[False][2]) / out[False][2]
    emit(check="gradient_checkpointing_is_full_recompute", config=out[True][0], loss=[out[False][1], out[True][1]],
         grad_norm=[out[False][2], out[True][2]], rel=rel,
         ok=out[True][0] == ("full", "uniform", 1) and out[False][0][0] is None and rel <= 1e-6)


def mode_grad_norm_once(a) -> None:
    """The train step computes the grad norm once: megatron's optimizer step reuses the step's prepared grads and
    norm (the backend's `_prepared`) instead of computing them again. FP32, clipping active (clip 1e-3, below every
    step's norm): 3 steps give bit-identical losses, grad norms and weights to 3 steps where megatron's step computes
    them itself, with one get_grad_norm_fp32 call per step instead of two."""
    import contextlib
    import megatron.core.optimizer.optimizer as mopt
    from polyrl.backends.megatron import backend as mb
    init_distributed("cuda")
    global FP32
    FP32 = True
    real, reused = mopt.get_grad_norm_fp32, mb._prepared
    runs = {}
    for reuse in (True, False):
        calls = [0]

        def counted(*args, **kw):
            calls[0] += 1
            return real(*args, **kw)
        mopt.get_grad_norm_fp32 = counted
        mb._prepared = reused if reuse else (lambda *args: contextlib.nullcontext())
        try:
            be = _backend(a.model)
            for o in be.optimizer.chained_optimizers:  # clip below every norm: the reused norm scales the grads
                o.config.clip_grad = 1e-3
            losses, norms, weights = _curve(be, 3, 250)
        finally:
            mopt.get_grad_norm_fp32, mb._prepared = real, reused
        runs[reuse] = (losses, norms, weights, calls[0])
        del be
        torch.cuda.empty_cache()
    (l1, g1, w1, c1), (l0, g0, w0, c0) = runs[True], runs[False]
    same_w = all(torch.equal(w1[k], w0[k]) for k in w0)
    emit(check="grad_norm_once", losses=l1, losses_twice=l0, grad_norms=g1, grad_norms_twice=g0, norm_calls=c1,
         norm_calls_twice=c0, weights_equal=same_w,
         ok=l1 == l0 and g1 == g0 and same_w and c1 == 3 and c0 == 6 and min(g1) > 1e-3)


def mode_optimizer_cpu_offload(a) -> None:
    """--optimizer-cpu-offload (BF16): megatron-core's hybrid-device optimizer keeps the fp32 master weights and Adam
    state on the CPU. Step 1 runs on the same weights as the GPU optimizer's run (equal loss and grad norm); later
    steps follow a CPU AdamW against the GPU one, both in fp32 on the same grads, then rounded to bf16 weights: one
    bf16 ulp (2^-8 relative) of a weight moves the loss by far less than 1%, so 1e-2 relative bounds them; a missing
    update (the CPU copy not written back) leaves step 2's loss at step 1's. The GPU bytes of main parameters and
    optimizer state (counted storage by storage, as --offload-train would move them) drop from the GPU optimizer's
    12 a parameter (fp32 main copy and two moments) to under 1."""
    from polyrl.backends.megatron.offload import megatron_state, plan_slots, summarize
    init_distributed("cuda")
    global FP32
    FP32 = False
    res = {}
    for off in (False, True):
        be = _backend(a.model, optimizer_cpu_offload=off)
        losses, norms, _ = _curve(be, 3, 250)
        n_params = sum(p.numel() for c in be.model for p in c.parameters())
        sizes = summarize(plan_slots(megatron_state(be.model, be.optimizer)))
        res[off] = (losses, norms, sizes.get("main_params", 0) + sizes.get("optimizer", 0), n_params, sizes)
        del be
        torch.cuda.empty_cache()
    (l0, g0, m0, n, s0), (l1, g1, m1, _, s1) = res[False], res[True]
    rel = max(abs(x - y) / abs(x) for x, y in zip(l0, l1))
    emit(check="optimizer_cpu_offload", losses_gpu_opt=l0, losses_cpu_opt=l1, grad_norms_gpu_opt=g0,
         grad_norms_cpu_opt=g1, max_rel=rel, gpu_state_bytes_gpu_opt=s0, gpu_state_bytes_cpu_opt=s1, params=n,
         ok=l0[0] == l1[0] and rel <= 1e-2 and l1[1] != l1[0] and m0 >= 12 * n and m1 < n)


PROVIDER = """
import torch

ALPHA = 0.5


def provider(config, hf_config, pre_process, post_process, vp_stage):
    \"\"\"The default GPTModel plus an extra scaled residual around the final norm: norm(x) + ALPHA * x.\"\"\"
    from megatron.core.models.gpt import GPTModel
    from polyrl.backends.megatron import bridge, model as mm
    m = GPTModel(config=config, transformer_layer_spec=mm.layer_spec(config, vp_stage, hf_config), pre_process=pre_process,
                 post_process=post_process, parallel_output=True, vp_stage=vp_stage,
                 **bridge.gpt_model_kwargs(hf_config, config.tensor_model_parallel_size))
    if post_process:
        m.provider_hook_calls = 0

        def residual(mod, args, out):
            m.provider_hook_calls += 1
            return out + ALPHA * args[0]
        m.decoder.final_layernorm.register_forward_hook(residual)
    return m
"""


def _hf_logprobs(model_dir: str, batch: TrainBatch, alpha: float) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    if alpha:
        hf.model.norm.register_forward_hook(lambda mod, args, out: out + alpha * args[0])
    out = []
    with torch.no_grad():
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            logits = hf(input_ids=ids[None].cuda()).logits[0].float()
            out.append(torch.log_softmax(logits[p - 1:-1], -1).gather(1, ids[p:, None].cuda())[:, 0].cpu())
    return out


def mode_provider(a) -> None:
    """--custom-model-provider-path in FP32: a provider adding a scaled residual around the final norm. The backend's
    log-probs equal the HF model with the same residual (FP32 tolerances) and not the plain one; a train step runs
    the provider's forward (its hook counts calls) and its grad norm differs from the plain model's."""
    init_distributed("cuda")
    global FP32
    FP32 = True
    path = os.path.join(a.arg1, "provider.py")
    with open(path, "w") as f:
        f.write(PROVIDER)
    batch = fixed_batch()
    want, plain = _hf_logprobs(a.model, batch, 0.5), _hf_logprobs(a.model, batch, 0.0)
    be = _backend(a.model, custom_model_provider_path=f"{path}:provider")
    from polyrl.backends.megatron.model import unwrap
    logp = be.compute_logprobs(batch)
    d = torch.cat([(x - y).abs() for x, y in zip(logp, want)])
    d_plain = torch.cat([(x - y).abs() for x, y in zip(logp, plain)])
    head = unwrap(be.model[0])
    calls0 = head.provider_hook_calls
    m = be.train_step(batch, RL, with_entropy=True)
    calls = head.provider_hook_calls - calls0
    del be
    torch.cuda.empty_cache()
    m_plain = _backend(a.model).train_step(batch, RL, with_entropy=True)
    tol = FP32_LOGP_TOL
    emit(check="custom_model_provider", mean_abs_vs_provider_hf=float(d.mean()), max_abs_vs_provider_hf=float(d.max()),
         mean_abs_vs_plain_hf=float(d_plain.mean()), hook_calls_in_train_step=calls, grad_norm=m["grad_norm"],
         grad_norm_plain=m_plain["grad_norm"],
         ok=float(d.mean()) <= tol["mean"] and float(d.max()) <= tol["max"] and float(d_plain.mean()) > 1e-2
         and calls > 0 and abs(m["grad_norm"] - m_plain["grad_norm"]) > 1e-3 * m_plain["grad_norm"])



MODES = {  # the modes that take the parsed arguments
    "layouts": mode_layouts, "resume": mode_resume, "sft-fsdp": mode_sft_fsdp,
    "attention": mode_attention, "hf-wrap": mode_hf_wrap, "replay": mode_replay,
    "offload": mode_offload, "recompute": mode_recompute, "grad-norm-once": mode_grad_norm_once,
    "optimizer-cpu-offload": mode_optimizer_cpu_offload, "provider": mode_provider,
}

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("arg1", nargs="?")
    ap.add_argument("arg2", nargs="?")
    ap.add_argument("--models")
    ap.add_argument("--refs")
    ap.add_argument("--model")
    ap.add_argument("--layouts", default="tp=1")
    ap.add_argument("--layout", default="")
    ap.add_argument("--checks", default="logprobs,export,grad")
    ap.add_argument("--save-layout", default="")
    ap.add_argument("--load-layout", default="")
    ap.add_argument("--ckpt")
    ap.add_argument("--stop-on-error", action="store_true")
    ap.add_argument("--fp32", action="store_true", help="FP32 params and compute on both backends (tight tolerances)")
    ap.add_argument("--sparse", action="store_true", help="hf-wrap: Qwen3-Next with sparse MoE layers")
    ap.add_argument("--family", default="qwen3_next", choices=("qwen3_next", "qwen3_5"), help="hf-wrap: which model")
    a = ap.parse_args()
    global FP32
    FP32 = a.fp32
    if HANG_DUMP and a.mode != "layouts":  # (layouts arm it per layout)
        import faulthandler
        faulthandler.dump_traceback_later(HANG_DUMP, exit=True)
    if a.mode == "models":
        print(json.dumps(build_models(a.arg1)))
    elif a.mode == "families":
        print(json.dumps(build_bridge_families(a.arg1)))
    elif a.mode == "gpt-oss":  # OUT/gpt_oss (vocab 250, for `layouts`)
        print(json.dumps(build_gpt_oss(a.arg1)))
    elif a.mode == "mimo-v2-flash":  # OUT/mimo_v2_flash (vocab 250, for `layouts`)
        print(json.dumps(build_mimo_v2_flash(a.arg1)))
    elif a.mode == "fsdp-ref":
        mode_fsdp_ref(a.arg1, a.arg2)
    elif a.mode in MODES:
        MODES[a.mode](a)
    else:
        raise SystemExit(f"unknown mode {a.mode}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
