"""No flag silently ignored: which capability each flag needs, and the start-up check that refuses a flag the chosen
backend (--train-backend) or engine kind (--rollout-engine / --rollout-external) would not honour.

Backends and engines declare what they honour in `polyrl.backends.base.BACKEND_CAPABILITIES` and
`polyrl.rollout.base.ENGINE_CAPABILITIES`. Every config field is either honoured by every kind (UNIVERSAL, or a
section that only one command or one placement reads and validates itself: SELF_CHECKED_SECTIONS) or listed in NEEDS;
tests/test_capabilities.py walks every field and every kind and fails when one is neither honoured nor refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from polyrl.backends.base import BACKEND_CAPABILITIES
from polyrl.backends.true_on_policy import refuse_unsupported as refuse_for_true_on_policy
from polyrl.config import Config, ConfigError, _flag
from polyrl.placement import engine_kind, plan_here
from polyrl.rollout.base import ENGINE_CAPABILITIES


@dataclass(frozen=True)
class Need:
    who: str  # "backend" | "engine"
    capability: str
    given: Callable[[Any, Any], bool] | None = None  # (value, default) -> the flag asks for something; default: value != default
    unless: Callable[[Config], bool] | None = None  # the flag is honoured another way in this config (e.g. by Ray)


def _on(v, default) -> bool:  # a tri-state flag (None = auto) asks for the feature only when forced on
    return v is True


NEEDS: dict[str, Need] = {
    # model / backend
    "offload_train": Need("backend", "offload"),
    "fsdp_cpu_offload": Need("backend", "cpu_offload_optimizer"),
    "gradient_checkpointing": Need("backend", "gradient_checkpointing"),
    "compile": Need("backend", "compile", given=_on),
    "attn_implementation": Need("backend", "attn_implementation"),
    "micro_batch_layout": Need("backend", "micro_batch_layout"),
    "lora_rank": Need("backend", "lora"),
    "lora_alpha": Need("backend", "lora"),
    "lora_target_modules": Need("backend", "lora"),
    "lora_dropout": Need("backend", "lora"),
    "save_hf_adapter": Need("backend", "lora"),
    # the engine kind, the device and the settings it cannot keep exact: polyrl.backends.true_on_policy
    "true_on_policy": Need("backend", "true_on_policy"),
    "enable_mtp_training": Need("backend", "mtp_training"),
    "mtp_loss_scaling_factor": Need("backend", "mtp_training"),
    "mtp_detach_encoder": Need("backend", "mtp_training"),
    "multimodal_keys": Need("backend", "images"),
    "save_optim": Need("backend", "save_without_optimizer"),
    "async_save": Need("backend", "async_save"),
    "freeze_vision_tower": Need("backend", "images"),
    # rollout engines
    "rollout_batch_generate": Need("engine", "embedded_settings"),
    "rollout_gpu_engine": Need("engine", "embedded_settings"),
    "rollout_mem_fraction": Need("engine", "mem_fraction"),
    "rollout_cuda_graph": Need("engine", "embedded_settings"),
    "rollout_quantization": Need("engine", "fp8_rollout"),
    "kv_cache_dtype": Need("engine", "kv_cache_dtype"),
    "rollout_num_engines": Need("engine", "launch"),
    "rollout_num_gpus": Need("engine", "launch"),
    "rollout_num_gpus_per_engine": Need("engine", "launch"),
    "rollout_engine_log_dir": Need("engine", "launch"),
    # Ray waits on its placement group with this timeout whatever the engine
    "rollout_engine_startup_timeout": Need("engine", "launch", unless=lambda c: c.ray.use_ray),
    "rollout_external_startup_timeout": Need("engine", "attach"),
    "rollout_external_colocated": Need("engine", "attach"),
    "rollout_health_check_interval": Need("engine", "servers"),
    "api_key": Need("engine", "servers"),
    "api_key_file": Need("engine", "servers"),
    "use_fault_tolerance": Need("engine", "fault_tolerance"),
    "check_weight_update_equal": Need("engine", "weight_read_back"),
    "use_sglang_router": Need("engine", "router"),
    "sglang_router_policy": Need("engine", "router"),
    "sglang_args": Need("engine", "sglang_args"),
    "partial_rollout": Need("engine", "partial_rollout"),
    # a real SGLang refuses polyrl_stop_length (polyrl.rollout.server.STOP_LENGTH_KEY): polyrl's own engines only
    "rollout_length_distribution": Need("engine", "length_control"),
}
# every field of --train-backend megatron's own section
NEEDS.update({f.name: Need("backend", "megatron_parallelism") for f in dataclasses.fields(Config().megatron)})

# sections read by one command or one placement, each validated where it is read: `server` by `polyrl serve` (its
# parser takes only those), `ray` by config._validate_ray (its flags without --use-ray are refused there), `debug` by
# config._validate_debug.
SELF_CHECKED_SECTIONS = ("server", "ray", "debug")

# fields every backend and engine kind honours (the loop, the data, rewards, algorithms, optimizer, logging, checkpoints)
UNIVERSAL_SECTIONS = ("data", "algorithm", "reward", "optimizer", "checkpoint", "log")
UNIVERSAL_FIELDS = {
    "cluster": {"train_backend", "seed", "device", "dist_backend", "distributed_timeout_minutes"},
    "rollout": {"rollout_batch_size", "n_samples_per_prompt", "rollout_temperature", "rollout_top_p", "rollout_top_k",
                "rollout_max_response_len", "rollout_stop", "rollout_stop_token_ids", "rollout_seed", "num_rollout",
                "eval_temperature", "rollout_engine", "async_training", "max_staleness", "dynamic_sampling_filter_path",
                "over_sampling_batch_size", "max_dynamic_sampling_draws", "custom_generate_function_path",
                "custom_generate_concurrency", "max_turns", "rollout_max_context_len", "agent_function_path",
                "agent_concurrency", "agent_timeout", "agent_samples_per_trajectory", "mask_offpolicy_in_partial_rollout"},
    "engines": {"rollout_external", "rollout_external_engine_addrs", "weight_sync", "rollout_request_timeout"},
    "batch": {"global_batch_size", "micro_batch_size", "use_dynamic_batch_size", "max_tokens_per_gpu", "num_epoch"},
    "model": {"hf_checkpoint", "ref_load", "opd_teacher_load", "critic_load", "fp16", "bf16", "fp32",
              "update_weight_buffer_size", "logprob_chunk_size", "use_routing_replay", "use_rollout_routing_replay",
              "return_routed_experts", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type"},
}

ENGINE_COMMANDS = ("train", "eval")  # the commands that build a rollout engine


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _kind_flags(cfg: Config, who: str) -> tuple[str, frozenset[str], str]:
    if who == "backend":
        name = cfg.cluster.train_backend
        return name, BACKEND_CAPABILITIES[name], f"--train-backend {name}"
    kind = engine_kind(cfg)
    shown = {"external": "--rollout-external", "none": "--debug-train-only (no engine)"}.get(kind, f"--rollout-engine {kind}")
    return kind, ENGINE_CAPABILITIES[kind], shown


def check_setup(cfg: Config, command: str) -> None:
    """After config.validate: no flag the chosen kinds would ignore, and a layout that can exist (the placement plan,
    computed before any model is built)."""
    refuse_unhonoured(cfg, command)
    refuse_for_true_on_policy(cfg, command)
    refuse_for_model(cfg, command)
    if command in ENGINE_COMMANDS:
        plan_here(cfg)


def refuse_for_model(cfg: Config, command: str) -> None:
    """ConfigError for flags the FSDP backend cannot run this checkpoint's architecture with, and --enable-mtp-training
    on a checkpoint without MTP layers (either backend), read from its config.json before any weight loads."""
    fsdp = cfg.cluster.train_backend == "fsdp"
    if command not in ("train", "sft") or not (fsdp or cfg.model.enable_mtp_training):
        return
    path = cfg.model.hf_checkpoint
    from polyrl import hf_families
    hf_config = hf_families.checkpoint_config(path)
    if hf_config is None:
        return  # a missing checkpoint is named where it is loaded
    problem = (hf_families.fsdp_layout_problem(hf_config, cfg.model.attn_implementation, cfg.batch.micro_batch_layout)
               if fsdp else None)
    if problem is not None:
        raise ConfigError(f"--train-backend fsdp with {path}: {problem}")
    if cfg.model.enable_mtp_training and not hf_families.mtp_depths(hf_config):
        kind = getattr(hf_config, "model_type", "?")
        carried = int(getattr(hf_config, "num_nextn_predict_layers", 0) or getattr(hf_config, "mtp_num_hidden_layers", 0) or 0)
        if carried:  # e.g. Qwen3.5 / DeepSeek-V3: the checkpoint has them, transformers' model drops them on load
            raise ConfigError(f"--enable-mtp-training: {path} ({kind}) carries {carried} multi-token-prediction "
                              "layer(s), but polyrl builds and trains MTP layers for MiMo checkpoints only")
        raise ConfigError(f"--enable-mtp-training: {path} has no multi-token-prediction layers "
                          f"({kind}; MiMo checkpoints carry them)")


def refuse_unhonoured(cfg: Config, command: str = "train") -> None:
    """Raise ConfigError for the first flag that `cfg` sets and the chosen backend or engine kind would ignore."""
    for sname in ("cluster", "data", "rollout", "engines", "batch", "model", "checkpoint", "megatron"):
        sec = getattr(cfg, sname)
        for f in dataclasses.fields(sec):
            need = NEEDS.get(f.name)
            if need is None or (need.who == "engine" and command not in ENGINE_COMMANDS):
                continue
            value, default = getattr(sec, f.name), _default(f)
            asked = need.given(value, default) if need.given else value != default
            if not asked or (need.unless is not None and need.unless(cfg)):
                continue
            kind, caps, shown = _kind_flags(cfg, need.who)
            if need.capability not in caps:
                who = [k for k, c in (BACKEND_CAPABILITIES if need.who == "backend" else ENGINE_CAPABILITIES).items()
                       if need.capability in c]
                name = _flag(f) if not (default is True and value is False) else "--no-" + _flag(f)[2:]
                raise ConfigError(f"{name} is not honoured by {shown} (it applies to: {', '.join(who)}); drop it"
                                  f"{_HINTS.get((f.name, kind), '')}")
    e = cfg.engines
    if command in ENGINE_COMMANDS and e.sglang_router_policy != "cache_aware" and not e.use_sglang_router:
        raise ConfigError(f"--sglang-router-policy {e.sglang_router_policy} configures the sglang-router: add "
                          "--use-sglang-router, or drop it (without the router polyrl spreads requests itself)")


_HINTS = {
    ("fsdp_cpu_offload", "megatron"): " (it is FSDP2's CPUOffloadPolicy); megatron's optimizer CPU offload is "
                                      "--optimizer-cpu-offload (megatron-core's hybrid-device optimizer)",
    ("attn_implementation", "megatron"): " (Megatron runs its own attention)",
    ("micro_batch_layout", "megatron"): " (Megatron packs micro-batches as THD sequences)",
    ("check_weight_update_equal", "embedded"): " (the embedded engine takes the trainer's tensors in its own process)",
    ("use_fault_tolerance", "embedded"): " (the embedded engine lives in the trainer's process: nothing to restart)",
    ("rollout_engine_startup_timeout", "external"): " (attached servers run already: "
                                                    "--rollout-external-startup-timeout bounds the wait for them)",
    ("kv_cache_dtype", "external"): " (an attached server keeps the KV cache it was started with: start SGLang with "
                                    "--kv-cache-dtype fp8_e4m3 yourself, or let polyrl launch it)",
    ("rollout_quantization", "external"): " unless every server loads block-FP8 weights: an SGLang server launched on a "
                                          "BF16 checkpoint would not read the scales; let polyrl launch SGLang "
                                          "(--rollout-engine sglang), which starts it on an FP8 copy "
                                          "(docs/low-precision.md)",
}
