"""MiMo's MTP layers, Megatron vs FSDP on the same tiny checkpoint and batch, FP32 (GPU).

    python tests/backends/megatron/mtp_harness.py build OUT_DIR
    python tests/backends/megatron/mtp_harness.py fsdp MODEL_DIR REF.pt
    torchrun --nproc-per-node 1 tests/backends/megatron/mtp_harness.py megatron MODEL_DIR REF.pt

Cases (each a fresh backend on both sides): MTP layers kept frozen (no --enable-mtp-training), trained with
--mtp-detach-encoder under the RL loss, and trained under a zero policy loss with and without detaching, so the
grad norm is the MTP loss's alone. Results: `RESULT {json}` lines (tolerances and their reasons at the checks).
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py beside this file
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from harness import RL, emit, fixed_batch  # noqa: E402

from polyrl.config import BatchConfig, MegatronConfig, ModelConfig, OptimizerConfig  # noqa: E402
from polyrl.dist import init_distributed  # noqa: E402

VOCAB = 250
# name -> (--enable-mtp-training, --mtp-detach-encoder, policy loss)
CASES = {"frozen": (False, True, "rl"), "detach_rl": (True, True, "rl"), "detach_mtp_only": (True, True, "zero"),
         "no_detach_mtp_only": (True, False, "zero")}
# FP32 on both sides with the same weights and batch: the backends differ only in the order of fp32 sums (fused vs
# separate q/k/v and gate/up matmuls, eh_proj's swapped halves, attention kernels over packed rows), each a relative
# error of a few ulp (6e-8) growing to ~1e-6 through 3 layers; a mean of log-probs of magnitude ~5 keeps that relative
# size, so 1e-5 is a 10x margin. Grad norms sum squares of ~1e5 such gradients: harness.FP32_GRAD_TOL (1e-3), the
# other families' FP32 gate; per-token log-probs: harness.FP32_LOGP_TOL.
MTP_LOSS_REL = 1e-5
LOSS_REL = 1e-5
GRAD_REL = 1e-3
LOGP_TOL = dict(mean=1e-4, max=2e-3)


def zero_policy_loss(logp, ent, fields, *, num_tokens, num_seqs):
    return logp.sum() * 0.0, {}


def build(out: str) -> None:
    from polyrl import hf_families
    cfg = hf_families.MiMoConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 rms_norm_eps=1e-6, num_nextn_predict_layers=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = hf_families.MiMoForCausalLM(cfg)
    with torch.no_grad():  # random norms and biases (a swapped or missing one shows), logits of rms ~3
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
            elif "lm_head" in name:
                p.normal_(std=3.0 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(std=1.0 / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    emit(check="built", tensors=len(model.state_dict()), mtp=sum(".mtp_layers." in n for n in model.state_dict()))


def _configs(model_dir: str, case: str):
    on, detach, _ = CASES[case]
    mc = ModelConfig(hf_checkpoint=model_dir, fp32=True, compile=False, enable_mtp_training=on,
                     mtp_detach_encoder=detach)
    return mc, OptimizerConfig(lr=1e-3, clip_grad=1.0), BatchConfig(micro_batch_size=3)


def _loss(case: str):
    return RL if CASES[case][2] == "rl" else zero_policy_loss


def _mtp_tensors(be) -> dict[str, torch.Tensor]:
    return {n: t.detach().float().cpu().clone() for n, t in be.export_weights() if ".mtp_layers." in n}


def fsdp(model_dir: str, out: str) -> None:
    from polyrl.backends.fsdp.backend import FSDPBackend
    init_distributed("cuda")
    ref = {}
    for case in CASES:
        be = FSDPBackend(*_configs(model_dir, case), device="cuda", total_steps=10)
        batch = fixed_batch(vocab=VOCAB)
        logp = be.compute_logprobs(batch)
        m = be.train_step(batch, _loss(case), with_entropy=True)
        ref[case] = {"logp": logp, "metrics": m, "mtp_after": _mtp_tensors(be)}
        emit(check="fsdp_ref", case=case, **{k: m[k] for k in ("loss", "grad_norm", "mtp_loss") if k in m})
        del be
        torch.cuda.empty_cache()
    torch.save(ref, out)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def megatron(model_dir: str, ref_path: str) -> None:
    from safetensors.torch import load_file

    from polyrl.backends.megatron.backend import MegatronBackend
    init_distributed("cuda")
    ref = torch.load(ref_path, weights_only=False)
    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    for case in CASES:
        r = ref[case]
        be = MegatronBackend(*_configs(model_dir, case), device="cuda", total_steps=10, megatron_cfg=MegatronConfig())
        batch = fixed_batch(vocab=VOCAB)
        logp = be.compute_logprobs(batch)
        d = torch.cat([(a - b).abs() for a, b in zip(logp, r["logp"])])
        emit(check="logprob_parity", case=case, mean_abs=float(d.mean()), max_abs=float(d.max()),
             ok=float(d.mean()) <= LOGP_TOL["mean"] and float(d.max()) <= LOGP_TOL["max"])
        got = dict(be.export_weights())  # every HF tensor back exactly, the MTP layers under their HF names
        bad = sorted(n for n in ckpt if n not in got or not torch.equal(got[n].cpu(), ckpt[n]))
        emit(check="export_roundtrip", case=case, tensors=len(got), mtp=sum(".mtp_layers." in n for n in got),
             extra=sorted(set(got) - set(ckpt))[:5], mismatched=bad[:5], ok=not bad and set(got) == set(ckpt))
        m = be.train_step(batch, _loss(case), with_entropy=True)
        rm = r["metrics"]
        emit(check="grad_norm", case=case, grad_norm=m["grad_norm"], fsdp=rm["grad_norm"],
             rel=_rel(m["grad_norm"], rm["grad_norm"]), ok=m["grad_norm"] > 0
             and _rel(m["grad_norm"], rm["grad_norm"]) <= GRAD_REL)
        emit(check="policy_loss", case=case, loss=m["loss"], fsdp=rm["loss"], ok=abs(m["loss"] - rm["loss"]) <= LOSS_REL *
             max(abs(rm["loss"]), 1.0))
        if CASES[case][0]:
            emit(check="mtp_loss", case=case, mtp_loss=m.get("mtp_loss"), fsdp=rm["mtp_loss"],
                 rel=_rel(m.get("mtp_loss", math.inf), rm["mtp_loss"]),
                 ok="mtp_loss" in m and _rel(m["mtp_loss"], rm["mtp_loss"]) <= MTP_LOSS_REL)
        else:
            emit(check="mtp_untrained", case=case, ok="mtp_loss" not in m and "mtp_loss" not in rm)
        after = _mtp_tensors(be)
        moved = sorted(n for n in after if not torch.equal(after[n], ckpt[n].float()))
        if CASES[case][0]:  # trained: every MTP projection moved (the FSDP backend's too)
            projs = [n for n in after if n.endswith("proj.weight")]
            emit(check="mtp_trained", case=case, moved=len(moved), of=len(after),
                 ok=bool(projs) and all(n in moved for n in projs)
                 and all(not torch.equal(r["mtp_after"][n], ckpt[n].float()) for n in projs))
        else:  # kept: frozen, bit for bit
            emit(check="mtp_frozen", case=case, moved=moved[:5], ok=not moved and len(after) > 0)
        del be
        torch.cuda.empty_cache()
    emit(check="done")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"build": build, "fsdp": fsdp, "megatron": megatron}[mode](*args)
