"""One typed config tree, slime-style flat flags, YAML files, and start-up validation.

Every leaf field is a flag: ``rollout_batch_size`` in section ``rollout`` is
``--rollout-batch-size``. ``--config run.yaml`` sets the same fields (nested by section or
flat); flags given on the command line override the file. Each component receives only
its own section.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import yaml


class ConfigError(ValueError):
    """Invalid flag values or combinations; the message names the flags and the fix."""


def opt(default: Any, help: str, choices: tuple | None = None, flag: str | None = None, repeat: bool = False):
    md = {"help": help}
    if repeat:
        md["repeat"] = True
    if choices:
        md["choices"] = choices
    if flag:
        md["flag"] = flag
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md)
    return field(default=default, metadata=md)


TRAIN_BACKENDS = ("fsdp", "megatron")
ROLLOUT_ENGINES = ("embedded", "server", "sglang")
ADV_ESTIMATORS = ("grpo", "gspo", "dr_grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
POLICY_LOSS_TYPES = ("ppo_clip", "cispo")  # polyrl.algorithms.losses.POLICY_LOSSES


# Decoder families whose layers torch.compile once per micro-batch shape bucket and win back the time (bench/RESULTS.md).
COMPILE_BY_DEFAULT = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ClusterConfig:
    train_backend: str = opt("fsdp", "training backend", TRAIN_BACKENDS)
    seed: int = opt(1234, "global seed (model init, data order, dropout)")
    device: str = opt("auto", "auto | cpu | cuda", ("auto", "cpu", "cuda"))
    dist_backend: str = opt("auto", "torch.distributed backend: auto (nccl on GPU, gloo on CPU) | gloo | nccl", ("auto", "gloo", "nccl"))
    distributed_timeout_minutes: float = opt(
        10.0, "minutes a collective of the trainer ranks waits for the others before the run fails (gloo raises an error "
              "naming the wait; NCCL's watchdog ends the process), so that a hung rank ends in an error that torchrun "
              "--max-restarts or --use-ray --max-restarts restarts from; fractions allowed. Some collectives wait on one "
              "rank's work alone: the other ranks wait in a barrier while rank 0 writes --save-hf, deletes --save steps "
              "past --max-ckpt-to-keep, and pushes weights to engine servers (up to --rollout-request-timeout): keep it "
              "above the longest of those. Megatron's parallel groups (TP, PP, CP, EP, DP) get the same timeout")


@dataclass
class DataConfig:
    prompt_data: str | None = opt(None, "prompt dataset: .jsonl or .parquet, optional path@[start:end] row slice")
    input_key: str = opt("prompt", "key of the prompt (str or chat messages) in each row")
    label_key: str | None = opt("label", "key of the label/answer in each row")
    metadata_key: str | None = opt("metadata", "key of a per-row metadata dict")
    response_key: str = opt("response", "key of the target response (polyrl sft)")
    apply_chat_template: bool = opt(False, "wrap prompts with the tokenizer's chat template")
    rollout_max_prompt_len: int | None = opt(None, "drop (and count) prompts longer than this many tokens "
                                                   "(TRL: max_prompt_length)")
    rollout_shuffle: bool = opt(False, "shuffle prompts each epoch (seeded)")
    allow_data_change: bool = opt(False, "--load: resume at the saved data position even though --prompt-data changed "
                                         "since the checkpoint (rows, size or first rows differ); refused without it")
    eval_prompt_data: str | None = opt(None, "held-out prompts for --eval-interval and polyrl eval")
    multimodal_keys: str | None = opt(None, "image prompts: JSON map modality -> column, e.g. '{\"image\": \"images\"}' (a "
                                            "column of image paths relative to the data file, data URLs or base64; see "
                                            "docs/multimodal.md)")


@dataclass
class RolloutConfig:
    rollout_batch_size: int = opt(8, "prompts per RL step")
    n_samples_per_prompt: int = opt(4, "responses sampled per prompt (the GRPO group size; TRL: num_generations)")
    rollout_temperature: float = opt(1.0, "sampling temperature (0 = greedy)")
    rollout_top_p: float = opt(1.0, "nucleus sampling threshold")
    rollout_top_k: int = opt(-1, "top-k sampling (-1 = off)")
    rollout_max_response_len: int = opt(64, "max new tokens per response (TRL: max_completion_length)")
    rollout_stop: list[str] = opt([], "stop strings (repeatable list)")
    rollout_stop_token_ids: list[int] = opt([], "extra stop token ids, beside EOS")
    rollout_seed: int = opt(42, "seed of the sampler (per step: seed + step)")
    num_rollout: int = opt(10, "number of RL steps")
    eval_temperature: float = opt(0.0, "sampling temperature for evaluation (0 = greedy)")
    rollout_engine: str = opt("embedded", "rollout engine: embedded (in the trainer process) | server (launched `polyrl serve` "
                                          "processes) | sglang (launched `python -m sglang.launch_server`)", ROLLOUT_ENGINES)
    rollout_batch_generate: int = opt(0, "max sequences per generate call on the embedded engine (0 = all at once; "
                                          "on its GPU path: max sequences decoding at once, 0 = 512)")
    rollout_gpu_engine: bool = opt(True, "on CUDA, run Llama/Qwen2/Qwen3 on the embedded engine's GPU path (paged KV cache, "
                                         "continuous batching, CUDA graphs); --no-rollout-gpu-engine: the transformers path")
    rollout_mem_fraction: float = opt(0.4, "share of GPU memory the embedded GPU engine holds (weights + KV cache + "
                                           "workspace); the KV cache gets what is left")
    rollout_cuda_graph: bool = opt(True, "embedded GPU engine: decode steps replay CUDA graphs captured per batch size")
    rollout_quantization: str = opt("none", "weights the engines sample from: none (the trainer's, in the engine's dtype) | "
                                            "fp8 (every linear weight sent as FP8 E4M3 with 128x128 block scales, SGLang's "
                                            "block-FP8 names; embeddings, norms, LM head and routers as they are); the "
                                            "GPU path of the embedded engine (and of polyrl serve) keeps the linears and "
                                            "MoE experts in FP8 and runs FP8 GEMMs (activations rounded to E4M3 too); on CPU they "
                                            "dequantize: either way they sample from an FP8-rounded model. Rollout "
                                            "log-probs then come from another model than the trainer's: add --use-tis "
                                            "(docs/low-precision.md)", ("none", "fp8"))
    kv_cache_dtype: str = opt("auto", "KV cache of the engines (SGLang's flag): auto (the model dtype) | fp8_e4m3 (E4M3 "
                                      "with one float32 scale per token and kv head, about twice the cached tokens in "
                                      "the same memory; the embedded engine's GPU path and polyrl serve on it; passed "
                                      "to a launched SGLang as it is). Decode attends to the rounded keys and values, "
                                      "so rollout log-probs move away from the trainer's: add --use-tis "
                                      "(docs/low-precision.md)", ("auto", "fp8_e4m3"))
    async_training: bool = opt(False, "asynchronous training (polyrl/loop_async.py): the rollout of later steps runs on the "
                                      "engines while the trainer trains; weights go to the engines after every step",
                               flag="--async")
    max_staleness: int | None = opt(
        None, "--async: how many policy versions a sample may lag the policy it trains (unset: 1, one-step-off; K > 1: "
              "generation runs up to K steps ahead and never waits for training within that bound). --partial-rollout: "
              "a resumed sample whose oldest token would lag the policy that trains it by more than this is dropped "
              "and generated anew (counted in partial_rollout/stale_dropped; unset without --async: no bound)")
    dynamic_sampling_filter_path: str | None = opt(
        None, "dynamic sampling (DAPO): 'module:fn' or 'file.py:fn' taking one prompt group's scored samples "
              "(list[Sample]) and returning True to keep the group; prompts are drawn, generated and scored again "
              "until --rollout-batch-size groups pass (surplus groups of the last draw are dropped). Built-in: "
              "polyrl.rewards.filters:nonzero_std drops groups whose rewards are all equal")
    over_sampling_batch_size: int | None = opt(None, "dynamic sampling and --partial-rollout: prompts per draw (in flight "
                                                     "at once with --partial-rollout, resumed ones included), >= "
                                                     "--rollout-batch-size (unset: --rollout-batch-size)")
    partial_rollout: bool = opt(False, "slime's partial rollout (docs/partial-rollout.md): a step's rollout stops once it "
                                       "holds --rollout-batch-size complete prompt groups (of --over-sampling-batch-size "
                                       "in flight); the requests still running are aborted and their partial responses "
                                       "(tokens, rollout log-probs, the weight version of every token) wait in a buffer "
                                       "that the next step continues first, under the new weights. Groups are scored as "
                                       "they finish, while the others decode")
    mask_offpolicy_in_partial_rollout: bool = opt(False, "--partial-rollout: tokens generated in an earlier step's "
                                                         "rollout (under older weights) get loss mask 0 (slime's flag)")
    rollout_length_distribution: str | None = opt(
        None, "a length-controlled workload (benchmarks and tests with random weights, which never emit EOS): every "
              "sample's response ends with EOS at a length drawn from this distribution, the tokens before it "
              "unchanged: lognormal:median=M,p99=P,cap=C or histogram:PATH ('LENGTH [COUNT]' lines). The forced EOS is "
              "out of the loss (polyrl/rollout/lengths.py)")
    max_dynamic_sampling_draws: int = opt(8, "dynamic sampling: most draws per step; a step still short of "
                                             "--rollout-batch-size groups after them stops the run with an error")
    custom_generate_function_path: str | None = opt(
        None, "multi-turn / tool rollouts: 'module:fn' or 'file.py:fn', `async def fn(record, sampling_params, engine, "
              "tokenizer) -> Sample | list[Sample]` called --n-samples-per-prompt times per prompt; its samples carry "
              "loss_mask 0 on tool tokens (polyrl/rollout/custom.py documents the contract). Each call must return "
              "within --rollout-request-timeout")
    custom_generate_concurrency: int = opt(64, "--custom-generate-function-path: most calls in flight at once per rank")
    max_turns: int | None = opt(None, "--custom-generate-function-path: most engine calls (turns) per call of the function; "
                                      "it reads record.max_turns, and a call past it stops the run with an error naming the "
                                      "function (unset: no limit)")
    rollout_max_context_len: int | None = opt(
        None, "per-sample context budget in tokens (prompt + response, tool tokens included): prompts longer than this - 1 "
              "are dropped; each engine call generates at most what is left of it; a sample past it, or past "
              "--rollout-max-response-len, is cut to fit and gets finish reason 'length' (unset: no budget beyond "
              "--rollout-max-response-len)")
    agent_function_path: str | None = opt(
        None, "agents as they are written: 'module:fn' or 'file.py:fn', `async def fn(task, client) -> float | "
              "list[dict]` called --n-samples-per-prompt times per prompt with the prompt record (task.messages, "
              "task.label, task.metadata) and an OpenAI client configuration (client.base_url, client.api_key, "
              "client.model) of a loopback gateway that records the trajectory token for token; it returns the reward, "
              "or the final messages for the reward function to score (docs/agents.md)")
    agent_concurrency: int = opt(16, "--agent-function-path: most agent calls in flight at once per rank")
    agent_timeout: float = opt(300.0, "--agent-function-path: seconds one agent call may take; past it (or when it "
                                      "raises) its trajectory is a failed sample: reward 0, nothing of it trained, "
                                      "counted in agent/failed")
    agent_samples_per_trajectory: int = opt(1, "--agent-function-path: samples each trajectory gives the step (its "
                                               "last segments; a trajectory splits where the agent rewrote its history, "
                                               "fewer segments are padded with samples that train nothing)")


@dataclass
class EnginesConfig:
    """Rollout engines as separate HTTP servers (--rollout-engine server|sglang, or --rollout-external)."""

    rollout_num_engines: int | None = opt(None, "engine servers to launch (default: --rollout-num-gpus / "
                                                "--rollout-num-gpus-per-engine, else 1)")
    rollout_num_gpus: int | None = opt(None, "GPUs for rollout engines in total (slime's name)")
    rollout_num_gpus_per_engine: int = opt(1, "GPUs per engine server (SGLang: its tensor parallel size)")
    rollout_external: bool = opt(False, "attach to running servers (--rollout-external-engine-addrs); polyrl never stops them")
    rollout_external_engine_addrs: list[str] = opt([], "URLs (or host:port) of running SGLang / polyrl serve servers")
    rollout_external_colocated: bool = opt(False, "the --rollout-external servers run on this trainer's GPUs: they release "
                                                  "their memory while it trains and take the weights over gloo, as "
                                                  "launched servers sharing the GPUs do (--use-ray --colocate with "
                                                  "--rollout-engine server sets it for its engine actors)")
    use_sglang_router: bool = opt(False, "run the real sglang-router in front of the engines (pip install sglang-router); "
                                         "without it polyrl spreads requests itself (least outstanding requests)")
    sglang_router_policy: str = opt("cache_aware", "sglang-router --policy",
                                    ("random", "round_robin", "cache_aware", "power_of_two"))
    weight_sync: str = opt("auto", "how weights reach the engines: auto (tensor for embedded, distributed for servers) | "
                                   "tensor (same process) | distributed (process group: NCCL on GPU, gloo on CPU) | disk",
                           ("auto", "tensor", "distributed", "disk"))
    api_key: str | None = opt(None, "Bearer key of the engine servers, sent to external ones; launched ones get it (or a "
                                    "random key when unset) through their environment, never their command line",
                              flag="--api-key")
    api_key_file: str | None = opt(None, "file holding --api-key (first line), so the key stays off command lines",
                                   flag="--api-key-file")
    check_weight_update_equal: bool = opt(False, "after each sync read every weight back from every engine and fail on a mismatch")
    use_fault_tolerance: bool = opt(False, "re-send the requests of a dead or hung engine to the others and restart it "
                                           "(launched engines); without it a dead engine stops the run")
    rollout_health_check_interval: float = opt(5.0, "seconds between health checks of engine servers")
    rollout_request_timeout: float = opt(600.0, "seconds one /generate request may take before its engine counts as hung")
    rollout_engine_startup_timeout: float = opt(300.0, "seconds to wait for a launched engine's /health")
    rollout_external_startup_timeout: float = opt(30.0, "seconds to wait at start-up for each --rollout-external "
                                                        "server to answer /health (it runs already: a short wait, then "
                                                        "an error naming its URL)")
    rollout_engine_log_dir: str | None = opt(None, "engine server logs (default: RUN_DIR/engines)")
    sglang_args: list[str] = opt([], "extra server flags: every --sglang-X VALUE on the command line reaches "
                                     "sglang.launch_server as --X VALUE", flag="--sglang-extra-args")


@dataclass
class ServerConfig:
    """`polyrl serve` (and the servers `polyrl train` launches)."""

    host: str = opt("127.0.0.1", "address to bind (loopback by default; a non-loopback address needs --api-key, "
                                 "--api-key-file or POLYRL_API_KEY, else start-up is refused)")
    port: int = opt(30000, "port to bind (0 = any free port, printed at start-up)")
    api_key: str | None = opt(None, "Bearer key every endpoint but /health requires (unset: --api-key-file, else the "
                                    "POLYRL_API_KEY environment variable, which is how polyrl train hands it over)")
    api_key_file: str | None = opt(None, "file holding the API key (first line): keeps it off the command line")
    allow_unauthenticated_host: bool = opt(False, "DANGER: serve a non-loopback --host without an API key; anyone who "
                                                  "reaches the port can generate (weight, memory and control endpoints "
                                                  "stay refused)")
    allowed_weight_dirs: list[str] = opt([], "directories /update_weights_from_disk may read (symlinks resolved); "
                                             "none: that endpoint is refused")
    max_request_bytes: int = opt(64 * 1024**2, "largest request body accepted")
    max_text_chars: int = opt(4 * 1024**2, "most characters of text in one /generate request (its prompts together) "
                                           "or /v1 request (messages and tools) (400 past it): the server tokenizes "
                                           "them, at ~120 bytes of memory a "
                                           "character; input_ids bodies are bounded by --max-request-bytes alone")
    max_running_requests: int = opt(1024, "samples (prompts x n) queued or running at once; past it /generate answers "
                                          "429 with Retry-After")
    max_prompts_per_request: int = opt(256, "most prompts in one /generate request (400 past it)")
    max_n: int = opt(64, "largest sampling_params.n accepted (400 past it)")
    request_timeout_s: float = opt(600.0, "deadline of one /generate request: past it the request is aborted "
                                          "(finish_reason abort) and its generation stops")
    batch_wait_ms: float = opt(2.0, "how long the batcher waits for more requests before starting a batch")


GPU_TOKEN_BUDGET = 16384  # tokens per micro-batch by default on GPU: the floor of gpu_token_budget
GPU_TOKEN_BUDGET_MAX = 65536


def gpu_token_budget(hf_config, device_memory: int, *, state_bytes: int, checkpointing: bool, offload: bool,
                     compiled: bool = False) -> int:
    """The default token budget of a GPU micro-batch (no --micro-batch-size / --max-tokens-per-gpu): as many tokens as
    the activations of 80% of the device's memory hold beside the training state, between GPU_TOKEN_BUDGET and
    GPU_TOKEN_BUDGET_MAX, in 4096-token steps. Every micro-batch pays the same host cost (Python, launches, FSDP
    hooks), so fewer fuller ones keep the GPU busy (0.5B GRPO train phase on one H100: 0.600 s at 16k tokens, 0.368 s at
    40k, bench/RESULTS.md). A colocated engine sleeps during training (its memory is free then); one that stays
    awake counts in state_bytes.
    Saved activations per token and layer ~ 2 bytes x (6 hidden + 3 intermediate) (norm outputs, q/k/v, attention
    output, residuals, gate/up/SiLU of a Llama/Qwen block in BF16); compiled layers keep less, so 0.9 of that
    (GRPO on an H100, peak allocated less the state over the micro-batch's tokens: 0.83 MB per token at 0.5B against
    0.96 here, 1.35 MB at 1.5B against 2.02); 80% of the memory for state and activations leaves a fifth for the
    transient buffers (LM-head chunks, FSDP's, the allocator's slack);
    with activation checkpointing one layer's worth plus each layer's input; MoE layers count top-k experts' widths
    where that exceeds the dense one. state_bytes: what the training state holds on the device (the caller: memory
    allocated now, every co-resident model included, plus grads and Adam moments not allocated yet). With
    --offload-train the state's residency is what limits, so the floor is kept."""
    if offload:
        return GPU_TOKEN_BUDGET
    h = int(getattr(hf_config, "hidden_size", 0) or 0)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    inter = int(getattr(hf_config, "intermediate_size", 0) or 4 * h)
    routed = int(getattr(hf_config, "num_experts_per_tok", 0) or 0) * int(getattr(hf_config, "moe_intermediate_size", 0) or 0)
    inter = max(inter, routed)
    if not h or not layers:
        return GPU_TOKEN_BUDGET
    block = 2 * (6 * h + 3 * inter)
    per_token = block + 2 * h * layers if checkpointing else block * layers
    if compiled:
        per_token = int(0.9 * per_token)
    room = 0.8 * device_memory - state_bytes
    budget = int(room / per_token) // 4096 * 4096
    return min(GPU_TOKEN_BUDGET_MAX, max(GPU_TOKEN_BUDGET, budget))


@dataclass
class BatchConfig:
    global_batch_size: int | None = opt(None, "samples per optimizer step (default: one step per rollout)")
    micro_batch_size: int | None = opt(None, "samples per micro-batch (TRL: per_device_train_batch_size; ignored with "
                                             "--use-dynamic-batch-size); default: 8 on CPU, and on GPU token-budget "
                                             "micro-batches of --max-tokens-per-gpu instead")
    use_dynamic_batch_size: bool = opt(False, "pack micro-batches by token count up to --max-tokens-per-gpu")
    max_tokens_per_gpu: int | None = opt(None, "token budget of one packed micro-batch (default on GPU without "
                                               "--micro-batch-size: the FSDP backend sizes it from the GPU's memory "
                                               f"and the model, {GPU_TOKEN_BUDGET}-{GPU_TOKEN_BUDGET_MAX} tokens, "
                                               f"Megatron {GPU_TOKEN_BUDGET}; or the longest sample if longer)")

    def micro_batch_plan(self, device_type: str, longest: int, default_budget: int | None = None) -> dict:
        """The keywords of `plan_micro_batches`: a token budget (--use-dynamic-batch-size, or the GPU default when no
        --micro-batch-size is given: fewer, fuller forwards; 1.8x faster GRPO train phase at the 0.5B shape on one
        H100 than 8 samples, bench/RESULTS.md) or a sample count (8 on CPU by default). default_budget: the backend's
        GPU default (gpu_token_budget), else GPU_TOKEN_BUDGET."""
        if self.use_dynamic_batch_size:
            return {"max_tokens": self.max_tokens_per_gpu}
        if self.micro_batch_size is None and device_type == "cuda":
            return {"max_tokens": max(self.max_tokens_per_gpu or default_budget or GPU_TOKEN_BUDGET, longest)}
        return {"micro_batch_size": self.micro_batch_size or 8}
    micro_batch_layout: str = opt("auto", "auto (packed with varlen kernels, padded rows with dense attention) | packed | padded",
                                  ("auto", "packed", "padded"))
    num_epoch: int = opt(1, "passes over the data (polyrl sft)")


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = opt("grpo", "advantage estimator", ADV_ESTIMATORS)
    disable_grpo_std_normalization: bool = opt(False, "GRPO without dividing by the group std")
    eps_clip: float = opt(0.2, "PPO clip range (low side)")
    eps_clip_high: float | None = opt(None, "PPO clip range high side (clip-higher); default = --eps-clip")
    eps_clip_c: float | None = opt(None, "dual-clip constant c (> 1)")
    policy_loss: str = opt("ppo_clip", "policy loss: ppo_clip (PPO clipped surrogate, with --eps-clip-high and "
                                       "--eps-clip-c) | cispo (MiniMax-M1: -sg(clip(ratio, 1 - eps-clip, 1 + eps-clip-high)) "
                                       "* A * logprob; clipped tokens keep their gradient)", POLICY_LOSS_TYPES)
    loss_agg_mode: str = opt("token-mean", "loss aggregation", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"))
    use_kl_loss: bool = opt(False, "add a KL(actor || reference) loss term")
    kl_loss_coef: float = opt(0.0, "weight of the KL loss (TRL: beta, which also turns the loss on: "
                                       "here --use-kl-loss)")
    kl_loss_type: str = opt("low_var_kl", "KL estimator", ("k1", "k2", "k3", "low_var_kl"))
    kl_coef: float = opt(0.0, "KL-in-reward coefficient (reinforce_plus_plus, gae)")
    gamma: float = opt(1.0, "discount (reinforce_plus_plus, gae)")
    lambd: float = opt(1.0, "GAE lambda (--advantage-estimator gae)")
    value_clip: float = opt(0.5, "PPO with a critic: clip range of the value update around the pre-update values (0 = off)")
    entropy_coef: float = opt(0.0, "entropy bonus weight")
    use_tis: bool = opt(False, "truncated importance sampling against rollout logprobs")
    tis_clip: float = opt(2.0, "TIS weight cap")
    ref_update_interval: int = opt(0, "copy the actor into the reference model every N steps (0 = never)")
    opd_coef: float = opt(1.0, "on-policy distillation weight C (with --opd-teacher-load): token advantage = task advantage "
                               "+ C * (teacher_logprob - student_logprob) of each sampled token; a constant reward (task "
                               "advantage 0) gives pure distillation")


@dataclass
class RewardConfig:
    rm_type: str | None = opt(None, "built-in reward: math | gsm8k | exact | arithmetic")
    custom_rm_path: str | None = opt(None, "custom reward 'module:function' or 'file.py:function' (sync or async)")
    group_rm: bool = opt(False, "call the custom reward once per prompt group with a list of samples")
    overlong_buffer_len: int = opt(0, "DAPO overlong reward shaping, buffer L: a response longer than max - L tokens "
                                      "(max = --rollout-max-response-len) gets -F * (len - (max - L)) / L added to its "
                                      "reward, F = --overlong-penalty-factor (0 = off)")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong reward shaping: the penalty at --rollout-max-response-len")
    rm_timeout: float = opt(60.0, "seconds one reward call (one sample, or one group with --group-rm) may take; past it the "
                                  "sample gets reward 0 and counts in reward/timeouts, and the run goes on (0 = no limit); "
                                  "with --rm-url: seconds per HTTP request")
    rm_url: str | None = opt(None, "remote reward model: POST {prompts, responses, labels, metadata} (JSON lists, one entry per "
                                   "sample) to this URL, answer {rewards: [float, ...]} (polyrl/rewards/remote.py)")
    rm_batch_size: int = opt(64, "--rm-url: samples per request")
    rm_max_concurrency: int = opt(8, "--rm-url: requests in flight at once")
    rm_retries: int = opt(3, "--rm-url: times a failed request (connection error, timeout, HTTP 5xx/408/429) is sent again, "
                             "waiting 0.5 s, 1 s, 2 s, ... in between; after that its samples get reward 0 and count in "
                             "reward/errors, the request in reward/remote_failures")
    max_consecutive_failed_steps: int = opt(0, "stop the run after this many steps in a row where every reward call failed "
                                               "or every reward was 0 (each such step is warned about on the console and "
                                               "counted in reward/all_failed, reward/all_zero; 0 = warn only)")


@dataclass
class OptimizerConfig:
    lr: float = opt(1e-6, "peak learning rate (TRL: learning_rate); a resume applies this one")
    min_lr: float = opt(0.0, "final learning rate of the decay")
    lr_warmup_steps: int = opt(0, "linear warm-up optimizer steps")
    lr_decay_style: str = opt("constant", "constant | linear | cosine", ("constant", "linear", "cosine"))
    lr_decay_steps: int | None = opt(None, "decay length in optimizer steps (default: the whole run)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW eps")
    clip_grad: float = opt(1.0, "max global grad norm (0 = off)")
    critic_lr: float | None = opt(None, "the critic's peak learning rate (--advantage-estimator gae; default: --lr); its "
                                        "schedule and AdamW settings are the actor's")
    critic_num_warmup_steps: int | None = opt(None, "the critic's linear warm-up optimizer steps (default: --lr-warmup-steps)")


@dataclass
class ModelConfig:
    hf_checkpoint: str | None = opt(None, "local HF model directory (config, weights, tokenizer)")
    ref_load: str | None = opt(None, "reference model directory (default: --hf-checkpoint)")
    opd_teacher_load: str | None = opt(None, "on-policy distillation: a frozen teacher HF directory (any size, the same "
                                             "tokenizer as --hf-checkpoint) that scores every sampled token; see --opd-coef")
    critic_load: str | None = opt(None, "--advantage-estimator gae: the critic's initial weights, an HF directory (a "
                                        "critic exported by --save-hf, with its value head, or any causal LM of the actor's "
                                        "architecture: a fresh value head; default: --hf-checkpoint)")
    gradient_checkpointing: bool = opt(False, "activation checkpointing per decoder layer (--train-backend megatron: full "
                                              "recompute of every layer, --recompute-granularity full "
                                              "--recompute-method uniform --recompute-num-layers 1)")
    freeze_vision_tower: bool = opt(False, "vision-language models: train the language model only (the vision tower's "
                                           "weights stay as loaded)")
    attn_implementation: str = opt("auto", "attention: auto (varlen on CUDA, sdpa on CPU) | varlen | sdpa | eager | flash_attention_2")
    compile: bool | None = opt(None, "torch.compile each decoder layer (FSDP backend; --train-backend megatron: polyrl's "
                                     "RMSNorms and the q/k RoPE inside megatron's layers, whose own forward dynamo cannot "
                                     "trace whole); default: on for CUDA (FSDP: 1.7x the train phase at the 1.5B shape, and "
                                     "it fits 16k-token micro-batches that OOM eager) with a dense attention decoder "
                                     "(llama / mistral / qwen2 / qwen3), off on CPU and for other architectures "
                                     "(linear-attention and MoE layers recompile per shape); --compile forces it on, "
                                     "--no-compile off")
    fp16: bool = opt(False, "FP16 params/compute (default: BF16 on GPU, FP32 on CPU)")
    bf16: bool = opt(False, "force BF16 (also on CPU)")
    fp32: bool = opt(False, "force FP32 params and compute (also on GPU): exact parity checks, debugging")
    true_on_policy: bool = opt(False, "the engine and the trainer score every token with one batch-invariant function "
                                      "(packed rows, fixed-block GEMMs and norms, per-sequence attention; on CUDA the dense "
                                      "layers compiled on both sides), so "
                                      "train_rollout_logprob_abs_diff is exactly 0 and the rollout's log-probs serve as "
                                      "the old policy's; FSDP backend (dense and MoE), or Megatron at TP1 (dense); "
                                      "embedded or server engine; CPU FP32 or GPU BF16/FP32 (docs/true-on-policy.md)")
    fsdp_cpu_offload: bool = opt(False, "FSDP2 CPUOffloadPolicy: params, grads and optimizer state on CPU")
    offload_train: bool = opt(False, "move actor params/grads/optimizer off the GPU between steps")
    update_weight_buffer_size: int = opt(512 * 1024**2, "bytes per weight-sync bucket")
    logprob_chunk_size: int = opt(1024, "tokens per chunk when computing log-probs/entropy from hidden states")
    # MoE routing (polyrl/backends/routing_replay.py; megatron: its RouterReplay)
    use_routing_replay: bool = opt(False, "MoE R2: the actor's log-prob pass (old_logprobs) records every MoE layer's "
                                          "top-k experts per token and the training forwards of the step replay them")
    use_rollout_routing_replay: bool = opt(False, "MoE R3: the engine returns the routed experts of every token "
                                                  "(SGLang's return_routed_experts) and every actor forward of the step "
                                                  "replays them (implies --return-routed-experts)")
    return_routed_experts: bool = opt(False, "MoE: ask the engine for its routed experts; with replay off the trainer "
                                             "reports moe/topk_mismatch_frac (rollout vs training top-k)")
    moe_aux_loss_coeff: float = opt(0.0, "MoE load-balancing loss weight (0 = off)")
    moe_z_loss_coeff: float = opt(0.0, "MoE router z-loss weight (0 = off)")
    moe_router_load_balancing_type: str = opt("aux_loss", "MoE load-balancing loss (megatron's names; the FSDP backend "
                                                          "has aux_loss and none)",
                                              ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))

    def compiled(self, device_type: str, model_type: str | None = None) -> bool:
        """--compile / --no-compile, else on for CUDA with a dense attention decoder: the first step pays the compile
        time, which the measured dense families win back within a few steps; Qwen3-Next's DeltaNet fallback loops and
        HF MoE blocks' data-dependent expert shapes spend minutes in the compiler instead (seen on an H100)."""
        if self.compile is not None:
            return self.compile
        return device_type == "cuda" and model_type in COMPILE_BY_DEFAULT

    lora_rank: int = opt(0, "LoRA rank (0 = full fine-tuning; FSDP (needs peft) or Megatron): only the adapters train, the "
                            "reference model is the base with the adapters off, engines get merged weights")
    lora_alpha: int = opt(16, "LoRA alpha (adapter scale alpha / rank)")
    lora_target_modules: str = opt("all-linear", "LoRA targets: all-linear (every Linear but the output layer) or a "
                                                 "comma list of module names, e.g. q_proj,k_proj,v_proj,o_proj")
    lora_dropout: float = opt(0.0, "dropout on the LoRA adapters' input while training")
    enable_mtp_training: bool = opt(False, "train the checkpoint's multi-token-prediction layers (MiMo's mtp_layers) with "
                                           "an MTP loss beside the policy loss, so they stay a usable draft model after "
                                           "RL (FSDP and Megatron backends)")
    mtp_loss_scaling_factor: float = opt(0.2, "weight of the MTP loss (--enable-mtp-training): the mean over MTP depths "
                                              "of each depth's token-mean cross-entropy")
    mtp_detach_encoder: bool = opt(True, "--enable-mtp-training: the MTP loss reads the main model's hidden states, "
                                         "embeddings and output layer detached, so only the MTP layers learn from it "
                                         "(--no-mtp-detach-encoder: it trains the whole model)")

    def lora_targets(self) -> str | list[str]:
        """peft's target_modules from --lora-target-modules."""
        if self.lora_target_modules == "all-linear":
            return "all-linear"
        return [t.strip() for t in self.lora_target_modules.split(",")]

    def dtype(self, device_type: str):
        """Params/compute dtype: --fp16 / --bf16 / --fp32, else BF16 on GPU and FP32 on CPU."""
        import torch
        if self.fp16:
            return torch.float16
        if self.fp32:
            return torch.float32
        return torch.bfloat16 if (self.bf16 or device_type == "cuda") else torch.float32


@dataclass
class CheckpointConfig:
    save: str | None = opt(None, "checkpoint directory (written atomically)")
    save_interval: int = opt(0, "save every N steps (0 = only at the end)")
    load: str | None = opt(None, "resume from this checkpoint directory")
    save_hf: str | None = opt(None, "export the final actor as an HF directory (with LoRA: adapters merged in; PPO's critic, with gae: to DIR_critic)")
    save_hf_adapter: bool = opt(False, "LoRA: --save-hf writes a peft adapter directory (adapter_config.json + weights) "
                                       "instead of the merged model")
    save_optim: bool = opt(True, "checkpoints hold the optimizer state; --no-save-optim (Megatron-LM's flag): only the "
                                 "weights, the LR schedule and the RNG state, a third of an FP32 AdamW checkpoint's "
                                 "bytes; a run resumed from one starts AdamW's moments from zero, and says so")
    async_save: bool = opt(False, "write checkpoints in the background (Megatron-LM's flag): a save copies the state to "
                                  "host memory (one more copy of the weights and optimizer state there) and returns; "
                                  "the files are written while the next step runs and sealed at its end, and until "
                                  "then the previous checkpoint stays the latest. The run's last save is written "
                                  "before it ends")
    max_ckpt_to_keep: int | None = opt(None, "keep the newest N complete checkpoints in --save; older ones are deleted once "
                                             "a newer one is complete (default: keep all)")
    max_wall_time: float | None = opt(None, "seconds: stop (exit status 0) with a checkpoint after the last step that "
                                            "ends within this time from start-up; SIGUSR1 stops the same way after the "
                                            "step in flight (preemptible clusters; resume with --load)")


@dataclass
class LogConfig:
    run_dir: str = opt("runs/latest", "metrics.jsonl, tensorboard and plots go here")
    use_tensorboard: bool = opt(False, "write TensorBoard events to RUN_DIR/tb")
    eval_interval: int = opt(0, "evaluate on --eval-prompt-data every N steps (0 = off)")
    quiet: bool = opt(False, "no live console view (polyrl eval: no progress lines while it generates)")
    profile_step: int = opt(0, "profile this step (1-based; 0 = off) with torch.profiler: print where its time goes "
                               "(top ops by device and host time; on GPU each phase's wall time, how much of it the "
                               "GPU was busy and its GPU time by kernel class) and write a Chrome trace to RUN_DIR/profile_stepN.json")
    use_wandb: bool = opt(False, "log the metrics.jsonl keys to Weights & Biases too (rank 0; pip install 'polyrl[wandb]'); "
                                 "its files go to RUN_DIR/wandb")
    wandb_project: str = opt("polyrl", "W&B project")
    wandb_group: str | None = opt(None, "W&B run group (e.g. one per experiment)")
    wandb_run_name: str | None = opt(None, "W&B run name (default: W&B picks one)")
    wandb_mode: str = opt("online", "online | offline (written under RUN_DIR/wandb, `wandb sync` later) | disabled",
                          ("online", "offline", "disabled"))
    overwrite: bool = opt(False, "start afresh in a --run-dir that holds an earlier run's metrics.jsonl (it is emptied); "
                                 "without it such a run dir is refused unless --load resumes that run")
    ci_train_rollout_logprob_abs_diff_threshold: float | None = opt(
        None, "fail closed: stop the run (exit 1) at the first step where a loss-masked response token's |training "
              "log-prob - rollout log-prob| exceeds this (train_rollout_logprob_abs_diff_max; unset: no gate)")


@dataclass
class DebugConfig:
    """Debug modes, slime's names: one half of the loop alone, on saved or live rollouts."""

    debug_rollout_only: bool = opt(False, "generate and score only: no training, no weight sync (metrics still logged)")
    debug_train_only: bool = opt(False, "train on rollouts saved by --save-debug-rollout-data (needs --load-debug-rollout-data); "
                                        "no engine is built; rewards come from the files unless a reward flag re-scores them")
    save_debug_rollout_data: str | None = opt(None, "write each step's scored samples to this path template, e.g. "
                                                    "dir/rollout_{rollout_id}.jsonl (rollout_id: the 0-based step)")
    load_debug_rollout_data: str | None = opt(None, "read each step's samples from this path template instead of generating "
                                                    "(implies --debug-train-only)")

    @property
    def train_only(self) -> bool:
        return self.debug_train_only or bool(self.load_debug_rollout_data)


@dataclass
class MegatronConfig:
    """--train-backend megatron only; flag names are Megatron-LM's."""

    tensor_model_parallel_size: int = opt(1, "tensor parallel degree (TP)")
    sequence_parallel: bool = opt(False, "shard norms/dropout activations along the sequence over the TP group (needs TP > 1)")
    pipeline_model_parallel_size: int = opt(1, "pipeline parallel degree (PP)")
    num_layers_per_virtual_pipeline_stage: int | None = opt(None, "layers per virtual pipeline stage (interleaved 1F1B; needs PP > 1)")
    context_parallel_size: int = opt(1, "context parallel degree (CP): each sequence is split over CP ranks")
    expert_model_parallel_size: int = opt(1, "expert parallel degree (EP, MoE models)")
    expert_tensor_parallel_size: int | None = opt(None, "tensor parallel degree inside experts (default: --tensor-model-parallel-size)")
    moe_router_topk: int | None = opt(None, "experts per token (default: the HF config's num_experts_per_tok)")
    use_distributed_optimizer: bool = opt(True, "shard fp32 main params and Adam state over data parallel ranks (ZeRO-1)")
    recompute_granularity: str | None = opt(None, "activation recompute: full | selective", ("full", "selective"))
    recompute_method: str | None = opt(None, "full recompute: uniform | block", ("uniform", "block"))
    recompute_num_layers: int | None = opt(None, "layers per recompute unit (uniform) or recomputed layers per stage (block)")
    custom_model_provider_path: str | None = opt(None, "'module:function' or 'file.py:function' building the megatron model; "
                                                 "called as fn(config, hf_config, pre_process, post_process, vp_stage)")
    use_megatron_fsdp: bool = opt(False, "megatron-core FSDP (ZeRO-3 optim_grads_params by default) instead of DDP")
    optimizer_cpu_offload: bool = opt(False, "megatron-core's hybrid-device optimizer: fp32 main params and Adam state on "
                                             "the CPU, the Adam step there (needs the distributed optimizer, not "
                                             "--use-megatron-fsdp)")
    release_grad_buffers: bool = opt(True, "free megatron DDP's gradient buffers (zero between steps) after each optimizer "
                                           "step and make them again as zeros at the next train step: 4 bytes a "
                                           "parameter less GPU memory between steps (BF16: 18 -> 14), training "
                                           "bit-identical, at the cost of one memset of the buffers a step; on by "
                                           "default (Megatron-FSDP manages its own buffers)")
    gradient_accumulation_fusion: bool = opt(True, "each linear's weight gradient accumulated by its GEMM into the FP32 "
                                                   "main grad (Apex's fusion, here torch's mixed-precision addmm), not "
                                                   "written in BF16 and added: fewer bytes and kernels a step; on by "
                                                   "default on CUDA with DDP (not --use-megatron-fsdp, which has its "
                                                   "own gradient path)")
    override_ddp_config: list[str] = opt([], "key=value overrides of megatron's DistributedDataParallelConfig (repeatable)",
                                         repeat=True)


@dataclass
class RayConfig:
    """Ray placement (`--use-ray`), slime's flag names."""
    use_ray: bool = opt(False, "place the train ranks (and engine servers) as Ray actors: on the cluster RAY_ADDRESS or "
                               "--ray-address names, else on a local Ray instance started under the run dir")
    ray_address: str = opt("", "Ray cluster to join (default: RAY_ADDRESS, as `ray job submit` sets it; none: start a local one)")
    actor_num_nodes: int = opt(1, "nodes of train actors")
    actor_num_gpus_per_node: int = opt(1, "train actors (one per GPU; on CPU one per slot) per node")
    colocate: bool = opt(False, "engines share the train actors' GPUs and take turns (the embedded engine inside each train "
                                "actor, weights from tensor); default: engine actors on GPUs of their own (--rollout-num-gpus), "
                                "weights from distributed")
    ray_num_cpus: int = opt(0, "local Ray instance only: logical CPUs (0 = this machine's)")
    max_restarts: int = opt(0, "times the train actors are started again after one dies; each restart resumes from the "
                               "newest complete checkpoint under --save, and the engine actors stay up and get the resumed "
                               "weights (under torchrun: pass torchrun's own --max-restarts; polyrl resumes the same way)")


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


SECTION_TITLES = {
    "cluster": "cluster / backend", "data": "data", "rollout": "rollout",
    "engines": "rollout engine servers", "server": "server (polyrl serve)", "batch": "batching",
    "algorithm": "algorithm", "reward": "reward", "optimizer": "optimizer", "model": "model / backend",
    "checkpoint": "checkpoints", "log": "logging", "megatron": "megatron backend", "ray": "ray placement", "debug": "debug modes",
}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base_type(tp) -> tuple[type, bool]:
    """(scalar type, is_list) from an annotation such as `int | None` or `list[str]`."""
    if isinstance(tp, str):
        tp = eval(tp, {"list": list, "dict": dict})  # annotations are strings under `from __future__`
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return typing.get_args(tp)[0], True
    return tp, False


def _sections(cfg_cls=Config):
    for sf in dataclasses.fields(cfg_cls):
        yield sf.name, sf.default_factory


def _metavar(name: str, tp: type) -> str:
    """What --help shows after a flag: the kind of value it takes, not its place in the config tree."""
    if tp is int:
        return "BYTES" if name.endswith(("_bytes", "_buffer_size")) else "N"
    if tp is float:
        if name.endswith(("timeout", "_interval", "_s")):
            return "SECONDS"
        return "MS" if name.endswith("_ms") else "X"
    if name.endswith("_path"):
        return "MODULE:FN"
    if "url" in name or name.endswith("_addrs"):
        return "URL"
    if name.endswith("_address"):
        return "ADDRESS"
    if name in ("host", "api_key"):
        return name.split("_")[-1].upper()
    if name in ("save", "load") or name.endswith(("_data", "_load", "_checkpoint", "_dir", "_dirs", "_hf", "_file")):
        return "PATH"
    if name.endswith("_config"):
        return "KEY=VALUE"
    if name.endswith("_args"):
        return "ARG"
    return "TEXT" if name.endswith("_stop") else "NAME"


def add_config_args(parser: argparse.ArgumentParser, sections: tuple[str, ...] | None = None,
                    only: frozenset[str] | None = None) -> None:
    """Add one argument group per config section; defaults are shown but SUPPRESSed so we can
    tell which flags the user actually gave (they override --config). only: "section.field" names,
    when a command takes just those fields of its sections."""
    parser.add_argument("--config", default=None, metavar="PATH", help="YAML file with the same fields (flags override it)")
    takes: set[str] = set()  # the settings this command reads: a YAML file may set no others
    parser.set_defaults(_takes=takes)
    for name, cls in _sections():
        if sections is not None and name not in sections:
            continue
        group = parser.add_argument_group(SECTION_TITLES.get(name, name))
        for f in dataclasses.fields(cls):
            if only is not None and f"{name}.{f.name}" not in only:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            tp, is_list = _base_type(f.type)
            kw: dict[str, Any] = dict(dest=f"{name}.{f.name}", default=argparse.SUPPRESS)
            takes.add(kw["dest"])
            shown = default not in (None, []) and not (tp is bool and default is False)  # unset or off says nothing
            help_ = f.metadata.get("help", "") + (f" (default: {default})" if shown else "")
            if tp is bool:
                group.add_argument(_flag(f), action=argparse.BooleanOptionalAction, help=help_, **kw)
                continue
            if is_list:
                kw["nargs"] = "*"
                if f.metadata.get("repeat"):  # `--flag a --flag b` accumulates instead of keeping the last
                    kw["action"] = "extend"
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
                kw["metavar"] = "{" + ",".join(map(str, f.metadata["choices"])) + "}"
            else:
                kw["metavar"] = _metavar(f.name, tp)
            group.add_argument(_flag(f), type=tp, help=help_, **kw)


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    sec = getattr(cfg, section, None)
    if sec is None or not any(f.name == key for f in dataclasses.fields(sec)):
        raise ConfigError(f"{origin}: unknown setting {section}.{key}")
    setattr(sec, key, value)


def _field_index() -> dict[str, str]:
    return {f.name: sname for sname, cls in _sections() for f in dataclasses.fields(cls)}


def load_yaml(cfg: Config, path: str, takes: Callable[[str, str], bool] | None = None, command: str = "") -> None:
    """takes(section, field): whether the command reads that setting; a YAML key it would ignore is an error."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping at the top level")
    index = _field_index()

    def put(section: str, key: str, value: Any) -> None:
        field = next((f for f in dataclasses.fields(getattr(cfg, section)) if f.name == key), None)
        if takes is not None and field is not None and not takes(section, key):
            raise ConfigError(f"--config {path}: polyrl {command} does not use {section}.{key} ({_flag(field)}); "
                              "drop it from the file or use a file for this command")
        _apply(cfg, section, key, value, f"--config {path}")

    for k, v in data.items():
        k = k.replace("-", "_")
        if isinstance(v, dict) and hasattr(cfg, k):  # nested section
            for kk, vv in v.items():
                put(k, kk.replace("-", "_"), vv)
        elif k in index:
            put(index[k], k, v)
        else:
            raise ConfigError(f"--config {path}: unknown setting {k!r}")


def config_from_args(ns: argparse.Namespace) -> Config:
    cfg = Config()
    if getattr(ns, "config", None):
        takes = getattr(ns, "_takes", None)
        load_yaml(cfg, ns.config, None if takes is None else (lambda sec, key: f"{sec}.{key}" in takes),
                  getattr(ns, "command", "") or "")
    for dest, value in vars(ns).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            _apply(cfg, section, key, value, "flag")
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


# ---- value ranges ------------------------------------------------------------------------------
# Every int/float setting has a range here, checked at start-up for flags and YAML alike (None
# means "unset" and is not checked; list settings are checked per element). A new numeric field
# needs an entry: tests/test_cli.py fails otherwise.
_RULES: dict[str, Any] = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    "> 1": lambda v: v > 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "-1 (off) or >= 1": lambda v: v == -1 or v >= 1,
    "in [0, 65535]": lambda v: 0 <= v <= 65535,
    "in [0, 2**32)": lambda v: 0 <= v < 2**32,  # numpy's seed range
}
VALUE_RANGES: dict[str, str] = {
    # cluster / data
    "seed": "in [0, 2**32)", "distributed_timeout_minutes": "> 0", "rollout_max_prompt_len": ">= 1", "mtp_loss_scaling_factor": ">= 0",
    # rollout
    "rollout_batch_size": ">= 1", "n_samples_per_prompt": ">= 1", "rollout_temperature": ">= 0",
    "rollout_top_p": "in (0, 1]", "rollout_top_k": "-1 (off) or >= 1", "rollout_max_response_len": ">= 1",
    "rollout_stop_token_ids": ">= 0", "rollout_seed": "in [0, 2**32)", "num_rollout": ">= 0", "eval_temperature": ">= 0",
    "rollout_batch_generate": ">= 0", "rollout_mem_fraction": "in (0, 1]", "max_staleness": ">= 1",
    "over_sampling_batch_size": ">= 1", "max_dynamic_sampling_draws": ">= 1", "custom_generate_concurrency": ">= 1",
    "max_turns": ">= 1", "rollout_max_context_len": "> 1", "agent_concurrency": ">= 1", "agent_timeout": "> 0",
    "agent_samples_per_trajectory": ">= 1",
    # engine servers
    "rollout_num_engines": ">= 1", "rollout_num_gpus": ">= 1", "rollout_num_gpus_per_engine": ">= 1",
    "rollout_health_check_interval": "> 0", "rollout_request_timeout": "> 0", "rollout_engine_startup_timeout": "> 0",
    "rollout_external_startup_timeout": "> 0",
    "port": "in [0, 65535]", "max_request_bytes": ">= 1", "max_running_requests": ">= 1", "batch_wait_ms": ">= 0",
    "max_text_chars": ">= 1", "max_prompts_per_request": ">= 1", "max_n": ">= 1", "request_timeout_s": "> 0",
    # batching
    "global_batch_size": ">= 1", "micro_batch_size": ">= 1", "max_tokens_per_gpu": ">= 1", "num_epoch": ">= 1",
    # algorithm
    "eps_clip": "> 0", "eps_clip_high": "> 0", "eps_clip_c": "> 1", "kl_loss_coef": ">= 0", "kl_coef": ">= 0",
    "gamma": "in [0, 1]", "entropy_coef": ">= 0", "tis_clip": "> 0", "ref_update_interval": ">= 0",
    "opd_coef": ">= 0", "lambd": "in [0, 1]", "value_clip": ">= 0", "critic_lr": "> 0", "critic_num_warmup_steps": ">= 0",
    # reward
    "rm_timeout": ">= 0", "rm_batch_size": ">= 1", "rm_max_concurrency": ">= 1", "rm_retries": ">= 0",
    "overlong_buffer_len": ">= 0", "overlong_penalty_factor": ">= 0",
    # optimizer
    "lr": "> 0", "min_lr": ">= 0", "lr_warmup_steps": ">= 0", "lr_decay_steps": ">= 1", "weight_decay": ">= 0",
    "adam_beta1": "in [0, 1)", "adam_beta2": "in [0, 1)", "adam_eps": "> 0", "clip_grad": ">= 0",
    # model, checkpoints, logging
    "update_weight_buffer_size": ">= 1", "logprob_chunk_size": ">= 1", "moe_aux_loss_coeff": ">= 0", "moe_z_loss_coeff": ">= 0",
    "lora_rank": ">= 0", "lora_alpha": "> 0", "lora_dropout": "in [0, 1)", "save_interval": ">= 0", "max_ckpt_to_keep": ">= 1",
    "max_wall_time": "> 0", "eval_interval": ">= 0", "profile_step": ">= 0", "max_consecutive_failed_steps": ">= 0",
    "ci_train_rollout_logprob_abs_diff_threshold": ">= 0",
    # megatron
    "tensor_model_parallel_size": ">= 1", "pipeline_model_parallel_size": ">= 1",
    "num_layers_per_virtual_pipeline_stage": ">= 1", "context_parallel_size": ">= 1", "expert_model_parallel_size": ">= 1",
    "expert_tensor_parallel_size": ">= 1", "moe_router_topk": ">= 1", "recompute_num_layers": ">= 1",
    # ray
    "actor_num_nodes": ">= 1", "actor_num_gpus_per_node": ">= 1", "ray_num_cpus": ">= 0", "max_restarts": ">= 0",
}
_HINTS = {"eps_clip_c": "; it is the dual-clip constant, leave it unset to disable dual clip",
          "rollout_top_k": " (-1 keeps every token)", "clip_grad": " (0 turns clipping off)",
          "rm_timeout": " (0 = no limit)", "value_clip": " (0 turns value clipping off)"}


def _validate_values(cfg: Config) -> None:
    """Types, choices and ranges of every setting, from VALUE_RANGES and the fields' choices."""
    for sname, cls in _sections():
        sec = getattr(cfg, sname)
        for f in dataclasses.fields(cls):
            v, flag = getattr(sec, f.name), _flag(f)
            if v is None:
                continue
            tp, is_list = _base_type(f.type)
            if tp in (int, float):
                items = v if is_list and isinstance(v, list) else [v]
                for i, x in enumerate(items):
                    if isinstance(x, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
                        try:
                            x = tp(x)
                        except ValueError:
                            raise ConfigError(f"{flag} {x!r} is not {'an integer' if tp is int else 'a number'}") from None
                        items[i] = x
                    if isinstance(x, bool) or not isinstance(x, (int, float)) or (tp is int and not float(x).is_integer()):
                        raise ConfigError(f"{flag} {x!r} is not {'an integer' if tp is int else 'a number'}")
                    if not math.isfinite(x):
                        raise ConfigError(f"{flag} must be a finite number (got {x})")
                    rule = VALUE_RANGES.get(f.name)
                    if rule is not None and not _RULES[rule](x):
                        raise ConfigError(f"{flag} must be {rule} (got {x}){_HINTS.get(f.name, '')}")
                if not is_list:
                    setattr(sec, f.name, tp(items[0]))
            elif "choices" in f.metadata and v not in f.metadata["choices"]:  # YAML bypasses argparse's choices
                raise ConfigError(f"{flag} {v!r} is not one of {', '.join(map(str, f.metadata['choices']))}")


def validate(cfg: Config, command: str = "train") -> None:
    """All start-up checks in one place. Raises ConfigError naming the flags and the fix."""
    _validate_values(cfg)
    c, r, b, a = cfg.cluster, cfg.rollout, cfg.batch, cfg.algorithm
    if c.train_backend not in TRAIN_BACKENDS:
        raise ConfigError(f"--train-backend {c.train_backend!r} is unknown; choose one of {', '.join(TRAIN_BACKENDS)}")
    if a.advantage_estimator not in ADV_ESTIMATORS:
        raise ConfigError(f"--advantage-estimator {a.advantage_estimator!r} is unknown; choose one of {', '.join(ADV_ESTIMATORS)}")
    if command in ("train", "sft") and not cfg.data.prompt_data:
        raise ConfigError("--prompt-data is required: a .jsonl or .parquet file of prompts")
    if command == "eval" and not (cfg.data.eval_prompt_data or cfg.data.prompt_data):
        raise ConfigError("polyrl eval needs --eval-prompt-data (or --prompt-data)")
    if not cfg.model.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required: a local HF model directory (config.json, weights, tokenizer)")
    if command == "train":
        per_step = r.rollout_batch_size * r.n_samples_per_prompt
        gbs = b.global_batch_size or per_step
        if gbs < 1 or per_step % gbs:
            raise ConfigError(
                f"--rollout-batch-size ({r.rollout_batch_size}) x --n-samples-per-prompt ({r.n_samples_per_prompt}) = {per_step} "
                f"samples per step is not divisible by --global-batch-size ({gbs}); pick a divisor of {per_step}")
    m = cfg.model
    if not m.enable_mtp_training and (m.mtp_loss_scaling_factor != ModelConfig.mtp_loss_scaling_factor
                                      or m.mtp_detach_encoder != ModelConfig.mtp_detach_encoder):
        raise ConfigError("--mtp-loss-scaling-factor / --no-mtp-detach-encoder set the MTP loss of "
                          "--enable-mtp-training: add it, or drop them")
    if m.enable_mtp_training and (m.true_on_policy or m.lora_rank):
        raise ConfigError(f"--enable-mtp-training with {'--true-on-policy' if m.true_on_policy else '--lora-rank'}: the "
                          "MTP loss runs in the packed / padded training forward with the full model; drop one of them")
    if m.enable_mtp_training and cfg.cluster.train_backend == "megatron" and cfg.megatron.pipeline_model_parallel_size > 1:
        raise ConfigError("--enable-mtp-training with --pipeline-model-parallel-size > 1: the MTP layers sit on the last "
                          "stage and need the token embedding of the first; use pipeline size 1 (or --train-backend fsdp)")
    if a.use_kl_loss and a.kl_loss_coef <= 0:
        raise ConfigError("--use-kl-loss needs a positive --kl-loss-coef")
    if b.use_dynamic_batch_size and not b.max_tokens_per_gpu:
        raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu (the token budget of one micro-batch)")
    if sum((cfg.model.fp16, cfg.model.bf16, cfg.model.fp32)) > 1:
        raise ConfigError("--fp16, --bf16 and --fp32 are exclusive; pick one")
    rw = cfg.reward
    if command == "train" and not (rw.rm_type or rw.custom_rm_path or rw.rm_url) and not cfg.debug.train_only \
            and not cfg.rollout.agent_function_path:  # an agent may return its reward
        raise ConfigError("a reward is required: --rm-type {math,gsm8k,exact,arithmetic}, --custom-rm-path module:function "
                          "or --rm-url URL")
    if cfg.reward.group_rm and not cfg.reward.custom_rm_path:
        raise ConfigError("--group-rm applies to --custom-rm-path functions; set one or drop --group-rm")
    _validate_remote_rm(rw)
    if cfg.model.true_on_policy and cfg.rollout.kv_cache_dtype != "auto":
        raise ConfigError(f"--true-on-policy with --kv-cache-dtype {cfg.rollout.kv_cache_dtype}: decode would attend "
                          "to rounded keys and values the trainer never sees; drop one of them (docs/true-on-policy.md)")
    r = cfg.rollout
    if r.kv_cache_dtype != "auto" and not cfg.engines.rollout_external and (command == "serve" or (
            command in ("train", "eval") and r.rollout_engine in ("embedded", "server"))):
        from polyrl.dist import resolve_device
        if resolve_device(cfg.cluster.device) == "cpu" or not r.rollout_gpu_engine:
            where = "on CPU" if r.rollout_gpu_engine else "with --no-rollout-gpu-engine"
            raise ConfigError(f"--kv-cache-dtype {r.kv_cache_dtype} {where}: only the embedded engine's GPU path (CUDA) "
                              "keeps a paged KV cache; drop the flag")
    if cfg.model.true_on_policy and cfg.rollout.rollout_quantization != "none":
        raise ConfigError(f"--true-on-policy with --rollout-quantization {cfg.rollout.rollout_quantization}: the engine "
                          "would sample from rounded weights that the trainer does not score with; drop one of them "
                          "(docs/true-on-policy.md)")
    _validate_logging(cfg.log, command)
    if cfg.data.multimodal_keys:
        from polyrl.multimodal import parse_multimodal_keys
        try:
            parse_multimodal_keys(cfg.data.multimodal_keys)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        dbg = cfg.debug
        # saved rollouts are JSON lines without the pixel inputs; a generate function drives turns the engine
        # renders as text; --true-on-policy's per-sample scoring runs the text alone
        for flag, on in (("--save-debug-rollout-data", dbg.save_debug_rollout_data), ("--debug-train-only", dbg.train_only),
                         ("--custom-generate-function-path", cfg.rollout.custom_generate_function_path),
                         ("--true-on-policy", cfg.model.true_on_policy)):
            if on:
                raise ConfigError(f"--multimodal-keys: {flag} does not carry images yet; drop one of them")
        if cfg.algorithm.advantage_estimator == "gae":  # the value model is a text-only HF class (*ForTokenClassification)
            raise ConfigError("--multimodal-keys with --advantage-estimator gae: the critic has no vision tower yet; "
                              "use a critic-free estimator (grpo, gspo, dr_grpo, reinforce_plus_plus)")
    if command == "train":
        _validate_debug(cfg)
        _validate_rl_extras(cfg)
        _validate_can_learn(cfg)
        if cfg.log.profile_step > cfg.rollout.num_rollout:
            raise ConfigError(f"--profile-step {cfg.log.profile_step} is past --num-rollout {cfg.rollout.num_rollout}: "
                              "no such step to profile")
    if cfg.checkpoint.load and not os.path.isdir(cfg.checkpoint.load):
        raise ConfigError(f"--load {cfg.checkpoint.load}: no such checkpoint directory")
    _validate_lora(cfg)
    if c.train_backend == "megatron":
        _validate_megatron(cfg.megatron)
        if cfg.model.gradient_checkpointing and cfg.megatron.recompute_granularity is not None:
            raise ConfigError("--gradient-checkpointing is megatron's --recompute-granularity full --recompute-method "
                              "uniform --recompute-num-layers 1: give either, not both")
    if command in ("train", "eval"):
        _validate_engines(cfg)
        _validate_turns(cfg)
        _validate_agent(cfg, command)
    if command == "train":
        _validate_ray(cfg)
    if c.device == "cuda" or c.dist_backend == "nccl":
        import torch
        if c.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but no CUDA device is visible; use --device cpu or auto")
        if c.dist_backend == "nccl" and (c.device == "cpu" or not torch.cuda.is_available()):
            raise ConfigError("--dist-backend nccl needs CUDA devices, and this run computes on the CPU: use "
                              "--dist-backend gloo (or auto)")
    _validate_resources(cfg, command)
    _validate_outputs(cfg, command)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def _check_model_dir(flag: str, path: str) -> None:
    what = "a local HF model directory (config.json, weights, tokenizer files)"
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such directory; expected {what}")
    files = os.listdir(path)
    if "config.json" not in files:
        raise ConfigError(f"{flag} {path}: no config.json; expected {what}")
    if not any(f in TOKENIZER_FILES or f.endswith(".tiktoken") for f in files):
        raise ConfigError(f"{flag} {path}: no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the base model's tokenizer "
                          "files into it (tokenizer.save_pretrained)")
    if not any(f.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")) for f in files):
        raise ConfigError(f"{flag} {path}: no weights (*.safetensors or pytorch_model*.bin); expected {what}")


def _validate_resources(cfg: Config, command: str) -> None:
    """What the flags point at: model directories, and custom functions (imported now, before any
    process group or model exists, so a typo costs a second, not a launch)."""
    _check_model_dir("--hf-checkpoint", cfg.model.hf_checkpoint)
    if cfg.model.ref_load:
        _check_model_dir("--ref-load", cfg.model.ref_load)
    if cfg.model.critic_load:
        _check_model_dir("--critic-load", cfg.model.critic_load)
    if cfg.model.opd_teacher_load and command != "train":
        raise ConfigError(f"--opd-teacher-load scores the samples of polyrl train; polyrl {command} has none: drop it")
    if cfg.model.opd_teacher_load:
        _check_model_dir("--opd-teacher-load", cfg.model.opd_teacher_load)
        _check_same_tokenizer(cfg.model.hf_checkpoint, cfg.model.opd_teacher_load)
    if command in ("train", "eval") and (cfg.reward.rm_type or cfg.reward.custom_rm_path):
        from polyrl.rewards import resolve_reward_fn
        try:
            resolve_reward_fn(cfg.reward.rm_type, cfg.reward.custom_rm_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if command in ("train", "eval") and cfg.rollout.custom_generate_function_path:
        from polyrl.rollout.custom import resolve_generate_fn
        try:
            resolve_generate_fn(cfg.rollout.custom_generate_function_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if command == "train" and cfg.rollout.dynamic_sampling_filter_path:
        from polyrl.rewards import resolve_filter_fn
        try:
            resolve_filter_fn(cfg.rollout.dynamic_sampling_filter_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    provider = cfg.megatron.custom_model_provider_path
    if cfg.cluster.train_backend == "megatron" and provider:  # megatron's modules import on GPU ranks: only locate it
        mod = provider.rpartition(":")[0]
        if mod.endswith(".py") and not os.path.isfile(mod):
            raise ConfigError(f"--custom-model-provider-path {provider!r}: no file {mod}")
        if mod and not mod.endswith(".py") and importlib.util.find_spec(mod.split(".")[0]) is None:
            raise ConfigError(f"--custom-model-provider-path {provider!r}: no module {mod.split('.')[0]!r} on the path")


def _check_same_tokenizer(student: str, teacher: str) -> None:
    """The teacher scores the student's token ids, so both must mean the same text by every id: equal tokenizer
    vocabularies (token -> id, added tokens included), and a teacher embedding at least as wide as the student's
    (sizes may differ by padding rows no tokenizer id reaches; a narrower teacher could not score every id)."""
    from transformers import AutoConfig, AutoTokenizer

    from polyrl.debug_rollout import tokenizer_identity  # vocabulary + special ids, one digest
    s_id, t_id = (tokenizer_identity(AutoTokenizer.from_pretrained(p)) for p in (student, teacher))
    if (s_id["vocab_size"], s_id["sha256"]) != (t_id["vocab_size"], t_id["sha256"]):
        raise ConfigError(f"--opd-teacher-load {teacher}: its tokenizer differs from --hf-checkpoint {student}'s "
                          f"({t_id['vocab_size']} vs {s_id['vocab_size']} tokens, vocabulary sha256 {t_id['sha256'][:12]} vs "
                          f"{s_id['sha256'][:12]}); on-policy distillation scores the student's token ids with the "
                          "teacher, so both need the same tokenizer: pick a teacher of the same model family")
    vs, vt = (getattr(AutoConfig.from_pretrained(p).get_text_config(), "vocab_size", None) for p in (student, teacher))
    if vs is not None and vt is not None and vt < vs:
        raise ConfigError(f"--opd-teacher-load {teacher}: vocab_size {vt} in its config.json is smaller than --hf-checkpoint "
                          f"{student}'s {vs}: the teacher cannot score every token id the student may sample")


def _validate_remote_rm(rw: RewardConfig) -> None:
    if not rw.rm_url:
        return
    if rw.custom_rm_path or rw.rm_type:
        given = "--custom-rm-path" if rw.custom_rm_path else "--rm-type"
        raise ConfigError(f"--rm-url and {given} both choose the reward: keep one (a custom function may call the remote "
                          "model itself)")
    scheme = rw.rm_url.partition("://")[0] if "://" in rw.rm_url else "http"
    if scheme not in ("http", "https"):
        raise ConfigError(f"--rm-url {rw.rm_url!r}: expected an http:// or https:// URL (or host:port/path)")


def _validate_logging(lg: LogConfig, command: str) -> None:
    if lg.use_wandb and command not in ("train", "sft"):
        raise ConfigError(f"--use-wandb logs the steps of polyrl train and polyrl sft; polyrl {command} writes its results "
                          "to RUN_DIR: drop --use-wandb")
    if not lg.use_wandb:
        if lg.wandb_project != "polyrl" or lg.wandb_group or lg.wandb_run_name or lg.wandb_mode != "online":
            raise ConfigError("--wandb-project, --wandb-group, --wandb-run-name and --wandb-mode configure Weights & Biases "
                              "logging: add --use-wandb")
        return
    if lg.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--use-wandb needs the wandb package: pip install 'polyrl[wandb]' (or --wandb-mode disabled)")


def _validate_debug(cfg: Config) -> None:
    g = cfg.debug
    if g.debug_rollout_only and g.train_only:
        raise ConfigError("--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) exclude each other: "
                          "pick the half of the loop to run")
    if g.debug_train_only and not g.load_debug_rollout_data:
        raise ConfigError("--debug-train-only trains on saved rollouts: add --load-debug-rollout-data PATH_TEMPLATE (files "
                          "written by --save-debug-rollout-data)")
    if g.save_debug_rollout_data and g.train_only:
        raise ConfigError("--save-debug-rollout-data with --load-debug-rollout-data (--debug-train-only) would write back "
                          "what it reads: drop one")
    if g.save_debug_rollout_data and "{rollout_id}" not in g.save_debug_rollout_data:
        raise ConfigError(f"--save-debug-rollout-data {g.save_debug_rollout_data!r}: put {{rollout_id}} in the path (one "
                          "file per step, e.g. dir/rollout_{rollout_id}.jsonl); without it every step overwrites the last")
    mode = "--debug-rollout-only" if g.debug_rollout_only else "--debug-train-only" if g.train_only else None
    if mode and cfg.rollout.async_training:
        raise ConfigError(f"{mode} runs one half of the synchronous loop: drop --async")
    if mode and cfg.ray.use_ray:
        raise ConfigError(f"{mode} is not supported with --use-ray: run it under torchrun or as one process")
    if g.train_only and cfg.rollout.custom_generate_function_path:
        raise ConfigError("--custom-generate-function-path generates the rollouts, and --debug-train-only reads them from "
                          "--load-debug-rollout-data files instead: drop one")
    if g.train_only and cfg.log.eval_interval:
        raise ConfigError("--eval-interval needs a rollout engine, and --debug-train-only builds none: drop --eval-interval")
def _validate_rl_extras(cfg: Config) -> None:
    """CISPO, dynamic sampling and overlong shaping against the flags they combine with."""
    r, a, rw = cfg.rollout, cfg.algorithm, cfg.reward
    if a.policy_loss == "cispo" and a.advantage_estimator == "gspo":
        raise ConfigError("--advantage-estimator gspo is a sequence-ratio PPO-clip loss; --policy-loss cispo clips token "
                          "ratios: use --advantage-estimator grpo with cispo, or drop --policy-loss cispo")
    if a.policy_loss == "cispo" and a.eps_clip_c is not None:
        raise ConfigError("--eps-clip-c (dual clip) bounds the PPO-clip loss; --policy-loss cispo has no such term: drop one")
    if r.over_sampling_batch_size is not None:
        if not (r.dynamic_sampling_filter_path or r.partial_rollout):
            raise ConfigError("--over-sampling-batch-size draws extra prompts for dynamic sampling or partial rollout: set "
                              "--dynamic-sampling-filter-path (e.g. polyrl.rewards.filters:nonzero_std) or "
                              "--partial-rollout, or drop it")
        if r.over_sampling_batch_size < r.rollout_batch_size:
            raise ConfigError(f"--over-sampling-batch-size ({r.over_sampling_batch_size}) must be >= --rollout-batch-size "
                              f"({r.rollout_batch_size}): each draw should be able to fill the step")
    if a.opd_coef != 1.0 and not cfg.model.opd_teacher_load:
        raise ConfigError(f"--opd-coef {a.opd_coef} weighs on-policy distillation: add --opd-teacher-load TEACHER_DIR or "
                          "drop --opd-coef")
    _validate_moe(cfg)
    _validate_critic(cfg)
    if rw.overlong_buffer_len > r.rollout_max_response_len:
        raise ConfigError(f"--overlong-buffer-len ({rw.overlong_buffer_len}) must be <= --rollout-max-response-len "
                          f"({r.rollout_max_response_len}): the penalty starts that many tokens before the limit")


def _validate_agent(cfg: Config, command: str) -> None:
    r = cfg.rollout
    if not r.agent_function_path:
        for flag, name in (("--agent-concurrency", "agent_concurrency"), ("--agent-timeout", "agent_timeout"),
                           ("--agent-samples-per-trajectory", "agent_samples_per_trajectory")):
            if getattr(r, name) != getattr(RolloutConfig, name):
                raise ConfigError(f"{flag} configures the agents of --agent-function-path: set it or drop {flag}")
        return
    if r.custom_generate_function_path:
        raise ConfigError("--agent-function-path and --custom-generate-function-path both generate the rollouts: keep one")
    if cfg.debug.train_only:
        raise ConfigError("--agent-function-path generates the rollouts, and --debug-train-only reads them from "
                          "--load-debug-rollout-data files instead: drop one")
    if r.partial_rollout:
        raise ConfigError("--agent-function-path with --partial-rollout: an agent's trajectory cannot be paused and "
                          "resumed under new weights; drop one of them")
    if cfg.data.multimodal_keys:
        raise ConfigError("--agent-function-path with --multimodal-keys: the gateway's chat routes take text only")
    if command in ("train", "eval"):
        from polyrl.rollout.agent import resolve_agent_fn
        try:
            resolve_agent_fn(r.agent_function_path)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _validate_turns(cfg: Config) -> None:
    r, ctx = cfg.rollout, cfg.rollout.rollout_max_context_len
    if r.max_turns is not None and not (r.custom_generate_function_path or r.agent_function_path):
        raise ConfigError(f"--max-turns {r.max_turns} limits the turns of a --custom-generate-function-path; a plain "
                          "rollout is one turn: set the function or drop --max-turns")
    if ctx is not None and (cfg.data.rollout_max_prompt_len or 0) >= ctx:
        raise ConfigError(f"--rollout-max-prompt-len ({cfg.data.rollout_max_prompt_len}) must be < --rollout-max-context-len "
                          f"({ctx}): a prompt needs room for at least one response token")


def _validate_moe(cfg: Config) -> None:
    m = cfg.model
    if m.use_routing_replay and m.use_rollout_routing_replay:
        raise ConfigError("--use-routing-replay (R2) and --use-rollout-routing-replay (R3) both choose which routes the "
                          "training forwards replay; keep one (R3 already replays the rollout's routes in every forward)")
    if cfg.cluster.train_backend == "fsdp" and m.moe_aux_loss_coeff and m.moe_router_load_balancing_type not in (
            "aux_loss", "none"):
        raise ConfigError(f"--moe-router-load-balancing-type {m.moe_router_load_balancing_type}: the FSDP backend has "
                          "aux_loss and none; use --train-backend megatron for the others")
    if (m.use_routing_replay or m.use_rollout_routing_replay or m.return_routed_experts or m.moe_aux_loss_coeff
            or m.moe_z_loss_coeff) and m.hf_checkpoint and os.path.isdir(m.hf_checkpoint):
        from transformers import AutoConfig
        text = AutoConfig.from_pretrained(m.hf_checkpoint).get_text_config()
        if not any(getattr(text, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            flag = next(f for f, on in (("--use-routing-replay", m.use_routing_replay),
                                        ("--use-rollout-routing-replay", m.use_rollout_routing_replay),
                                        ("--return-routed-experts", m.return_routed_experts),
                                        ("--moe-aux-loss-coeff", m.moe_aux_loss_coeff), ("--moe-z-loss-coeff", True)) if on)
            raise ConfigError(f"{flag} applies to MoE models; --hf-checkpoint {m.hf_checkpoint} has no experts: drop it")


def _validate_critic(cfg: Config) -> None:
    a, o = cfg.algorithm, cfg.optimizer
    if a.advantage_estimator == "gae":
        return
    given = [f for f, on in (("--critic-load", cfg.model.critic_load), ("--critic-lr", o.critic_lr is not None),
                             ("--critic-num-warmup-steps", o.critic_num_warmup_steps is not None),
                             ("--lambd", a.lambd != 1.0), ("--value-clip", a.value_clip != 0.5)) if on]
    if given:
        raise ConfigError(f"{', '.join(given)} configure the critic of PPO with GAE: add --advantage-estimator gae, or "
                          f"drop them (--advantage-estimator {a.advantage_estimator} trains no critic)")


def _validate_ray(cfg: Config) -> None:
    y, e, r = cfg.ray, cfg.engines, cfg.rollout
    if not y.use_ray:
        if y.colocate or y.actor_num_nodes != 1 or y.actor_num_gpus_per_node != 1 or y.ray_address:
            raise ConfigError("--colocate, --actor-num-nodes, --actor-num-gpus-per-node and --ray-address place Ray actors: "
                              "add --use-ray (under torchrun, --nproc-per-node sets the ranks)")
        if y.max_restarts:
            raise ConfigError("--max-restarts restarts Ray's train actors: add --use-ray, or under torchrun pass it to "
                              "torchrun itself (torchrun --max-restarts N ... -m polyrl train --save DIR ...)")
        return
    if y.max_restarts and not cfg.checkpoint.save:
        raise ConfigError(f"--max-restarts {y.max_restarts} resumes restarted train actors from --save: add --save DIR "
                          "--save-interval N")
    if os.environ.get("RANK") is not None:
        raise ConfigError("--use-ray places the train ranks itself: run `polyrl train --use-ray ...` once, not under torchrun")
    if e.rollout_external:
        raise ConfigError("--use-ray starts its engines as Ray actors; --rollout-external attaches to running servers: "
                          "drop one of them")
    if y.colocate and r.rollout_engine not in ("embedded", "server"):
        raise ConfigError(f"--use-ray --colocate runs the embedded engine inside each train actor, or one `polyrl serve` "
                          f"actor beside each on its GPU (--rollout-engine server); --rollout-engine {r.rollout_engine} "
                          "servers on the train actors' GPUs are not supported under Ray: drop --colocate to give them "
                          "GPUs of their own")
    if y.colocate and r.rollout_engine == "server":
        if r.async_training:
            raise ConfigError("--use-ray --colocate --rollout-engine server: the train and engine actors take turns on "
                              "each GPU, which --async cannot (it trains while the engines generate): drop --async or "
                              "--colocate")
        if (e.rollout_num_engines or y.actor_num_nodes * y.actor_num_gpus_per_node) != y.actor_num_nodes * \
                y.actor_num_gpus_per_node or e.rollout_num_gpus:
            raise ConfigError("--use-ray --colocate --rollout-engine server puts one engine actor on each train actor's "
                              "GPU: drop --rollout-num-engines / --rollout-num-gpus (the train actors set the count)")
    if not y.colocate and r.rollout_engine == "embedded":
        raise ConfigError("--use-ray without --colocate puts the engines on GPUs of their own, as servers: add "
                          "--rollout-engine server (or sglang), or --colocate to keep the embedded engine in the train actors")


def _validate_partial_rollout(cfg: Config) -> None:
    """--partial-rollout and the length-controlled workload against the flags they cannot combine with yet."""
    r, m = cfg.rollout, cfg.model
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        raise ConfigError("--mask-offpolicy-in-partial-rollout masks the resumed tokens of --partial-rollout: add it or "
                          "drop the flag")
    if r.partial_rollout:
        for flag, on, why in (
                ("--custom-generate-function-path", r.custom_generate_function_path, "a multi-turn call cannot be cut and "
                 "resumed"),
                ("--true-on-policy", m.true_on_policy, "resumed tokens come from older weights, which the trainer does not "
                 "score with"),
                ("--use-rollout-routing-replay", m.use_rollout_routing_replay, "the routes of a resumed response are not "
                 "carried across the cut"),
                ("--return-routed-experts", m.return_routed_experts, "the routes of a resumed response are not carried "
                 "across the cut"),
                ("--multimodal-keys", cfg.data.multimodal_keys, "a resumed image prompt is not re-sent with its images"),
                ("--debug-train-only", cfg.debug.train_only, "it reads finished samples from files")):
            if on:
                raise ConfigError(f"--partial-rollout with {flag}: {why}; drop one of them")
    if r.rollout_length_distribution:
        from polyrl.rollout.lengths import LengthSpecError, parse_length_distribution
        try:
            dist = parse_length_distribution(r.rollout_length_distribution)
        except LengthSpecError as e:
            raise ConfigError(str(e)) from None
        if dist.cap > r.rollout_max_response_len:
            raise ConfigError(f"--rollout-length-distribution {r.rollout_length_distribution}: its cap ({dist.cap}) is "
                              f"past --rollout-max-response-len ({r.rollout_max_response_len}); lower the cap or raise "
                              "the limit")
        if r.custom_generate_function_path:
            raise ConfigError("--rollout-length-distribution with --custom-generate-function-path: a multi-turn "
                              "sample's length is its function's; drop one of them")


def _validate_engines(cfg: Config) -> None:
    e, r = cfg.engines, cfg.rollout
    if r.max_staleness is not None and not (r.async_training or r.partial_rollout):
        raise ConfigError(f"--max-staleness {r.max_staleness} only applies with --async or --partial-rollout (the "
                          "synchronous loop trains on samples of the current policy)")
    if r.async_training and r.max_staleness is None:
        r.max_staleness = 1  # one-step-off
    _validate_partial_rollout(cfg)
    if e.rollout_external and not e.rollout_external_engine_addrs:
        raise ConfigError("--rollout-external needs --rollout-external-engine-addrs URL [URL ...] (running SGLang or polyrl serve servers)")
    if e.rollout_external_engine_addrs and not e.rollout_external:
        raise ConfigError("--rollout-external-engine-addrs is given without --rollout-external; add it to attach to those servers")
    if e.rollout_external_colocated and not e.rollout_external:
        raise ConfigError("--rollout-external-colocated describes --rollout-external servers; launched servers share the "
                          "trainer's GPUs whenever the GPUs past the trainer's cannot hold them: drop it")
    if e.rollout_external_colocated and r.async_training:
        raise ConfigError("--async trains while the engines generate, so they cannot take turns on the trainer's GPUs: "
                          "drop --rollout-external-colocated (or --async)")
    in_process = r.rollout_engine == "embedded" and not e.rollout_external
    if in_process and e.weight_sync in ("distributed", "disk"):
        raise ConfigError(f"--weight-sync {e.weight_sync} needs engine servers (--rollout-engine server|sglang or "
                          "--rollout-external); the embedded engine takes tensors in process (--weight-sync tensor)")
    if not in_process and e.weight_sync == "tensor":
        raise ConfigError("--weight-sync tensor moves tensors inside the trainer's process; engine servers take "
                          "--weight-sync distributed (a process group) or disk")
    if in_process and (e.use_sglang_router or e.sglang_args):
        raise ConfigError("--use-sglang-router and --sglang-* flags apply to engine servers (--rollout-engine server|sglang "
                          "or --rollout-external)")
    if e.sglang_args and r.rollout_engine != "sglang":
        raise ConfigError(f"{' '.join(a for a in e.sglang_args if a.startswith('--'))}: --sglang-* flags pass through "
                          "to SGLang servers that polyrl launches (--rollout-engine sglang)")
    for flag, v, lo in (("--rollout-num-engines", e.rollout_num_engines, 1), ("--rollout-num-gpus", e.rollout_num_gpus, 1),
                        ("--rollout-num-gpus-per-engine", e.rollout_num_gpus_per_engine, 1)):
        if v is not None and v < lo:
            raise ConfigError(f"{flag} must be >= {lo} (got {v})")
    for flag, v in (("--rollout-health-check-interval", e.rollout_health_check_interval),
                    ("--rollout-request-timeout", e.rollout_request_timeout),
                    ("--rollout-engine-startup-timeout", e.rollout_engine_startup_timeout)):
        if not v > 0:
            raise ConfigError(f"{flag} must be > 0 seconds (got {v})")
    if e.use_sglang_router and importlib.util.find_spec("sglang_router") is None:
        raise ConfigError("--use-sglang-router needs the sglang-router package: pip install sglang-router")


def _validate_lora(cfg: Config) -> None:
    m, ck = cfg.model, cfg.checkpoint
    if m.lora_rank == 0:
        given = [f for f, v, d in (("--lora-alpha", m.lora_alpha, 16), ("--lora-dropout", m.lora_dropout, 0.0),
                                   ("--lora-target-modules", m.lora_target_modules, "all-linear"),
                                   ("--save-hf-adapter", ck.save_hf_adapter, False)) if v != d]
        if given:
            raise ConfigError(f"{', '.join(given)} configure LoRA: add --lora-rank R (> 0), or drop them")
        return
    if cfg.cluster.train_backend == "megatron" and cfg.megatron.use_megatron_fsdp:
        raise ConfigError("--lora-rank with --use-megatron-fsdp: megatron's LoRA runs on its DDP / distributed optimizer; "
                          "drop --use-megatron-fsdp")
    targets = m.lora_targets()
    if isinstance(targets, list) and not all(targets):
        raise ConfigError(f"--lora-target-modules {m.lora_target_modules!r}: expected all-linear or a comma list of "
                          "module names without empty entries, e.g. q_proj,v_proj")
    if m.ref_load:
        raise ConfigError("--ref-load with --lora-rank: the LoRA reference model is the base model with the adapters "
                          "off (no second copy); drop --ref-load")
    if cfg.algorithm.ref_update_interval:
        raise ConfigError("--ref-update-interval with --lora-rank: the LoRA reference model is the base model with the "
                          "adapters off and stays that; drop --ref-update-interval")
    if ck.save_hf_adapter and not ck.save_hf:
        raise ConfigError("--save-hf-adapter chooses what --save-hf writes: add --save-hf OUT_DIR")
    if cfg.cluster.train_backend == "fsdp" and importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora-rank needs the peft package: pip install 'polyrl[lora]' (or pip install peft)")


def _validate_megatron(m: MegatronConfig) -> None:
    """Degrees against the launch's world size (torchrun's WORLD_SIZE; 1 for a plain launch)."""
    from polyrl.backends.parallel_dims import ParallelDims

    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if m.num_layers_per_virtual_pipeline_stage is not None and m.pipeline_model_parallel_size == 1:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError("--recompute-method applies to --recompute-granularity full")
    if m.optimizer_cpu_offload and (m.use_megatron_fsdp or not m.use_distributed_optimizer):
        raise ConfigError("--optimizer-cpu-offload needs megatron's distributed optimizer (--use-distributed-optimizer) "
                          "and not --use-megatron-fsdp")
    if m.use_megatron_fsdp and not m.release_grad_buffers:
        raise ConfigError("--no-release-grad-buffers keeps megatron DDP's gradient buffers; Megatron-FSDP "
                          "(--use-megatron-fsdp) manages its own: drop --no-release-grad-buffers")
    for item in m.override_ddp_config:
        if "=" not in item:
            raise ConfigError(f"--override-ddp-config {item!r}: expected key=value")
    try:
        ParallelDims(world_size=int(os.environ.get("WORLD_SIZE", "1")), tp=m.tensor_model_parallel_size,
                     pp=m.pipeline_model_parallel_size, cp=m.context_parallel_size, ep=m.expert_model_parallel_size,
                     etp=m.expert_tensor_parallel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# Estimators whose advantage is a sample's reward against its prompt group's (polyrl/algorithms/advantages.py): with one
# sample per group, or identical samples, every advantage is 0.
GROUP_RELATIVE_ESTIMATORS = ("grpo", "gspo", "dr_grpo", "reinforce_plus_plus_baseline")


def _validate_one_reward(rw: RewardConfig) -> None:
    if rw.rm_type and rw.custom_rm_path:
        raise ConfigError(f"--rm-type {rw.rm_type} and --custom-rm-path {rw.custom_rm_path} both choose the reward: keep one "
                          "(a custom function may call polyrl.rewards' built-ins itself)")


def _validate_can_learn(cfg: Config) -> None:
    """`polyrl train` runs whose every advantage is 0, or whose settings nothing reads, refused before anything starts.
    Exempt: a --custom-generate-function-path (it may return several, differently sampled samples per call), rollouts
    read from files (--debug-train-only), runs that do not train (--debug-rollout-only), and on-policy distillation
    (the teacher's term trains whatever the rewards)."""
    r, a, lg = cfg.rollout, cfg.algorithm, cfg.log
    _validate_one_reward(cfg.reward)
    est = a.advantage_estimator
    exempt = (r.custom_generate_function_path or cfg.debug.train_only or cfg.debug.debug_rollout_only
              or cfg.model.opd_teacher_load)
    if not exempt and est in GROUP_RELATIVE_ESTIMATORS:
        if r.n_samples_per_prompt == 1:
            raise ConfigError(f"--n-samples-per-prompt 1 with --advantage-estimator {est}: its advantage is a sample's reward "
                              "against the mean of its prompt's group, so with one sample per prompt every advantage is 0 "
                              "and nothing trains; use --n-samples-per-prompt 2 or more (4-16 is usual), or "
                              "--advantage-estimator reinforce_plus_plus (normalized over the batch)")
        if r.rollout_temperature == 0:
            raise ConfigError(f"--rollout-temperature 0 (greedy) with --advantage-estimator {est}: the "
                              f"{r.n_samples_per_prompt} samples of a prompt are identical, so their rewards are equal and "
                              "every advantage is 0; sample with --rollout-temperature > 0 (1.0 is usual)")
    if cfg.data.eval_prompt_data and not lg.eval_interval:
        raise ConfigError(f"--eval-prompt-data {cfg.data.eval_prompt_data} is set but --eval-interval is 0, so no evaluation "
                          "would run: add --eval-interval N (every N steps, at the end and before the first step), or drop "
                          "--eval-prompt-data (set in a --config file: --eval-prompt-data '')")
    if lg.eval_interval and not cfg.data.eval_prompt_data:
        raise ConfigError(f"--eval-interval {lg.eval_interval} has no prompts to evaluate on: add --eval-prompt-data PATH, "
                          "or drop --eval-interval")


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _checkpoint_run_dir(load: str) -> str | None:
    """The run dir of the run that wrote the checkpoint --load names (None when it cannot be told: no such checkpoint,
    which loading reports, or one whose config names none)."""
    import json
    from polyrl.checkpoint import CheckpointError, resolve_checkpoint
    try:
        with open(os.path.join(resolve_checkpoint(load), "loop_state.json")) as f:
            state = json.load(f)
    except (CheckpointError, OSError, ValueError):
        return None
    return state.get("run_dir") or (state.get("config") or {}).get("log", {}).get("run_dir")


def _validate_outputs(cfg: Config, command: str) -> None:
    """What the run writes must not land on what the user owns, and output flags a command would ignore are refused."""
    ck, m, lg = cfg.checkpoint, cfg.model, cfg.log
    if command == "eval":
        _validate_one_reward(cfg.reward)
    if ck.save_hf:
        outs = [("--save-hf", ck.save_hf)]
        if cfg.algorithm.advantage_estimator == "gae" and command == "train":
            outs.append(("--save-hf (its critic)", ck.save_hf.rstrip("/") + "_critic"))
        for out_flag, out in outs:
            for flag, src in (("--hf-checkpoint", m.hf_checkpoint), ("--ref-load", m.ref_load),
                              ("--critic-load", m.critic_load), ("--opd-teacher-load", m.opd_teacher_load)):
                if src and _same_dir(out, src):
                    raise ConfigError(f"{out_flag} {out} is the {flag} directory: the export would overwrite the model it "
                                      "was read from; choose another --save-hf directory")
    if lg.ci_train_rollout_logprob_abs_diff_threshold is not None and (command != "train" or cfg.debug.debug_rollout_only):
        where = "--debug-rollout-only trains nothing" if command == "train" else f"polyrl {command} trains no policy"
        raise ConfigError(f"--ci-train-rollout-logprob-abs-diff-threshold compares training and rollout log-probs of a "
                          f"training step; {where}: drop it")
    if ck.max_wall_time and not ck.save:
        raise ConfigError(f"--max-wall-time {ck.max_wall_time:g} stops the run with a checkpoint to resume from: add "
                          "--save DIR")
    if ck.async_save and not ck.save:
        raise ConfigError("--async-save writes --save's checkpoints in the background: add --save DIR")
    if ck.max_wall_time and cfg.ray.use_ray:
        raise ConfigError("--max-wall-time stops the loop of this process at a step boundary; with --use-ray the loop runs "
                          "in the train actors: drop one of them")
    if cfg.reward.max_consecutive_failed_steps and command != "train":
        raise ConfigError(f"--max-consecutive-failed-steps counts the training steps of polyrl train; polyrl {command} has "
                          "none: drop it")
    if lg.overwrite and command not in ("train", "sft"):
        raise ConfigError(f"--overwrite lets polyrl train / sft start afresh in a used --run-dir; polyrl {command} "
                          "rewrites its own files: drop it")


def check_run_dir(cfg: Config, command: str) -> None:
    """A --run-dir whose metrics.jsonl holds an earlier run's steps is refused unless --overwrite (start afresh) or
    --load of a checkpoint that run wrote (resume: the logger cuts metrics.jsonl at the resumed step), so no curve ever
    shows steps 1, 2, 3, 1, 2, 3 and no resume cuts another run's rows. Called by the CLI, not validate(): it reads the
    disk where the run would write."""
    if command not in ("train", "sft"):
        return
    path = os.path.join(cfg.log.run_dir, "metrics.jsonl")
    if cfg.checkpoint.load:
        saved = _checkpoint_run_dir(cfg.checkpoint.load)
        if (saved is not None and not _same_dir(saved, cfg.log.run_dir) and os.path.isfile(path)
                and os.path.getsize(path) > 0):
            raise ConfigError(f"--load {cfg.checkpoint.load} was saved by the run logging to --run-dir {saved}, and "
                              f"--run-dir {cfg.log.run_dir} holds another run's steps ({path}), which the resume would "
                              f"cut at the checkpoint's step: resume with --run-dir {saved}, or an empty --run-dir")
        return
    if cfg.log.overwrite:
        return
    if os.path.isfile(path) and os.path.getsize(path) > 0:
        raise ConfigError(f"--run-dir {cfg.log.run_dir} holds an earlier run ({path} has its steps): pass another "
                          "--run-dir, --overwrite to start afresh there (its metrics.jsonl is emptied), or --load "
                          "CHECKPOINT to resume that run")
