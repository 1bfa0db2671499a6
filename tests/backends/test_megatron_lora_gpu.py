"""LoRA on the Megatron backend against LoRA on the FSDP backend (peft), one GPU, TP1, FP32.

Both start from the same tiny HF model and the same adapters: FSDP's peft adapters get a seeded nonzero B (so A trains
from step 1 and the adapters change the log-probs), and Megatron copies them in (lora.load_full_adapters). Then 3 RL
steps on a fixed batch, each a log-prob pass and an update. Checked per family (Llama untied; Qwen2 with QKV bias,
tied embeddings):
- reference log-probs (Megatron: the actor with its adapters off) and the actor's log-probs, losses, grad norms;
- the merged export (W + s * B @ A under HF names) before and after training;
- trainable parameters (adapters only, the same count on both) and the optimizer's state bytes (vs Megatron full FT);
- --save-hf-adapter's directory loads with peft onto the HF model and reproduces Megatron's merged export;
- a checkpoint after step 2 (adapters + their Adam state) resumes step 3 to the same loss and weights (1e-5: the
  same fp32 arithmetic, up to flash attention's run-to-run reordering of sums).

Bounds. The two backends already differ on the base model (no adapters) by FP32 reordering: flash-varlen vs sdpa
attention, one fused QKV / gate-up GEMM vs separate ones. The existing FP32 parity harness bounds that at
FP32_LOGP_TOL (mean 1e-4, max 2e-3) and FP32_GRAD_TOL (1e-3 relative grad norm); the adapters add the same fp32 math
on both sides, so the LoRA run is held to the same bounds (the measured figures are printed; the relative 1e-5 of the
issue is reported, not asserted, since the base model alone does not meet it). The merged export before training is
W + s * B @ A from identical tensors with the same torch ops: atol 1e-6. After 3 Adam steps of lr 1e-3 each adapter
element moves by at most lr per step, so the two runs' adapters differ by at most 2 * 3 * lr; the merged delta then
differs by at most s * r * (|B| + |A|) * 6e-3, the bound asserted (measured figures printed).
Run as a script (subprocess) by the tests below; skipped without CUDA / megatron-core / Python >= 3.12.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RANK, ALPHA, STEPS, LR = 8, 16, 3, 1e-3
FAMS = ("llama", "qwen2")


def _emit(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _model_cfg(model_dir: str):
    from polyrl.config import ModelConfig
    # LORA_TEST_RECOMPUTE=1: both backends recompute activations (FSDP's checkpointing, Megatron's full recompute),
    # which re-runs the same forward arithmetic, so the bounds below hold unchanged
    return ModelConfig(hf_checkpoint=model_dir, fp32=True, compile=False, lora_rank=RANK, lora_alpha=ALPHA,
                       gradient_checkpointing=os.environ.get("LORA_TEST_RECOMPUTE") == "1")


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def mode_fsdp(model_dir: str, out: str) -> None:
    import torch

    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.config import BatchConfig, OptimizerConfig
    from polyrl.dist import init_distributed
    sys.path.insert(0, os.path.join(HERE, "megatron"))
    from harness import RL, fixed_batch
    init_distributed("cuda")
    be = FSDPBackend(_model_cfg(model_dir), OptimizerConfig(lr=LR, clip_grad=1.0), BatchConfig(micro_batch_size=3),
                     device="cuda", total_steps=10, need_ref=True)
    g = torch.Generator().manual_seed(11)
    init = {}
    with torch.no_grad():
        for n, p in be.model.named_parameters():
            if ".lora_B." in n:
                _local(p).copy_(torch.randn(p.shape, generator=g) * 0.05)
            if ".lora_" in n:
                init[n] = _local(p).detach().cpu().clone()
    batch = fixed_batch()
    rec = {"init": init, "merged0": {k: v.detach().cpu().clone() for k, v in be.export_weights()},
           "ref": be.compute_logprobs(batch, model="ref"), "logp": [], "loss": [], "grad_norm": []}
    for _ in range(STEPS):
        batch.token_fields["old_logprobs"] = lp = be.compute_logprobs(batch)
        m = be.train_step(batch, RL, with_entropy=True)
        rec["logp"].append(lp)
        rec["loss"].append(m["loss"])
        rec["grad_norm"].append(m["grad_norm"])
    rec["merged"] = {k: v.detach().cpu().clone() for k, v in be.export_weights()}
    rec["trainable"] = sum(p.numel() for p in be.model.parameters() if p.requires_grad)
    rec["opt_bytes"] = sum(t.numel() * t.element_size() for st in be.optimizer.state.values() for t in st.values()
                           if torch.is_tensor(t))
    torch.save(rec, out)
    _emit(check="fsdp_lora", model=model_dir, losses=rec["loss"], grad_norms=rec["grad_norm"])


def _megatron(model_dir: str, lora_on: bool = True):
    from polyrl.backends.megatron.backend import MegatronBackend
    from polyrl.config import BatchConfig, MegatronConfig, ModelConfig, OptimizerConfig
    mcfg = _model_cfg(model_dir) if lora_on else ModelConfig(hf_checkpoint=model_dir, fp32=True,
                                                             gradient_checkpointing=_model_cfg(model_dir).gradient_checkpointing)
    return MegatronBackend(mcfg, OptimizerConfig(lr=LR, clip_grad=1.0), BatchConfig(micro_batch_size=3), device="cuda",
                           total_steps=10, need_ref=lora_on, megatron_cfg=MegatronConfig())


def _set_adapters(be, init: dict) -> None:
    from polyrl.backends.megatron import lora
    full = {lora.from_peft(k): v for k, v in init.items()}
    n = lora.load_full_adapters([be.mm.unwrap(c) for c in be.model], full,
                                lambda c: be.mm.chunk_layer_offset(be.config, c), 0, 1)
    assert n == len(full), (n, len(full))
    be.optimizer.reload_model_params()  # main parameters follow the copied weights


def _opt_bytes(be) -> int:
    import torch

    from polyrl.backends.megatron.compat import inner_optimizers
    return sum(t.numel() * t.element_size() for o in inner_optimizers(be.optimizer) for st in o.state.values()
               for t in st.values() if torch.is_tensor(t))


def mode_megatron(model_dir: str, ref_path: str, work: str) -> None:
    import torch

    from polyrl.backends.megatron import lora
    from polyrl.dist import init_distributed
    sys.path.insert(0, os.path.join(HERE, "megatron"))
    from harness import FP32_GRAD_TOL, FP32_LOGP_TOL, RL, fixed_batch
    init_distributed("cuda")
    fam = os.path.basename(model_dir.rstrip("/"))
    ref = torch.load(ref_path, weights_only=False)
    be = _megatron(model_dir)
    _set_adapters(be, ref["init"])
    scale = ALPHA / RANK

    def diff(a, b):
        d = torch.cat([(x - y).abs() for x, y in zip(a, b)])
        return float(d.mean()), float(d.max())

    def close(a, b):
        mean, mx = diff(a, b)
        return dict(mean_abs=mean, max_abs=mx, ok=mean <= FP32_LOGP_TOL["mean"] and mx <= FP32_LOGP_TOL["max"])

    def export_diff(got: dict, want: dict) -> tuple[float, list]:
        missing = sorted(set(want) ^ set(got))
        return max(float((got[k] - want[k]).abs().max()) for k in set(want) & set(got)), missing[:4]

    merged0 = {k: v.detach().cpu().clone() for k, v in be.export_weights()}
    d0, miss0 = export_diff(merged0, ref["merged0"])
    _emit(check="merged_export_init", family=fam, max_abs=d0, missing=miss0, ok=d0 <= 1e-6 and not miss0)
    batch = fixed_batch()
    r = close(be.compute_logprobs(batch, model="ref"), ref["ref"])
    actor0 = be.compute_logprobs(batch)
    moved = diff(actor0, be.compute_logprobs(batch, model="ref"))[1]
    _emit(check="reference_is_adapters_off", family=fam, **{**r, "ok": r["ok"] and moved > 100 * FP32_LOGP_TOL["max"]},
          adapters_move_logp_by=moved)
    losses, norms = [], []
    ckpt = os.path.join(work, f"ckpt_{fam}")
    for step in range(STEPS):
        if step == STEPS - 1:
            be.save(ckpt)
        batch.token_fields["old_logprobs"] = lp = be.compute_logprobs(batch)
        m = be.train_step(batch, RL, with_entropy=True)
        c = close(lp, ref["logp"][step])
        rel_loss = abs(m["loss"] - ref["loss"][step]) / abs(ref["loss"][step])
        rel_gn = abs(m["grad_norm"] - ref["grad_norm"][step]) / ref["grad_norm"][step]
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        _emit(check="lora_step_parity", family=fam, step=step, logp=c, loss=m["loss"], fsdp_loss=ref["loss"][step],
              rel_loss=rel_loss, grad_norm=m["grad_norm"], fsdp_grad_norm=ref["grad_norm"][step], rel_grad_norm=rel_gn,
              within_rel_1e5=max(rel_loss, rel_gn) <= 1e-5,
              ok=c["ok"] and rel_loss <= FP32_GRAD_TOL and rel_gn <= FP32_GRAD_TOL)
    merged = {k: v.detach().cpu().clone() for k, v in be.export_weights()}
    d, miss = export_diff(merged, ref["merged"])
    amax = max(float(v.abs().max()) for v in ref["init"].values())
    bound = scale * RANK * 2 * amax * 2 * STEPS * LR
    _emit(check="merged_export_after_training", family=fam, max_abs=d, bound=bound, missing=miss,
          ok=d <= bound and not miss)
    trainable = sum(p.numel() for c in be.model for p in c.parameters() if p.requires_grad)
    names = [n for c in be.model for n, p in c.named_parameters() if p.requires_grad]
    lora_bytes = _opt_bytes(be)
    # --save-hf-adapter: peft's directory, loaded with peft onto the HF model, gives Megatron's merged weights
    adir = os.path.join(work, f"adapter_{fam}")
    be.save_hf(adir, adapter=True)
    files = sorted(os.listdir(adir))
    try:
        import peft
        from transformers import AutoModelForCausalLM
        pm = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adir)
        sd = pm.merge_and_unload().state_dict()
        pd = max(float((sd[k] - merged[k]).abs().max()) for k in merged)
        peft_check = dict(peft_merged_vs_export=pd, ok=pd <= 1e-5)
    except ImportError as e:
        from safetensors.torch import load_file
        keys = list(load_file(os.path.join(adir, "adapter_model.safetensors")))
        peft_check = dict(peft_missing=str(e), keys=len(keys), ok=all(".lora_" in k and k.startswith("base_model.model.")
                                                                     for k in keys))
    _emit(check="save_hf_adapter", family=fam, files=files, **peft_check)
    # resume: the checkpoint taken before the last step gives that step again
    del be
    torch.cuda.empty_cache()
    be = _megatron(model_dir)
    be.load(ckpt)
    batch = fixed_batch()
    batch.token_fields["old_logprobs"] = be.compute_logprobs(batch)
    m = be.train_step(batch, RL, with_entropy=True)
    # the weights after the step need the adapters' Adam moments of steps 1-2 (a fresh Adam would move every
    # element by ~lr): the same merged export as the uninterrupted run, to flash attention's run-to-run reordering
    after = {k: v.detach().cpu().clone() for k, v in be.export_weights()}
    dr = max(float((after[k] - merged[k]).abs().max()) for k in merged)
    rel = abs(m["loss"] - losses[-1]) / abs(losses[-1])
    _emit(check="lora_resume", family=fam, loss=m["loss"], uninterrupted=losses[-1], rel=rel, export_max_abs=dr,
          ckpt_files=sorted(os.listdir(ckpt)), ok=rel <= 1e-5 and dr <= 1e-5)
    del be
    torch.cuda.empty_cache()
    full = _megatron(model_dir, lora_on=False)
    full.train_step(fixed_batch(), RL, with_entropy=True)
    full_params = sum(p.numel() for c in full.model for p in c.parameters() if p.requires_grad)
    _emit(check="lora_memory", family=fam, trainable_params=trainable, fsdp_trainable_params=ref["trainable"],
          all_adapters=all(lora.is_adapter(n) for n in names), optimizer_state_bytes=lora_bytes,
          fsdp_optimizer_state_bytes=ref["opt_bytes"], full_ft_params=full_params,
          full_ft_optimizer_state_bytes=_opt_bytes(full),
          ok=trainable == ref["trainable"] and all(lora.is_adapter(n) for n in names) and lora_bytes < _opt_bytes(full))


# ---------------------------------------------------------------------------------------------
# pytest side


def _need() -> None:
    from conftest import need_megatron_gpus
    need_megatron_gpus(1)


def _run(args: list[str], timeout: int = 600, **extra_env: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               **extra_env)
    p = subprocess.run([sys.executable, os.path.abspath(__file__)] + args, env=env, capture_output=True, text=True,
                       timeout=timeout)
    results = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    for r in results:
        print(json.dumps(r))
    if os.environ.get("POLYRL_RESULTS_LOG"):
        with open(os.environ["POLYRL_RESULTS_LOG"], "a") as f:
            for r in results:
                f.write(json.dumps(dict(r, argv=args)) + "\n")
    assert p.returncode == 0, f"{args[0]} exited {p.returncode}\n" + p.stdout[-3000:] + p.stderr[-5000:]
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("fam,recompute", [(f, False) for f in FAMS] + [("llama", True)])
def test_megatron_lora_tp1_fp32_matches_fsdp_lora(tmp_path, fam, recompute):
    _need()
    sys.path.insert(0, os.path.join(HERE, "megatron"))
    from harness import build_models
    build_models(str(tmp_path / "m"))
    model = str(tmp_path / "m" / fam)
    env = {"LORA_TEST_RECOMPUTE": "1" if recompute else "0"}
    _run(["fsdp", model, str(tmp_path / "ref.pt")], **env)
    results = _run(["megatron", model, str(tmp_path / "ref.pt"), str(tmp_path)], **env)
    checks = [r for r in results if "ok" in r]
    assert {r["check"] for r in checks} >= {"merged_export_init", "reference_is_adapters_off", "lora_step_parity",
                                            "merged_export_after_training", "save_hf_adapter", "lora_resume",
                                            "lora_memory"}, results
    assert len([r for r in checks if r["check"] == "lora_step_parity"]) == STEPS
    assert all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "fsdp":
        mode_fsdp(sys.argv[2], sys.argv[3])
    elif mode == "megatron":
        mode_megatron(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        raise SystemExit(f"unknown mode {mode}")
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
