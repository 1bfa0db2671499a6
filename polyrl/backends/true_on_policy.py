"""--true-on-policy: one scoring function for a sequence's per-token log-probs, shared by the rollout engine (the
log-probs it reports for each finished sample) and the FSDP backend (its log-prob and training forwards), so that the
two agree bit for bit (docs/true-on-policy.md). On CUDA the GPU engine keeps its own decode for sampling and reports
log-probs from an HF module shell whose parameters are views of its weight buffer (`EngineScorer`): the trainer's module
code over the same BF16 bits, with no weight copy.

Batch invariance by construction, not by special kernels: every sequence is scored alone, as one unpadded row
(batch size 1, positions 0..L-1, causal attention, no mask tensor), so a token's arithmetic depends only on its own
sequence, never on what else shares a generate call, a server batch, a micro-batch or a pack, nor on padding. The LM
head runs on the rows that predict response tokens, then an FP32 log-softmax with the temperature. The remaining
inputs to the arithmetic are the weights (the same FP32 bits on both sides after a sync), the kernels' choice for a
shape (the same shape on both sides) and the thread count, which MKL's GEMM splits its reduction over for some
shapes: `pin_threads` fixes it in every process that scores on CPU (trainer ranks and `polyrl serve`). On CUDA the
same shape on the same device and stream picks the same cuBLAS / FlashAttention kernels, none of which splits its
reduction by anything but the shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# intra-op threads of every process in this mode: GEMM results can depend on the thread count (a 64x8192 @ 8192x512
# product differs by 1.6e-4 between 1 and 2 threads with this MKL), and the trainer ranks and a serve process would
# otherwise each pick their own (cpu_count // ranks, cpu_count)
THREADS = 1


def pin_threads(device: torch.device | str = "cpu") -> None:
    """One intra-op thread on CPU (GPU kernels do not read it; pinning there would only slow the host's work)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(THREADS)


def scoring_attention(requested: str) -> str:
    """The attention implementation both sides score with: one unpadded row carries no cu_seqlens, so varlen kernels
    are out; eager when asked, else SDPA (causal, no mask tensor)."""
    return "eager" if requested == "eager" else "sdpa"


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


def check_sampling(sp, vocab: int) -> None:
    """ValueError for a request whose sampled distribution is not the one the trainer scores."""
    if not sp.greedy and (0 < sp.top_k < vocab or sp.top_p < 1.0):
        raise ValueError("--true-on-policy: top-p / top-k sampling draws from a renormalised distribution, not the "
                         "one the trainer scores; send top_p 1 and top_k -1")


class EngineScorer:
    """The GPU engine's reporter (polyrl.rollout.gpu.engine.GPUEngine.rescore): an HF causal LM built on the meta
    device whose parameters are the engine's HF-named weight views (`weights()` -> name -> tensor), so the log-probs it
    reports come from `sequence_logprobs` over the very bits the engine samples with. Costs no weight memory: only the
    rotary buffers (computed on the CPU, as the trainer's from_pretrained computes them) and one sequence's
    activations. The views are re-read whenever the engine's buffer moved (sleep / wake rebinds them)."""

    def __init__(self, hf_checkpoint: str, weights, *, device: torch.device, dtype: torch.dtype, attn: str = "sdpa"):
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(hf_checkpoint)
        with torch.device("meta"):
            self.lm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=scoring_attention(attn))
        self.lm.eval().requires_grad_(False)
        for name, mod in list(self.lm.named_modules()):
            if any(b.is_meta for b in mod.buffers(recurse=False)):  # rotary inv_freq: rebuilt on the CPU, then moved
                fresh = type(mod)(config=mod.config).to(device)
                parent, _, leaf = name.rpartition(".")
                setattr(self.lm.get_submodule(parent) if parent else self.lm, leaf, fresh)
        self.weights, self.device, self._bound = weights, device, None
        self.sampler_diff: float | None = None  # the largest |decode log-prob - reported log-prob| since stats()
        self.score_s = 0.0

    def _bind(self) -> None:
        views = self.weights()
        key = tuple(v.data_ptr() for v in views.values())
        if key == self._bound:
            return
        tied = getattr(self.lm.config.get_text_config(), "tie_word_embeddings", False)
        for name, p in list(self.lm.named_parameters(remove_duplicate=False)):
            src = views.get(name)
            if src is None and tied and name == "lm_head.weight":
                src = views["model.embed_tokens.weight"]
            if src is None:
                raise KeyError(f"--true-on-policy: the engine has no weight {name!r} for the scoring model")
            if tuple(src.shape) != tuple(p.shape) or src.dtype != p.dtype:
                raise ValueError(f"--true-on-policy: {name}: the engine holds {tuple(src.shape)} {src.dtype}, the "
                                 f"scoring model wants {tuple(p.shape)} {p.dtype}")
            parent, _, leaf = name.rpartition(".")
            self.lm.get_submodule(parent)._parameters[leaf] = torch.nn.Parameter(src, requires_grad=False)
        self._bound = key

    @torch.no_grad()
    def __call__(self, samples: list, sp) -> list:
        """Replace each sample's rollout_logprobs with the scoring function's (the decode's are kept apart only to
        measure how far the sampler was from them)."""
        import time
        check_sampling(sp, self.lm.get_output_embeddings().weight.shape[0])
        t = time.perf_counter()
        self._bind()
        temperature = 0.0 if sp.greedy else sp.temperature
        for s in samples:
            if not s.response_ids:
                continue
            ids = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long).to(self.device, non_blocking=True)
            logp = sequence_logprobs(self.lm, ids, len(s.prompt_ids), temperature=temperature)[0].cpu()
            decoded = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            self.sampler_diff = max(self.sampler_diff or 0.0, float((logp - decoded).abs().max()))
            s.rollout_logprobs = logp.tolist()
        self.score_s += time.perf_counter() - t
        return samples

    def stats(self) -> dict[str, float]:
        """rollout/sampler_logprob_abs_diff_max (the sampler's distance from exact) and rollout/score_s (the scoring
        passes' wall time) since the last call."""
        if self.sampler_diff is None:
            return {}
        out = {"rollout/sampler_logprob_abs_diff_max": self.sampler_diff, "rollout/score_s": self.score_s}
        self.sampler_diff, self.score_s = None, 0.0
        return out


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
    cuda = resolve_device(cfg.cluster.device) != "cpu"
    if not cuda and m.dtype("cpu") != torch.float32:
        raise no("--fp16" if m.fp16 else "--bf16", "on CPU the mode computes in FP32")
    if cuda and m.fp16:
        raise no("--fp16", "on CUDA the mode is proved in BF16 (the default) and FP32")
    if m.attn_implementation not in ("auto", "sdpa", "eager"):
        raise no(f"--attn-implementation {m.attn_implementation}", "every sequence is scored as one unpadded row "
                 "through SDPA (or eager), which reads no packed sequence boundaries")
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
    if cuda and kind != "embedded":
        raise no(f"--rollout-engine {kind} on CUDA", "on CUDA the mode is implemented for the in-process embedded "
                 "engine (the trainer's process and GPU); pass --rollout-engine embedded or --device cpu")
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
