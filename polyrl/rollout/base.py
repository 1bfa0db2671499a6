"""RolloutEngine protocol and the lazy engine table."""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any, Iterable, Protocol, Sequence

import torch

from polyrl.types import Sample, SamplingParams

ENGINES = {  # engine kind (polyrl.placement.engine_kind) -> factory(cfg, device) building it
    "embedded": "polyrl.rollout.embedded:engine_from_config",
    "server": "polyrl.rollout.http_engine:HTTPEngine",
    "sglang": "polyrl.rollout.http_engine:HTTPEngine",
    "external": "polyrl.rollout.http_engine:HTTPEngine",
}


# What each engine kind honours (polyrl/capabilities.py maps flags to these; a flag whose capability the chosen kind
# lacks is refused at start-up). "none" is --debug-train-only's: no engine, its samples come from files.
ENGINE_CAPABILITIES: dict[str, frozenset[str]] = {
    # "fp8_rollout": loads the block-FP8 weight stream of --rollout-quantization fp8 (dequantized: it samples from the
    # FP8-rounded weights with its own matmuls; polyrl.weight_sync.quantize)
    # "images": generate(..., images=) takes image prompts (SGLang's image_data over HTTP)
    # "true_on_policy": reports log-probs from polyrl.backends.true_on_policy's scoring function (--true-on-policy)
    # "mem_fraction": --rollout-mem-fraction sizes its KV cache (SGLang: --mem-fraction-static)
    # "kv_cache_dtype": keeps its KV cache in --kv-cache-dtype (the embedded engine's GPU path; SGLang's own flag)
    # "partial_rollout": generate(..., watch=) reports finished samples and returns partial responses on a stop
    # (SGLang: /abort_request answers with the tokens so far); "length_control": honours SamplingParams.stop_lengths
    "embedded": frozenset({"embedded_settings", "mem_fraction", "routed_experts", "memory_tags", "fp8_rollout", "images",
                           "true_on_policy", "kv_cache_dtype", "partial_rollout", "length_control"}),
    "server": frozenset({"servers", "launch", "embedded_settings", "mem_fraction", "fault_tolerance", "weight_read_back", "router",
                         "routed_experts", "memory_tags", "fp8_rollout", "images", "true_on_policy", "kv_cache_dtype",
                         "partial_rollout", "length_control"}),
    # sglang "fp8_rollout": launched on a block-FP8 copy of the checkpoint (polyrl.weight_sync.fp8_checkpoint)
    "sglang": frozenset({"servers", "launch", "sglang_args", "mem_fraction", "fault_tolerance", "weight_read_back", "router",
                         "routed_experts", "memory_tags", "images", "fp8_rollout", "kv_cache_dtype",
                         "partial_rollout"}),
    # "attach": waits --rollout-external-startup-timeout for servers it did not start
    "external": frozenset({"attach", "servers", "fault_tolerance", "weight_read_back", "router", "routed_experts", "memory_tags",
                           "images", "partial_rollout"}),
    "none": frozenset(),
}

MEMORY_TAGS = ("weights", "kv_cache")  # SGLang's /resume_memory_occupation tags the engines honour


def wake_tags(tags: Sequence[str] | None) -> set[str]:
    """The parts of the GPU memory a wake() takes back: every part for None, else the named ones."""
    if tags is None:
        return set(MEMORY_TAGS)
    bad = set(tags) - set(MEMORY_TAGS)
    if bad:
        raise ValueError(f"unknown memory tags {sorted(bad)}; valid: {', '.join(MEMORY_TAGS)}")
    return set(tags)


# what an engine without top alternatives (the GPU engine) answers a request for them, wherever it is asked
NO_TOP_LOGPROBS = ("top_logprobs: this engine reports the sampled token's log-prob only (the GPU engine; the "
                   "transformers path, --no-rollout-gpu-engine, reports the top alternatives)")


class GenerateWatch:
    """What a caller of generate() may follow and decide while it runs (--partial-rollout, streaming groups): each
    sample as it finishes, and a stop. Engines call finished() on their own thread; after stop is set they return every
    unfinished sample at its next decode step with the tokens it has (finish reason "abort", SGLang's /abort_request)."""

    streams = False  # True: the in-process engines also call token() for every token as it is sampled

    def __init__(self) -> None:
        self.stop = threading.Event()

    def finished(self, index: int, sample: Sample) -> None:
        """Sample `index` of the call (prompt index * n + sample index) finished ("stop" or "length")."""

    def token(self, index: int, token_id: int) -> None:
        """Sample `index` has this token now (its next response token; streaming clients), on the engine's thread."""


class RolloutEngine(Protocol):
    """What the loops, the transports and the evaluator use of an engine (in process, or servers behind a client)."""

    version: int  # the weight version (trainer step) it holds
    concurrent_update: bool  # update_weights may run while a generate is in flight (the async loop relies on it)
    tokenizer: Any  # the HF tokenizer of its model (custom generate functions and cut responses decode with it)
    reports_top_logprobs: bool  # generate() fills Sample.top_logprobs when asked (SamplingParams.top_logprobs)

    def generate(self, prompts: list[list[int]], params: SamplingParams, watch: GenerateWatch | None = None) -> list[Sample]:
        """params.n samples per prompt, grouped: samples[i * n + j] answers prompts[i]
        (group_index i); each carries response ids, per-token logprobs and finish reason. watch: see GenerateWatch
        (engines whose capabilities hold "partial_rollout")."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load an HF-named stream in place; `version` is the trainer step it came from. An in-process engine may
        call the stream's `copy_into(views)` (polyrl.weight_sync.WeightExport) instead of iterating it."""

    def sleep(self) -> None:
        """Give the GPU to the trainer (shared devices); a no-op where nothing is shared."""

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take the GPU back, all of it (None) or the MEMORY_TAGS named: ("weights",) first lets a weight update land
        while the trainer still holds its own GPU copy, ("kv_cache",) after the trainer has left (SGLang's tags)."""

    def stats(self) -> dict[str, float]:
        """Counters since the last call (e.g. retries, restarts of engine servers), logged with the step."""

    def close(self) -> None:
        """Stop what the engine started (launched servers, router); idempotent."""


class ServedEngine(RolloutEngine, Protocol):
    """An in-process engine that `polyrl serve` runs: what the server reads beyond RolloutEngine."""

    device: torch.device
    dtype: torch.dtype
    max_len: int | None  # most tokens a sequence may hold (prompt + response), None: the model config's
    reports_routed_experts: bool  # generate() fills Sample.routed_experts when asked
    processor: Any  # polyrl.multimodal.VisionProcessor of a vision-language model (generate takes images), else None
    asleep: bool  # sleep() released its weights: updates land, generation waits for wake()

    def get_weight(self, name: str) -> torch.Tensor:
        """The engine's current copy of one HF-named weight (read-back for --check-weight-update-equal)."""

    def score_trajectories(self, samples: list[Sample], params: SamplingParams) -> list[Sample]:
        """--true-on-policy (capability "true_on_policy"): replace each sample's rollout_logprobs with the trainer's
        scoring function's over its whole response (an agent's sample, assembled from several calls)."""


class ServerEngines(RolloutEngine, Protocol):
    """Engine servers behind one client (polyrl.rollout.http_engine.HTTPEngine): what the server transports use."""

    http: Any  # the HTTP client holding the servers' key
    membership: int  # changes when a server is restarted: a transport rebuilds its group
    fault_tolerant: bool
    shares_devices: bool  # the servers run on the trainer's GPUs (placement plan `shared`)

    def weight_sync_urls(self) -> list[str]:
        """Servers that must receive the next weights: every live one (a restarted one once it holds the current ones)."""

    def weights_pushed(self, version: int, urls: list[str] | None = None) -> None:
        """Record that these servers (None: all) now hold weights `version`."""

    def lost_during_sync(self, urls: list[str], why: str, since: int) -> list[str]:
        """Servers of `urls` found dead, hung, or restarted since `membership` was `since`, during a push that
        failed with `why` (raises without fault tolerance)."""

    def set_weight_source(self, source, transport) -> None:
        """How a restarted server gets the current weights: source() -> (stream, version), pushed by transport."""


class InProcessEngine:
    """What an engine in the trainer's process has nothing to say about."""

    concurrent_update = False  # one model in this process: a weight update must wait for the running generate
    max_len: int | None = None  # the GPU path's position limit; None: the model config's max_position_embeddings
    asleep = False  # the GPU path after sleep(): weights released until wake()
    reports_routed_experts = False  # MoE engines that record routes override this
    reports_top_logprobs = False  # engines that report the top alternatives of each sampled token override this
    processor = None  # vision-language models: the polyrl.multimodal.VisionProcessor that makes the pixel inputs
    # True when the trainer runs in this process (polyrl.assemble.build_engine): sleep() then leaves what it frees in PyTorch's
    # caching allocator, where the train phase's allocations find it, instead of handing it back to the CUDA driver.
    # Emptying the cache also dropped the trainer's cached blocks, so every train phase paid a few hundred cudaMallocs
    # and every wake re-mapped the KV cache (GRPO 16x8x256 on one H100, bench/history/2026-11.md, 2026-11-24:
    # 1.5B weight sync 0.162 -> 0.021 s; 0.5B train phase 0.317-0.375 -> 0.292-0.301 s in alternated runs, together with
    # the GPU engine's sleep changes). An engine in its own process (polyrl serve) keeps giving memory back: a trainer in
    # another process could not use its cache.
    shares_allocator = False
    # the bench's occupancy trace: a list makes every decode step append (time.perf_counter(), sequences decoding)
    trace: list | None = None
    _occupancy: tuple[int, int] = (0, 0)  # (decode steps, sequences decoding summed over them) since stats()

    def count_decode_step(self, rows: int) -> None:
        """Every decode step: how many sequences it decodes (rollout/occupancy_mean; the trace when one is set)."""
        steps, total = self._occupancy
        self._occupancy = (steps + 1, total + rows)
        if self.trace is not None:
            self.trace.append((time.perf_counter(), rows))

    def occupancy_stats(self) -> dict[str, float]:
        """rollout/decode_steps and rollout/occupancy_mean (sequences decoding per decode step) since the last call: a
        long tail shows as many steps at a low occupancy."""
        (steps, total), self._occupancy = self._occupancy, (0, 0)
        return {"rollout/decode_steps": float(steps), "rollout/occupancy_mean": total / steps} if steps else {}

    def release_cached_memory(self) -> None:
        """After sleep() freed the engine's tensors: hand the cached memory to the driver unless the trainer shares it."""
        if not self.shares_allocator and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def load_engine_factory(kind: str):
    """factory(cfg, device) of an engine kind; imported only when chosen (servers need aiohttp, the GPU path Triton)."""
    try:
        module, name = ENGINES[kind].split(":")
    except KeyError:
        raise ValueError(f"engine kind {kind!r} is unknown; choose one of {', '.join(ENGINES)}") from None
    return getattr(importlib.import_module(module), name)
