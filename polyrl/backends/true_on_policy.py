"""--true-on-policy: one scoring function for a sequence's per-token log-probs, shared by the rollout engine (the
log-probs it reports for each finished sample) and the FSDP backend (its log-prob and training forwards), so that the
two agree bit for bit (docs/true-on-policy.md).

Batch invariance by construction, not by special kernels: every sequence is scored alone, as one unpadded row
(batch size 1, positions 0..L-1, causal attention, no mask tensor), so a token's arithmetic depends only on its own
sequence, never on what else shares a generate call, a server batch, a micro-batch or a pack, nor on padding. The LM
head runs on the rows that predict response tokens, then an FP32 log-softmax with the temperature. The remaining
inputs to the arithmetic are the weights (the same FP32 bits on both sides after a sync), the kernels' choice for a
shape (the same shape on both sides) and the thread count, which MKL's GEMM splits its reduction over for some
shapes: `pin_threads` fixes it in every process that scores (trainer ranks and `polyrl serve`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# intra-op threads of every process in this mode: GEMM results can depend on the thread count (a 64x8192 @ 8192x512
# product differs by 1.6e-4 between 1 and 2 threads with this MKL), and the trainer ranks and a serve process would
# otherwise each pick their own (cpu_count // ranks, cpu_count)
THREADS = 1


def pin_threads() -> None:
    torch.set_num_threads(THREADS)


def sequence_logprobs(lm: torch.nn.Module, ids: torch.Tensor, prompt_len: int, *, temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm: an HF causal LM; ids: [L] prompt + response -> log-probs [L - P] (fp32) of the response tokens under
    softmax(logits / temperature) (temperature 0, greedy: 1), and their entropy [L - P] | None. Differentiable."""
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    L = ids.numel()
    base = getattr(lm, lm.base_model_prefix)
    hidden = base(input_ids=ids[None], position_ids=torch.arange(L, device=ids.device)[None],
                  use_cache=False).last_hidden_state[0]
    head = lm.get_output_embeddings()
    z = F.linear(hidden[prompt_len - 1:L - 1], head.weight, head.bias).float()
    if inv_temp != 1.0:
        z = z * inv_temp
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(1, ids[prompt_len:, None]).squeeze(1)
    if not with_entropy:
        return logp, None
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def sequences_logprobs(lm: torch.nn.Module, sequences: list[tuple[torch.Tensor, int]], *, temperature: float,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sequence_logprobs of each (ids, prompt_len), one forward per sequence, concatenated: [sum of L_i - P_i]."""
    out = [sequence_logprobs(lm, ids, p, temperature=temperature, with_entropy=with_entropy) for ids, p in sequences]
    logp = torch.cat([lp for lp, _ in out])
    return logp, torch.cat([e for _, e in out]) if with_entropy else None


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
    if resolve_device(cfg.cluster.device) != "cpu":
        raise no(f"--device {cfg.cluster.device} (CUDA)", "the mode is implemented on CPU only for now (FP32, the "
                 "transformers path); pass --device cpu")
    if m.dtype("cpu") != torch.float32:
        raise no("--fp16" if m.fp16 else "--bf16", "the mode computes in FP32")
    if m.compile:
        raise no("--compile", "compiled kernels would differ between the engine's and the trainer's forwards")
    if m.lora_rank:
        raise no("--lora-rank", "the engine runs merged weights while the trainer adds the adapters, a different "
                 "arithmetic")
    if command not in ("train", "eval"):
        return
    kind = engine_kind(cfg)
    if "true_on_policy" not in ENGINE_CAPABILITIES[kind]:
        shown = {"external": "--rollout-external", "none": "--debug-train-only"}.get(kind, f"--rollout-engine {kind}")
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
    if cfg.data.multimodal_keys:
        raise no("--multimodal-keys", "the scoring function reads token ids only, not pixel inputs")
    if r.rollout_max_context_len is not None:
        raise no("--rollout-max-context-len", "a sample cut after generation is not the sequence the engine scored")
