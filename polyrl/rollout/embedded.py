"""The default rollout engine: an HF causal LM in this process, with a batched KV-cache
decode loop of our own (control over seeds, per-token logprobs, stop strings and finish
reasons, and finished rows leave the batch so long tails don't pay for short ones)."""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Iterable, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, DynamicCache

from polyrl import hf_families, multimodal
from polyrl.cpu_governor import tick as cpu_tick
from polyrl.rollout.base import GenerateWatch, InProcessEngine, wake_tags
from polyrl.rollout.detokenize import decode_all
from polyrl.rollout.gpu import ops
from polyrl.rollout.lengths import FORCED_LOGPROB, mark_forced
from polyrl.rollout.sampling import sample_seed
from polyrl.types import Sample, SamplingParams

log = logging.getLogger(__name__)

# transformers 5 warns on every forward given `past_key_values` (it prefers `cache`), in every process, at each decode
# step; the decode loop passes the name every supported transformers version takes. A filter on that one message:
# catch_warnings around the call would race between a server's threads.
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated", category=FutureWarning)


class _Scored(GenerateWatch):
    """A caller's watch whose stop is kept and whose finished() reports wait for the --true-on-policy scoring pass."""

    def __init__(self, watch: GenerateWatch) -> None:
        self.stop = watch.stop


class EmbeddedEngine(InProcessEngine):
    def __init__(self, hf_checkpoint: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "sdpa", max_batch: int = 0, true_on_policy: bool = False):
        """true_on_policy: report each finished sample's log-probs from polyrl.backends.true_on_policy's scoring
        function, the trainer's (the sampler itself draws from the KV-cache decode's logits)."""
        self.true_on_policy = true_on_policy
        self._sampler_diff = None  # true_on_policy: the largest |decode log-prob - scored log-prob| since stats()
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        if true_on_policy:
            from polyrl.backends.true_on_policy import pin_threads
            pin_threads(self.device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(hf_checkpoint)
        # vision-language checkpoints: the HF class with the vision tower, and the processor that makes pixel inputs
        self.processor = multimodal.VisionProcessor.from_pretrained(hf_checkpoint, self.tokenizer)
        auto = AutoModelForImageTextToText if self.processor is not None else AutoModelForCausalLM
        attn = attn_implementation if attn_implementation in ("sdpa", "eager") else "sdpa"
        config = AutoConfig.from_pretrained(hf_checkpoint)
        if hf_families.dense_attention_reason(config) is not None:
            attn = "eager"  # attention sinks (GPT-OSS): SDPA has none
        # MXFP4 experts dequantized: the trainer's weight sync sends them under their unquantized names
        self.model = auto.from_pretrained(hf_checkpoint, dtype=dtype, attn_implementation=attn,
                                          **hf_families.dequantized_load(config)).to(self.device).eval()
        self.model.requires_grad_(False)
        if true_on_policy:  # its scoring pass runs the trainer's fixed-block arithmetic; generation stays as it is
            from polyrl.backends.true_on_policy import prepare
            prepare(self.model)
        # the context: a row stops ("length") when its prompt and response fill it, as SGLang's scheduler cuts them
        self.max_len = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.max_batch = max_batch
        self.version = 0
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # sigmoid-routed MoE (DeepSeek-V3, GLM4-MoE): the router's correction bias is a buffer that the
        # Megatron backend's export carries with the weights
        self._params.update((n, b) for n, b in self.model.named_buffers() if n.endswith("e_score_correction_bias"))
        # stacked MoE experts are also written and read by their per-expert names (what the FP8 stream and checkpoints
        # carry): HF name -> (stacked name, expert, first row, rows), resolved on use (sleep moves the parameters)
        from polyrl.weight_sync.quantize import TRANSPOSED_EXPERTS, stacked_expert_parts
        self._expert_rows: dict[str, tuple[str, int, int, int]] = {}
        if getattr(config, "model_type", None) not in TRANSPOSED_EXPERTS:
            for n, p in list(self._params.items()):
                parts = stacked_expert_parts(n, p) or []
                per = len(parts) // p.shape[0] if parts else 1
                for i, m in enumerate(parts):
                    e, j = divmod(i, per)
                    rows = p.shape[1] // per
                    self._expert_rows[m + ".weight"] = (n, e, j * rows, rows)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        from polyrl.backends.routing_replay import MoERouting
        self.routing = MoERouting.attach(self.model)  # MoE: records the routes a request asks for (idle otherwise)

    reports_top_logprobs = True

    @property
    def reports_routed_experts(self) -> bool:
        """Whether generate() can fill Sample.routed_experts (SamplingParams.return_routed_experts)."""
        return self.routing is not None

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 should_stop: Callable[[int], bool] | None = None, images: list[list | None] | None = None,
                 watch: GenerateWatch | None = None) -> list[Sample]:
        """should_stop(prompt index): asked between decode steps; True drops that prompt's rows (finish reason
        "abort", the tokens so far kept), so an aborted or expired server request stops costing compute.
        watch: told of each sample as it finishes; its stop ends every unfinished row the same way.
        images[i]: prompt i's images (paths, data URLs or PIL images; None: text only), whose expanded image tokens the
        prompt holds; its samples carry the pixel inputs (Sample.multimodal)."""
        for i, p in enumerate(prompts):
            if self.max_len and len(p) >= self.max_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is {self.max_len} tokens, which "
                                 "leaves no room for a response (shorten it or set --rollout-max-prompt-len)")
        mms = self._pixel_inputs(prompts, images)
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        # (prompt index, prompt, sample seed): each sample draws from its own counter-based stream (the GPU path's
        # scheme), so a sample does not depend on the batch it ran in, nor on which server ran it
        flat = [(i, p, sample_seed(params, base, i, j)) for i, p in enumerate(prompts) for j in range(params.n)]
        # per sample: (budget, stop length): a resumed partial response has its own budget; 0: no forced EOS
        limits = [(params.max_new_tokens_of(i), params.stop_length_of(i, j)) for i in range(len(prompts))
                  for j in range(params.n)]
        step = self.max_batch or len(flat)
        if self.true_on_policy and not params.greedy and (0 < params.top_k < logits_dim(self.model) or params.top_p < 1.0):
            raise ValueError("--true-on-policy: top-p / top-k sampling draws from a renormalised distribution, not the "
                             "one the trainer scores; send top_p 1 and top_k -1")
        out: list[Sample] = []
        try:
            for s in range(0, len(flat), step):
                if watch is not None and watch.stop.is_set():  # stopped before these rows started: nothing generated
                    out.extend(Sample(prompt_ids=list(p), response_ids=[], rollout_logprobs=[], finish_reason="abort",
                                      group_index=g) for g, p, _ in flat[s:s + step])
                    continue
                if not self.true_on_policy:
                    out.extend(self._generate_batch(flat[s:s + step], params, should_stop, mms, limits[s:s + step], watch, s))
                    continue
                # a sample is reported once scored: until then it carries the decode's log-probs, not the trainer's
                held = _Scored(watch) if watch is not None else None
                batch = self._score(self._generate_batch(flat[s:s + step], params, should_stop, mms, limits[s:s + step],
                                                         held, s), params)
                for k, smp in enumerate(batch if watch is not None else []):
                    if smp.finish_reason != "abort":
                        watch.finished(s + k, smp)
                out.extend(batch)
        finally:
            if self.routing is not None:  # a failed request must not leave its route recording armed
                self.routing.end()
        return out

    def _pixel_inputs(self, prompts: list[list[int]], images: list[list | None] | None) -> list[dict | None]:
        if images is None or all(x is None for x in images):
            return [None] * len(prompts)
        if self.processor is None:
            raise ValueError("image prompts: this engine's model is not a vision-language model")
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} image lists for {len(prompts)} prompts")
        out = []
        for ids, imgs in zip(prompts, images):
            mm = self.processor.pixel_inputs(imgs) if imgs else None
            if mm is not None or self.processor.image_token_id in ids:
                self.processor.check(ids, mm["image_grid_thw"] if mm is not None else torch.zeros(0, 3, dtype=torch.long))
            out.append(mm)
        return out

    def _vision_prefill(self, flat, ids: torch.Tensor, mms: list[dict | None]) -> tuple[dict, torch.Tensor]:
        """The prefill's pixel inputs and multimodal RoPE positions [3, B, P] (left padding at 0)."""
        mms = [mms[g] for g, _, _ in flat]
        B, P = ids.shape
        pos3 = torch.zeros(3, B, P, dtype=torch.long, device=self.device)
        for r, (_, p, _) in enumerate(flat):
            grid = mms[r]["image_grid_thw"] if mms[r] is not None else None
            pos3[:, r, P - len(p):] = multimodal.mrope_positions(self.model, ids[r, P - len(p):], grid,
                                                                 self.processor.image_token_id)
        return multimodal.concat_inputs(mms, self.device), pos3

    @torch.no_grad()
    def _generate_batch(self, flat: list[tuple[int, list[int], int]], sp: SamplingParams,
                        should_stop: Callable[[int], bool] | None = None, mms: list | None = None,
                        limits: list[tuple[int, int]] | None = None, watch: GenerateWatch | None = None,
                        offset: int = 0) -> list[Sample]:
        B = len(flat)
        limits = limits or [(sp.max_new_tokens, 0)] * B
        max_new = max(m for m, _ in limits)
        lens = [len(p) for _, p, _ in flat]
        P = max(lens)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, P, dtype=torch.long)
        for r, (_, p, _) in enumerate(flat):  # left padding keeps every row's next token at the end
            ids[r, P - len(p):] = torch.tensor(p)
            attn[r, P - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        stop_ids = set(sp.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        stop_t = torch.tensor(sorted(stop_ids), device=self.device, dtype=torch.long)
        seeds = torch.tensor([sd for _, _, sd in flat], dtype=torch.long, device=self.device)
        inv_temp = torch.full((B,), 1.0 if sp.greedy else 1.0 / sp.temperature, device=self.device)
        noise = torch.full((B,), 0 if sp.greedy else 1, dtype=torch.long, device=self.device)
        counters = torch.tensor(lens, dtype=torch.long, device=self.device)  # the position being sampled
        filtered = not sp.greedy and (0 < sp.top_k < logits_dim(self.model) or sp.top_p < 1.0)
        if sp.return_routed_experts and self.routing is None:
            raise ValueError("return_routed_experts: this model has no MoE router to report")
        # SGLang's routed_experts: every forwarded token (the prompt, then each sampled token but the last)
        routes: list[list[torch.Tensor]] | None = [[] for _ in range(B)] if sp.return_routed_experts else None

        text_cfg = self.model.config.get_text_config()
        # hybrid linear-attention models (Qwen3.5) keep recurrent states: the cache is laid out from the config
        cache = DynamicCache(config=text_cfg) if "linear_attention" in (getattr(text_cfg, "layer_types", None) or ()) \
            else DynamicCache()
        vision, pixels = self.processor is not None, {}
        if vision:  # Qwen-VL: 3D positions over the image tokens, text positions after them continue from the largest
            pixels, pos = self._vision_prefill(flat, ids, mms)
        if routes is not None:
            self.routing.begin_at([r * P + torch.arange(P - lens[r], P) for r in range(B)], B * P, self.device,
                                  record=True, count=False)
        # the n samples of a prompt sit side by side: text prompts are prefilled once each and the cache rows and last
        # logits copied to their samples (a GRPO group of 4 paid four prefills of one prompt, most of a short rollout)
        firsts = [r for r in range(B) if r == 0 or flat[r][0] != flat[r - 1][0]]
        shared = routes is None and not vision and len(firsts) < B
        rows_in = torch.tensor(firsts, device=self.device) if shared else slice(None)
        logits = self.model(input_ids=ids[rows_in], attention_mask=attn[rows_in], position_ids=pos[rows_in],
                            past_key_values=cache, use_cache=True, logits_to_keep=1,
                            **pixels).logits[:, -1]  # not [B, P, vocab] logits
        if shared:
            is_first = torch.zeros(B, dtype=torch.long)
            is_first[firsts] = 1
            owner = (is_first.cumsum(0) - 1).to(self.device)  # row -> its prompt's row in the prefill
            cache.reorder_cache(owner)
            logits = logits.index_select(0, owner)
        if routes is not None:
            for r, x in enumerate(self.routing.recorded(drop_last=False)):
                routes[r].append(x)
        rows = torch.arange(B)  # live row -> original row
        # the next position is one past the row's largest: text after images continues from there (Qwen's rope deltas)
        next_pos = (pos.amax(dim=(0, 2)) if vision else pos[:, -1]) + 1
        responses: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        k_top = min(sp.top_logprobs, logits_dim(self.model))
        tops: list[list[list[tuple[int, float]]]] | None = [[] for _ in range(B)] if k_top > 0 else None
        finish = ["length"] * B
        built: dict[int, Sample] = {}  # rows handed to the watch as they finished
        eos = self.tokenizer.eos_token_id
        streams = watch is not None and watch.streams
        # image / video pads are placeholders, never text: a sampled one would take the place of an image feature in the
        # trainer's forward (transformers scatters image features into every pad of the sequence)
        never = (torch.tensor(self.processor.placeholder_ids, device=self.device) if vision else None)
        for t in range(max_new):
            cpu_tick()  # a single-process CPU run's thread count follows the machine's load (polyrl.cpu_governor)
            self.count_decode_step(len(rows))
            if never is not None:
                logits = logits.index_fill(1, never, float("-inf"))
            thresh = (ops.filter_thresholds(logits, inv_temp, sp.top_k, sp.top_p) if filtered
                      else torch.full_like(inv_temp, float("-inf")))
            tok, lp = ops.sample(logits, inv_temp, noise, thresh, seeds, counters)
            done = torch.isin(tok, stop_t)
            tok_l, lp_l, done_l = tok.tolist(), lp.tolist(), done.tolist()
            if tops is not None:  # the alternatives under the distribution the token was drawn from (as its log-prob)
                tv, ti = torch.log_softmax(logits.float() * inv_temp[:, None], -1).topk(k_top, -1)
                for r, ids_r, lps_r in zip(rows.tolist(), ti.tolist(), tv.tolist()):
                    tops[r].append(list(zip(ids_r, lps_r)))
            for j, r in enumerate(rows.tolist()):
                budget, stop_len = limits[r]
                if stop_len and len(responses[r]) + 1 == stop_len and eos is not None:
                    tok_l[j], lp_l[j], done_l[j] = eos, FORCED_LOGPROB, True  # the drawn length: EOS, nothing else changed
                responses[r].append(tok_l[j])
                logps[r].append(lp_l[j])
                if streams:
                    watch.token(offset + r, tok_l[j])
                if done_l[j]:
                    finish[r] = "stop"
                elif sp.stop and self._hit_stop_string(responses[r], sp.stop):
                    finish[r] = "stop"
                    done_l[j] = True
                elif self.max_len and lens[r] + len(responses[r]) >= self.max_len:
                    done_l[j] = True  # the context is full: "length"
                elif len(responses[r]) >= budget:
                    done_l[j] = True  # its own budget (a resumed response's): "length"
                if done_l[j] and watch is not None:
                    built[r] = self._sample(flat, r, responses, logps, finish, routes, mms, limits, tops=tops)
                    watch.finished(offset + r, built[r])
            stopped = watch is not None and watch.stop.is_set()
            if should_stop is not None or stopped:
                for j, r in enumerate(rows.tolist()):
                    if not done_l[j] and (stopped or should_stop(flat[r][0])):
                        finish[r] = "abort"
                        done_l[j] = True
            keep = [j for j, d in enumerate(done_l) if not d]
            if not keep or t == max_new - 1:
                break
            if len(keep) < len(done_l):  # drop finished rows from the batch and the cache
                kt = torch.tensor(keep, device=self.device)
                # reorder_cache with a subset keeps those rows in every layer type (linear-attention states included),
                # where batch_select_indices exists only on key/value layers
                cache.reorder_cache(kt)
                rows, tok, attn, next_pos = rows[kt.cpu()], tok[kt], attn[kt], next_pos[kt]
                seeds, inv_temp, noise, counters = seeds[kt], inv_temp[kt], noise[kt], counters[kt]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
            if routes is not None:
                self.routing.begin_at(list(torch.arange(len(rows))[:, None]), len(rows), self.device, record=True,
                                      count=False)
            step_pos = next_pos[None, :, None].expand(3, -1, -1) if vision else next_pos[:, None]
            logits = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=step_pos,
                                past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            if routes is not None:
                for r, x in zip(rows.tolist(), self.routing.recorded(drop_last=False)):
                    routes[r].append(x)
            next_pos = next_pos + 1
            counters = counters + 1
        rest = [r for r in range(B) if r not in built]
        texts = dict(zip(rest, decode_all(self.tokenizer, [responses[r] for r in rest])))
        return [built[r] if r in built else self._sample(flat, r, responses, logps, finish, routes, mms, limits, texts[r], tops)
                for r in range(B)]

    def _sample(self, flat, r: int, responses, logps, finish, routes, mms, limits, text: str | None = None,
                tops: list | None = None) -> Sample:
        g, p, _ = flat[r]
        if text is None:
            text = self.tokenizer.decode(responses[r], skip_special_tokens=True)
        s = Sample(prompt_ids=list(p), response_ids=responses[r], rollout_logprobs=logps[r], finish_reason=finish[r],
                   group_index=g, response=text, routed_experts=torch.cat(routes[r]) if routes is not None else None,
                   multimodal=mms[g] if mms is not None else None, top_logprobs=tops[r] if tops is not None else None)
        mark_forced(s, limits[r][1])
        return s

    @torch.no_grad()
    def _score(self, samples: list[Sample], sp: SamplingParams) -> list[Sample]:
        """--true-on-policy: each sample's rollout log-probs from the scoring function the trainer runs."""
        from polyrl.backends.true_on_policy import report, score_samples
        todo = [s for s in samples if s.response_ids]
        routing = self.routing if sp.return_routed_experts else None  # R3: the routes of this pass, not the decode's
        worst = report(todo, score_samples(self.model, todo, 0.0 if sp.greedy else sp.temperature, self.device,
                                           routing=routing))
        self._sampler_diff = max(self._sampler_diff or 0.0, worst)
        return samples

    def score_trajectories(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """--true-on-policy: each sample's rollout log-probs, over its whole response, from the trainer's scoring
        function: an agent's sample, assembled from several calls (each scored alone) and the tokens between them."""
        if not self.true_on_policy:
            raise RuntimeError("score_trajectories: this engine was not built with true_on_policy")
        return self._score(samples, params)

    def stats(self) -> dict[str, float]:
        """--true-on-policy: rollout/sampler_logprob_abs_diff_max, how far the sampler's (KV-cache decode) log-probs of
        the sampled tokens were from the reported ones since the last call: the sampler's distance from exact."""
        out = self.occupancy_stats()
        if self._sampler_diff is not None:
            out["rollout/sampler_logprob_abs_diff_max"], self._sampler_diff = self._sampler_diff, None
        return out

    def _hit_stop_string(self, response: list[int], stops: list[str]) -> bool:
        tail = self.tokenizer.decode(response[-16:], skip_special_tokens=True)  # a stop string ends in the tail
        return any(s in tail for s in stops)

    # ---- weights & memory ----------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        seen = 0
        for name, tensor in weights:
            try:
                param = self._param(name)
            except KeyError:
                raise KeyError(f"weight sync sent {name!r}, which the rollout model does not have") from None
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            seen += 1
        self.version = version
        log.debug("engine weights updated to version %d (%d tensors)", version, seen)

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            self.release_cached_memory()

    def wake(self, tags: Sequence[str] | None = None) -> None:
        if self.device.type == "cuda" and "weights" in wake_tags(tags):  # transformers' generate has no KV pool to take
            self.model.to(self.device)

    # ---- reading weights back (engine servers: /get_weights_by_name, --check-weight-update-equal) ----
    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every weight update_weights accepts."""
        return {n: tuple(self._param(n).shape) for n in [*self._params, *self._expert_rows]}

    def get_weight(self, name: str) -> torch.Tensor:
        """A CPU copy of one HF-named weight, in the engine's dtype."""
        return self._param(name).detach().to("cpu", copy=True)

    def _param(self, name: str) -> torch.Tensor:
        """The parameter, or the rows of a stacked expert tensor that a per-expert name stands for."""
        if name in self._expert_rows:
            stacked, e, r0, rows = self._expert_rows[name]
            return self._params[stacked][e, r0:r0 + rows]
        return self._params[name]


def logits_dim(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def make_embedded_engine(hf_checkpoint: str, *, device: str = "cpu", gpu_engine: bool = True, mem_fraction: float = 0.4,
                         cuda_graph: bool = True, quantization: str = "none", kv_cache_dtype: str = "auto",
                         **kw) -> InProcessEngine:
    """On CUDA, Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints get the GPU path (polyrl.rollout.gpu: paged KV cache,
    continuous batching, CUDA graphs; gpu_engine, mem_fraction and cuda_graph are its settings); anything else, and
    every CPU run, the transformers path (EmbeddedEngine)."""
    if device != "cpu" and gpu_engine:
        from polyrl.rollout.gpu import GPUEngine, unsupported_reason
        why = unsupported_reason(hf_checkpoint)
        if why is None:
            eng = GPUEngine(hf_checkpoint, device=device, mem_fraction=mem_fraction, cuda_graph=cuda_graph,
                            quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                            **{k: v for k, v in kw.items() if k in ("dtype", "max_batch")})
            if kw.get("true_on_policy"):  # it samples with its own kernels and reports the trainer's scoring
                from polyrl.backends.true_on_policy import EngineScorer
                eng.rescore = EngineScorer(hf_checkpoint, lambda: eng.model.hf, device=eng.device, dtype=eng.dtype,
                                           cuda_graph=eng.cuda_graph)
            return eng
        if kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {kv_cache_dtype}: the embedded engine's GPU path does not support "
                             f"{hf_checkpoint} ({why}), and its transformers path keeps no paged KV cache")
        log.warning("embedded engine: using the transformers path on %s because the GPU path does not support %s: %s",
                    device, hf_checkpoint, why)
    elif kv_cache_dtype != "auto":
        where = "on CPU" if device == "cpu" else "with --no-rollout-gpu-engine"
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} {where}: only the embedded engine's GPU path (CUDA) keeps "
                         "a paged KV cache; drop the flag")
    return EmbeddedEngine(hf_checkpoint, device=device, **kw)


def embedded_engine_kwargs(cfg) -> dict:
    """The embedded engine's settings from the config (also what `polyrl serve` runs)."""
    r = cfg.rollout
    return dict(max_batch=r.rollout_batch_generate, gpu_engine=r.rollout_gpu_engine, mem_fraction=r.rollout_mem_fraction,
                cuda_graph=r.rollout_cuda_graph, true_on_policy=cfg.model.true_on_policy,
                quantization=r.rollout_quantization, kv_cache_dtype=r.kv_cache_dtype)


def engine_from_config(cfg, device: str) -> InProcessEngine:
    """The engine of --rollout-engine embedded (and of `polyrl serve`)."""
    return make_embedded_engine(cfg.model.hf_checkpoint, device=device, dtype=cfg.model.dtype(device),
                                attn_implementation=cfg.model.attn_implementation, **embedded_engine_kwargs(cfg))
