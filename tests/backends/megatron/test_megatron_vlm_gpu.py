"""Megatron backend with a vision-language model on one GPU, FP32: a tiny Qwen2.5-VL and a tiny Qwen3-VL (3 decoder
layers, deepstack features from both vision blocks into decoder layers 0 and 1; random weights, random norms and biases)
against the FSDP backend on the same batch of image prompts (1 or 2 images per sample, one text-only sample, two
micro-batches): per-token log-probs, loss and grad norm of one RL step, the exported HF weights (decoder and
`model.visual.*`, deepstack mergers included) equal to the checkpoint's before the step and close to FSDP's after it,
and save_hf loading back.

Each backend runs in its own single-process torchrun launch of this file (as harness.py does); the pytest test reads
their RESULT lines. Skipped without CUDA, megatron-core or Python >= 3.12.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
ROOT = os.path.dirname(TESTS)
ARCHS = ["qwen2_5_vl", "qwen3_vl"]


def _need() -> None:
    from conftest import need_megatron_gpus
    need_megatron_gpus(1)


def _launch(args: list[str], timeout: int = 500) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.abspath(__file__)] + args
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{args[0]} exited {p.returncode}\n" + p.stdout[-4000:] + p.stderr[-4000:]
    return [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_megatron_equals_fsdp_on_vl(tmp_path, arch):
    _need()
    model = str(tmp_path / "vl")
    ref = str(tmp_path / "fsdp.pt")
    _launch(["fsdp", arch, model, ref])
    results = _launch(["megatron", arch, model, ref, str(tmp_path / "saved")])
    print("\n".join(json.dumps(r) for r in results))
    checks = {r["check"]: r for r in results}
    assert set(checks) == {"logprob_parity", "export_exact", "grad_norm", "weights_after_step", "save_hf"}, results
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]


# ---------------------------------------------------------------------------------------------
# the two launches

# FP32 on both sides: the same ops on the same fp32 weights, only reordered sums (packing, attention kernels), as
# harness.FP32_LOGP_TOL / FP32_GRAD_TOL argue for the text families.
LOGP_TOL = dict(mean=1e-4, max=2e-3)
GRAD_TOL = 1e-3
# one Adam step moves a weight by at most ~lr (1e-3), so two runs whose gradients differ by rounding differ by at most
# 2 x lr in the worst (sign-flipped, near-zero gradient) entry; typical entries agree to rounding
STEP_MAX_TOL = 2.5e-3
# ...but a tensor whose gradient were wrong would move by ~lr on most of its entries (Adam's first step is ~lr x the
# gradient's sign), so each tensor's mean difference must stay 10x below that
STEP_MEAN_TOL = 1e-4


def build_vl(model_dir: str, arch: str):
    """The tiny VL model of this test, saved to model_dir (Qwen3-VL: 3 decoder layers and both vision blocks' deepstack
    features, so layers 0 and 1 get them and layer 2 does not); random norms and biases, so a misplaced tensor changes
    the output. Returns (model, processor)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from polyrl.tasks import counting
    if arch == "qwen3_vl":
        model, proc = counting.build_model(model_dir, arch=arch, layers=3)
        cfg = model.config
        cfg.vision_config.deepstack_visual_indexes = [0, 1]
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    else:
        model, proc = counting.build_model(model_dir, arch=arch)
    torch.manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(model_dir)
    return model.eval(), proc


def _batch(proc):
    sys.path.insert(0, TESTS)
    from conftest import image_batch
    return image_batch(proc, text_only=2, rl_fields=True)


def _emit(**kw) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


def _cfgs():
    from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig
    return (lambda d: ModelConfig(hf_checkpoint=d, fp32=True, compile=False)), OptimizerConfig(lr=1e-3, clip_grad=1.0), \
        BatchConfig(micro_batch_size=3)


def _fsdp(arch: str, model_dir: str, out: str) -> None:
    import torch

    from polyrl.backends.fsdp.backend import FSDPBackend
    from polyrl.dist import init_distributed
    from polyrl.multimodal import VisionProcessor
    sys.path.insert(0, HERE)
    from harness import RL

    init_distributed("cuda")
    build_vl(model_dir, arch)
    mcfg, ocfg, bcfg = _cfgs()
    be = FSDPBackend(mcfg(model_dir), ocfg, bcfg, device="cuda", total_steps=10)
    batch = _batch(VisionProcessor.from_pretrained(model_dir))
    logp = be.compute_logprobs(batch)
    m = be.train_step(batch, RL, with_entropy=True)
    hf = {k: v.detach().float().cpu() for k, v in be.export_weights()}
    torch.save({"logp": logp, "grad_norm": m["grad_norm"], "loss": m["loss"], "hf_after": hf}, out)
    _emit(check="fsdp_ref", grad_norm=m["grad_norm"], loss=m["loss"], ok=True)


def _megatron(arch: str, model_dir: str, ref_path: str, save_dir: str) -> None:
    import torch
    from transformers import AutoModelForImageTextToText

    from polyrl.backends.megatron.backend import MegatronBackend
    from polyrl.config import MegatronConfig
    from polyrl.dist import init_distributed
    from polyrl.multimodal import VisionProcessor
    sys.path.insert(0, HERE)
    from harness import RL

    init_distributed("cuda")
    ref = torch.load(ref_path)
    mcfg, ocfg, bcfg = _cfgs()
    be = MegatronBackend(mcfg(model_dir), ocfg, bcfg, device="cuda", total_steps=10, megatron_cfg=MegatronConfig())
    proc = VisionProcessor.from_pretrained(model_dir)
    batch = _batch(proc)
    logp = be.compute_logprobs(batch)
    d = torch.cat([(a - b).abs() for a, b in zip(logp, ref["logp"])])
    _emit(check="logprob_parity", mean_abs=float(d.mean()), max_abs=float(d.max()), tokens=int(d.numel()), tol=LOGP_TOL,
          ok=float(d.mean()) <= LOGP_TOL["mean"] and float(d.max()) <= LOGP_TOL["max"])
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    want = {n: p.detach() for n, p in hf.named_parameters()}  # the tied lm_head is no parameter
    got, bad = set(), []
    for name, t in be.export_weights():
        got.add(name)
        if name not in want or not torch.equal(t.cpu().float(), want[name]):
            bad.append(name)
    missing = sorted(set(want) - got)
    deep = sum(".deepstack_merger_list." in n for n in got)
    _emit(check="export_exact", tensors=len(got), vision=sum(n.startswith("model.visual.") for n in got),
          deepstack=deep, mismatched=bad[:5], missing=missing[:5],
          ok=not bad and not missing and any("visual" in n for n in got) and (deep > 0) == (arch == "qwen3_vl"))
    m = be.train_step(batch, RL, with_entropy=True)
    rel = abs(m["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    _emit(check="grad_norm", grad_norm=m["grad_norm"], fsdp_grad_norm=ref["grad_norm"], rel=rel, loss=m["loss"],
          fsdp_loss=ref["loss"], tol=GRAD_TOL, ok=rel <= GRAD_TOL)
    after = {k: v.detach().float().cpu() for k, v in be.export_weights()}
    diffs = {k: float((after[k] - ref["hf_after"][k]).abs().max()) for k in after if k in ref["hf_after"]}
    means = {k: float((after[k] - ref["hf_after"][k]).abs().mean()) for k in diffs}
    worst, worst_mean = max(diffs, key=diffs.get), max(means, key=means.get)
    # the tower trains: its first weight, and with deepstack the merger feeding decoder layer 1, moved
    probes = ["model.visual.patch_embed.proj.weight"] + (["model.visual.deepstack_merger_list.1.linear_fc2.weight"]
                                                         if arch == "qwen3_vl" else [])
    moved = min(float((after[n] - want[n]).abs().max()) for n in probes)
    _emit(check="weights_after_step", compared=len(diffs), max_abs=diffs[worst], worst=worst,
          worst_tensor_mean_abs=means[worst_mean], worst_mean=worst_mean, vision_moved=moved, tol=STEP_MAX_TOL,
          mean_tol=STEP_MEAN_TOL, ok=len(diffs) == len(after) == len(ref["hf_after"]) and diffs[worst] <= STEP_MAX_TOL
          and means[worst_mean] <= STEP_MEAN_TOL and moved > 0)
    be.save_hf(save_dir, proc.tokenizer)
    back = AutoModelForImageTextToText.from_pretrained(save_dir, dtype=torch.float32)
    same = all(n in after and torch.equal(p.detach(), after[n]) for n, p in back.named_parameters())
    _emit(check="save_hf", same=same, processor=os.path.isfile(os.path.join(save_dir, "preprocessor_config.json")),
          ok=same and os.path.isfile(os.path.join(save_dir, "preprocessor_config.json")))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    mode, *rest = sys.argv[1:]  # mode arch model_dir ...
    {"fsdp": _fsdp, "megatron": _megatron}[mode](*rest)
