"""`polyrl train | sft | eval | serve | plot | export-hf`."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import sys

from polyrl.config import ConfigError, ServerConfig, add_config_args, config_from_args, validate
from polyrl.cpu_env import CPU_HELP

ALL = ("cluster", "data", "rollout", "engines", "batch", "algorithm", "reward", "optimizer", "model", "checkpoint", "log", "megatron")
# What `polyrl serve` reads (polyrl.rollout.server.serve and the embedded engine it builds): every server setting and
# these; tests/test_cli.py traces serve() and fails when the two differ.
SERVE_FIELDS = frozenset({f"server.{f.name}" for f in dataclasses.fields(ServerConfig)} | {
    "cluster.device", "cluster.seed",
    "model.hf_checkpoint", "model.attn_implementation", "model.fp16", "model.bf16", "model.fp32", "model.true_on_policy",
    "rollout.rollout_batch_generate", "rollout.rollout_gpu_engine", "rollout.rollout_mem_fraction", "rollout.rollout_cuda_graph",
    "rollout.rollout_quantization",  # the GPU path keeps FP8 weights and runs FP8 linears
    "rollout.kv_cache_dtype",
})


def _fields_of(sections: tuple[str, ...], drop: set[str]) -> frozenset[str]:
    from polyrl.config import Config
    return frozenset(f"{sec.name}.{f.name}" for sec in dataclasses.fields(Config) if sec.name in sections
                     for f in dataclasses.fields(sec.default_factory)) - drop


# Settings of training alone: a model that is evaluated or exported takes no step, no reference, critic or teacher
_TRAINING_ONLY = {
    "data.response_key", "data.rollout_shuffle", "data.allow_data_change",
    "model.ref_load", "model.opd_teacher_load", "model.critic_load", "model.offload_train", "model.mtp_loss_scaling_factor",
    "model.mtp_detach_encoder",
    "megatron.recompute_granularity", "megatron.recompute_method", "megatron.recompute_num_layers",
    "megatron.release_grad_buffers", "megatron.gradient_accumulation_fusion",
}
_EVAL_SECTIONS = ("cluster", "data", "rollout", "engines", "reward", "model", "checkpoint", "log", "megatron")
# What `polyrl eval` reads (run_eval: the engine, the data, the reward; with --load the backend that loads it): no
# optimizer or batching, no sampling settings of training steps (eval samples with --eval-temperature), no outputs
# but RUN_DIR/eval.json; tests/test_cli.py traces run_eval and fails when it reads a field not accepted here.
EVAL_FIELDS = _fields_of(_EVAL_SECTIONS, _TRAINING_ONLY | {
    "rollout.rollout_batch_size", "rollout.n_samples_per_prompt", "rollout.rollout_temperature", "rollout.rollout_top_p",
    "rollout.rollout_top_k", "rollout.num_rollout", "rollout.async_training", "rollout.max_staleness",
    "rollout.dynamic_sampling_filter_path", "rollout.over_sampling_batch_size", "rollout.max_dynamic_sampling_draws",
    "rollout.partial_rollout", "rollout.mask_offpolicy_in_partial_rollout",
    "reward.max_consecutive_failed_steps",
    *(f"checkpoint.{f}" for f in ("save", "save_interval", "save_hf", "save_hf_adapter", "max_ckpt_to_keep",
                                  "max_wall_time")),
    *(f"log.{f}" for f in ("use_tensorboard", "eval_interval", "profile_step", "use_wandb", "wandb_project",
                           "wandb_group", "wandb_run_name", "wandb_mode", "overwrite",
                           "ci_train_rollout_logprob_abs_diff_threshold")),
})
# What `polyrl export-hf` reads (run_export: the backend, the checkpoint, the output directory)
EXPORT_FIELDS = _fields_of(("cluster", "model", "checkpoint", "megatron"), _TRAINING_ONLY | {
    "checkpoint.save", "checkpoint.save_interval", "checkpoint.max_ckpt_to_keep", "checkpoint.max_wall_time",
})
# name -> (help, config sections it takes, the only fields it takes of them: None = all)
COMMANDS: dict[str, tuple[str, tuple[str, ...], frozenset[str] | None]] = {
    "train": ("run the RL loop (GRPO, GSPO, Dr.GRPO, DAPO, CISPO, REINFORCE++, PPO)", ALL + ("ray", "debug"), None),
    "sft": ("supervised fine-tuning on prompt/response rows (loss on response tokens) or conversations (chat messages: "
            "loss on every assistant turn)",
            ("cluster", "data", "batch", "optimizer", "model", "checkpoint", "log", "megatron"), None),
    "eval": ("score a model (an HF directory, or a --load checkpoint: its base model is the one it records unless "
             "--hf-checkpoint names it) on a prompt dataset", _EVAL_SECTIONS, EVAL_FIELDS),
    "serve": ("SGLang-compatible HTTP server around the embedded engine (rollout engine server)",
              ("cluster", "model", "rollout", "server"), SERVE_FIELDS),
    "export-hf": ("write an HF directory from a --load checkpoint (the architecture and tokenizer: the base model the "
                  "checkpoint records, or --hf-checkpoint)", ("cluster", "model", "checkpoint", "megatron"), EXPORT_FIELDS),
}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a prefix such as --sglang-mem must reach SGLang, never match one of our flags
    p = argparse.ArgumentParser(prog="polyrl", description="RL post-training for LLMs", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, sections, only) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, usage=f"polyrl {name} [options]", allow_abbrev=False,
                            epilog=CPU_HELP)
        add_config_args(sp, sections, only)
    pp = sub.add_parser("plot", help="write PNG curves of a run directory", usage="polyrl plot RUN_DIR [--out PNG]",
                        allow_abbrev=False)
    pp.add_argument("run_dir", metavar="RUN_DIR")
    pp.add_argument("--out", default=None, metavar="PNG", help="output PNG (default RUN_DIR/curves.png)")
    return p


def _sglang_passthrough(extras: list[str]) -> list[str]:
    """Unknown `--sglang-X [VALUE ...]` tokens become SGLang server flags `--X [VALUE ...]`; anything else unknown is an error."""
    out: list[str] = []
    for tok in extras:
        if tok.startswith("--sglang-"):
            out.append("--" + tok[len("--sglang-"):])
        elif out and not tok.startswith("--"):
            out.append(tok)  # a value of the flag before it
        else:
            raise ConfigError(f"unrecognized argument {tok!r} (see --help; --sglang-X flags pass through to SGLang)")
    return out


def _base_model_from_checkpoint(cfg) -> None:
    """--load alone: the base model (architecture, tokenizer) is the one the checkpoint's run trained from."""
    from polyrl.checkpoint import resolve_checkpoint
    from polyrl.metrics import notice
    with open(os.path.join(resolve_checkpoint(cfg.checkpoint.load), "loop_state.json")) as f:
        state = json.load(f)
    base = state.get("base_model") or (state.get("config") or {}).get("model", {}).get("hf_checkpoint")
    if not base:
        raise ConfigError(f"--load {cfg.checkpoint.load} records no base model: add --hf-checkpoint BASE (the model it "
                          "was trained from)")
    cfg.model.hf_checkpoint = base
    notice(f"--hf-checkpoint {base}: the base model that --load {cfg.checkpoint.load} was trained from")


def _warn_response_cap(cfg) -> None:
    """Once, at start-up: a response or context cap beyond the model's context cannot be reached; the engine ends
    responses at the context (finish reason "length")."""
    from transformers import AutoConfig

    from polyrl.metrics import notice
    try:
        ctx = getattr(AutoConfig.from_pretrained(cfg.model.hf_checkpoint).get_text_config(), "max_position_embeddings", None)
    except (OSError, ValueError):
        return  # the model directory was checked at start-up; a config transformers cannot read is the load's to report
    r = cfg.rollout
    for flag, n in (("--rollout-max-response-len", r.rollout_max_response_len), ("--rollout-max-context-len",
                                                                                 r.rollout_max_context_len)):
        if ctx and n and n > ctx - (flag == "--rollout-max-response-len"):
            notice(f"WARNING {flag} {n} is beyond the model's context of {ctx} tokens (max_position_embeddings of "
                   f"{cfg.model.hf_checkpoint}): responses end where prompt + response fill the context (finish "
                   "reason length), and the cap is never reached")
            return


def _check_backend_available(cfg) -> None:
    if cfg.cluster.train_backend == "megatron":
        from polyrl.backends.megatron.backend import require_megatron
        require_megatron()


def resume_after_restart(cfg) -> None:
    """torchrun --max-restarts N: after a rank died, the elastic agent starts every rank again with the same command
    (TORCHELASTIC_RESTART_COUNT > 0). The restarted run resumes from the newest complete checkpoint under --save, or
    starts afresh when the first attempt saved none; each restart is announced and logged as the `restarts` metric."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        return
    from polyrl.checkpoint import resume_latest
    resume_latest(cfg, restart, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"))


EVAL_PROGRESS_S = 30.0  # `polyrl eval`: a line this often while the engine generates

def run_eval(cfg) -> dict:
    from polyrl import assemble as asm
    from polyrl.checkpoint import load_checkpoint
    from polyrl.placement import plan_here
    from polyrl.rewards import RewardManager
    from polyrl.step.rollout import Evaluator, Scorer, write_records

    plan = plan_here(cfg)
    device, d = asm.setup_command(cfg)
    engine = asm.build_engine(cfg, plan)
    if cfg.checkpoint.load or asm.engine_needs_first_push(cfg, plan):  # the model evaluated is the trainer's
        backend = asm.build_backend(cfg, device, total_steps=1, need_ref=False)
        if cfg.checkpoint.load:
            load_checkpoint(cfg.checkpoint.load, backend)
        asm.build_transport(cfg, plan).push(backend.export_weights(), engine, version=0)
    ds = asm.prompt_dataset(cfg, engine.tokenizer, cfg.data.eval_prompt_data or cfg.data.prompt_data, shuffle=False)
    rw = cfg.reward
    agents, rewards = asm.build_agents(cfg, engine, RewardManager.from_config(rw) if (
        rw.rm_type or rw.custom_rm_path or rw.rm_url or not cfg.rollout.agent_function_path) else None)
    score = Scorer(cfg, rewards)
    try:
        evaluate = Evaluator(cfg, engine, ds, score, d, agents=agents, progress_s=0.0 if cfg.log.quiet else EVAL_PROGRESS_S)
        result = evaluate()
    finally:
        score.close()
        if agents is not None:
            agents.close()
        engine.close()
    if d.is_main:
        from polyrl.metrics import writing
        os.makedirs(cfg.log.run_dir, exist_ok=True)
        path = os.path.join(cfg.log.run_dir, "eval.json")
        with writing(path, kind="run dir"), open(path, "w") as f:
            json.dump(result, f, indent=1)
        samples = os.path.join(cfg.log.run_dir, "eval_samples.jsonl")
        with writing(samples, kind="run dir"):
            write_records(samples, evaluate.records)
        from polyrl.metrics import notice
        notice(f"eval: accuracy {result['eval/accuracy']:.3f} over {result['eval/n']:.0f} samples; {path}, "
               f"samples (prompt, response, label, reward) in {samples}")
    return result


def run_export(cfg) -> None:
    from polyrl import assemble as asm
    from polyrl.checkpoint import critic_hf_dir, export_hf, has_critic, load_checkpoint
    from polyrl.metrics import notice

    device, _ = asm.setup_command(cfg)
    backend = asm.build_backend(cfg, device, total_steps=1, need_ref=False)
    critic = asm.build_critic(cfg, device, total_steps=1) if has_critic(cfg.checkpoint.load) else None  # PPO's, beside it
    load_checkpoint(cfg.checkpoint.load, backend, critic=critic)
    tok = asm.load_tokenizer(cfg)
    out = cfg.checkpoint.save_hf
    export_hf(backend, out, tok, adapter=cfg.checkpoint.save_hf_adapter, critic=critic)
    notice(f"wrote {os.path.abspath(out)}" + (f" (critic: {os.path.abspath(critic_hf_dir(out))})" if critic else ""))


# signal -> (exit status, how the one line names it)
_SIGNALS = {"SIGINT": (130, "Ctrl-C (SIGINT)"), "SIGTERM": (143, "SIGTERM")}
# the exceptions that signals ended commands with, kept so that what their frames hold (work cut off mid-way) is never
# finalized: `cli` then ends the process without finalizers
_INTERRUPTED: list[BaseException] = []


def _on_signal(signum, frame) -> None:
    """SIGINT and SIGTERM end the command with one line (main's handler): the first raises KeyboardInterrupt where the
    main thread is; a second one while that unwinds exits at once (cleanup that hangs must not hold the terminal)."""
    import signal

    from polyrl.metrics import PROGRESS, SIGNAL_DEFERRED
    name = signal.Signals(signum).name
    if PROGRESS["signal"]:
        os._exit(_SIGNALS[PROGRESS["signal"]][0])
    PROGRESS["signal"] = name  # the loops also stop at the end of the step should this KeyboardInterrupt be swallowed
    if frame is not None and frame.f_code in SIGNAL_DEFERRED:
        return  # raised there it would be printed and dropped
    raise KeyboardInterrupt(name)


def _on_stop_request(signum, frame) -> None:
    """SIGUSR1: train and sft stop after the step in flight, with a checkpoint of it (preemptible clusters send it
    ahead of the kill)."""
    from polyrl.metrics import PROGRESS
    PROGRESS["stop_request"] = "SIGUSR1"


def _install_signal_handlers() -> dict:
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        old[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)
    old[signal.SIGUSR1] = signal.getsignal(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, _on_stop_request)
    return old


def _where(command: str) -> str:
    """Where a train / sft run was when it stopped: the step and phase, or a checkpoint save ("" for other commands)."""
    from polyrl.metrics import PROGRESS
    step, phase = PROGRESS["step"], PROGRESS["phase"]
    if command not in ("train", "sft"):
        return ""
    if phase and phase.startswith("the checkpoint save"):
        return f" during {phase} (left incomplete; the next save clears it)"
    if phase:
        return f" in step {(step or 0) + 1} ({phase} phase)"
    return f" after step {step}" if step else " while starting up, before the first step"


def _state_left(command: str, cfg) -> str:
    """What a stopped run leaves behind: "; latest complete checkpoint: ..." (or that there is none)."""
    from polyrl.checkpoint import latest_complete
    save = cfg.checkpoint.save if cfg is not None else None
    if save and command in ("train", "sft"):
        latest = latest_complete(save)
        return (f"; latest complete checkpoint: {latest} (resume with --load {os.path.abspath(save)})" if latest
                else f"; no complete checkpoint in --save {save} yet")
    return "; nothing was saved (no --save)" if command in ("train", "sft") else ""


def _interrupt_line(command: str, cfg, how: str) -> str:
    """One line: what was interrupted (command, step, phase) and the state left behind (the latest complete checkpoint)."""
    return f"polyrl {command}: interrupted by {how}{_where(command)}{_state_left(command, cfg)}"


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
_TORN_WRITE = ("unexpected pos", "file write failed")  # torch.save's zip writer's words for a write that failed
_FULL_WORDS = ("No space left on device", "StorageFull")  # a full disk in errors that carry no errno (safetensors')


def _write_error(e: BaseException) -> OSError | None:
    """The OSError of a failed write behind `e` (itself, what it wraps, each rank's failure inside DCP's
    CheckpointException), or None. Some writers drop the errno: safetensors' error says "No space left on device" in
    its text, and torch.save's zip writer raises a RuntimeError that counts as ENOSPC where the file system being
    written has (almost) no space left, and as a failed write (EIO) elsewhere."""
    from polyrl.metrics import PROGRESS
    stack, seen, torn = [e], set(), None
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _WRITE_ERRNOS:
            return x
        if PROGRESS.get("writing") and any(t in str(x) for t in _FULL_WORDS):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), PROGRESS["writing"][0])
        if torn is None and isinstance(x, RuntimeError) and any(t in str(x) for t in _TORN_WRITE):
            torn = x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [x.__cause__, x.__context__]
    target = PROGRESS.get("writing")
    if torn and target:
        import shutil
        d = target[0]
        while d and not os.path.exists(d):
            d = os.path.dirname(d)
        if shutil.disk_usage(d or ".").free < 64 * 2**20:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), target[0])
        first = (str(torn).strip().splitlines() or ["no message"])[0][:200]
        return OSError(errno.EIO, f"Write failed ({first})", target[0])
    return None


def _write_line(command: str, cfg, oe: OSError) -> str:
    """One line for a write that failed (a full disk, a quota, a read-only or forbidden directory): what was being
    written, where the run was, and what is left: the latest complete checkpoint, and for --save-hf the earlier export."""
    from polyrl.metrics import PROGRESS
    target = PROGRESS.get("writing")
    what = oe.strerror or os.strerror(oe.errno)
    if target is None and oe.errno not in (errno.ENOSPC, errno.EDQUOT):  # not known to be a write: say no more
        return f"polyrl {command}: error: {what}: {oe.filename}"
    path, kind = target or (oe.filename, None)
    line = f"polyrl {command}: error: {what} writing {path or 'a file (the error names none)'}{_where(command)}"
    if kind == "export" and cfg is not None:
        out = cfg.checkpoint.save_hf
        line += (f"; the earlier export in {out} is kept as it was" if os.path.isfile(os.path.join(out, "config.json"))
                 else f"; no HF export was written to {out}")
        if command in ("train", "sft") and not cfg.checkpoint.save:
            return line + "; the trained weights are lost (no --save): free space and run again, with --save DIR to keep a checkpoint"
        if command in ("train", "sft"):
            line += f"; export the checkpoint later with polyrl export-hf --load {os.path.abspath(cfg.checkpoint.save)}"
    return line + _state_left(command, cfg)


def _collective_timeout(e: BaseException) -> str | None:
    """The collective a gloo timeout of `e` (or of an exception it wraps, as DCP's) came out of, and polyrl's line that
    called it, e.g. "all_reduce, from polyrl/step/learner.py:94 reduce_reward_metrics"; None for any other error."""
    import traceback
    while e is not None:
        if isinstance(e, RuntimeError) and "Timed out waiting" in str(e):  # gloo's words for a send/recv past the timeout
            frames = traceback.extract_tb(e.__traceback__)
            c10d = os.path.join("distributed", "distributed_c10d.py")
            torch_at = [i for i, f in enumerate(frames) if f.filename.endswith(c10d)]
            if not torch_at:
                return "a collective"
            here = os.path.dirname(os.path.abspath(__file__))
            ours = [f for f in frames[:torch_at[-1]] if f.filename.startswith(here + os.sep)]
            ours = [f for f in ours if f.filename != os.path.join(here, "dist.py")] or ours  # dist.py's wrappers say little
            at = (f", from {os.path.relpath(ours[-1].filename, os.path.dirname(here))}:{ours[-1].lineno} {ours[-1].name}"
                  if ours else "")
            return f"{frames[torch_at[-1]].name}{at}"
        e = e.__cause__ or e.__context__
    return None


def _address_in_use(e: BaseException) -> bool:
    import errno
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return True
    text = str(e)
    return type(e).__name__ == "DistNetworkError" and ("EADDRINUSE" in text or "address already in use" in text.lower())


def _port_taken(host: str, port: int) -> bool:
    """Whether binding (host, port) fails with EADDRINUSE now: `polyrl serve` says so before it loads the model (the
    server binds with SO_REUSEADDR too, so a port in TIME_WAIT is not reported)."""
    import errno
    import socket
    if not port:
        return False
    try:
        fam, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return False  # an unresolvable host is the server's to report
    with socket.socket(fam, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def memory_held(segments: list[dict]) -> dict[str, int]:
    """Bytes the caching allocator holds, from torch.cuda.memory_snapshot()'s segments: reserved and allocated in all,
    and the part of each in private pools (CUDA graphs' memory, which no other allocation can reuse)."""
    out = dict.fromkeys(("reserved", "allocated", "pool_reserved", "pool_allocated"), 0)
    for seg in segments:
        private = tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        for key, size in (("reserved", seg["total_size"]), ("allocated", seg["allocated_size"])):
            out[key] += size
            if private:
                out[f"pool_{key}"] += size
    return out


def _cuda_oom(e: BaseException) -> bool:
    torch = sys.modules.get("torch")  # not imported yet: not torch's error (and no import on other error paths)
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


def _oom_line(command: str, e: BaseException) -> str:
    """One line for a CUDA out-of-memory: where the run was, what was asked, how this process held the GPU (CUDA-graph
    pools apart: the trainer cannot reuse their reserve), and the flags that shrink each part."""
    import re

    import torch
    import torch.distributed as dist
    asked = re.search(r"Tried to allocate ([\d.]+) (\w+)", str(e))
    rank = f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""
    held = ""
    if torch.cuda.is_available():
        gib = 2**30
        d = torch.cuda.current_device()
        m = memory_held([seg for seg in torch.cuda.memory_snapshot() if seg.get("device", d) == d])
        free, total = torch.cuda.mem_get_info()
        held = (f": this process held {m['allocated'] / gib:.1f} GiB allocated and "
                f"{(m['reserved'] - m['allocated']) / gib:.1f} GiB reserved but free, of which CUDA-graph pools "
                f"{m['pool_reserved'] / gib:.1f} GiB ({m['pool_allocated'] / gib:.1f} allocated); other processes "
                f"{max(0, total - free - m['reserved']) / gib:.1f} GiB of {total / gib:.0f}")
        unit = {"GiB": gib, "MiB": 2**20, "KiB": 2**10, "B": 1}.get(asked.group(2)) if asked else None
        if unit and float(asked.group(1)) * unit < m["reserved"] - m["allocated"]:
            # freed memory the request could not reuse: its segments still hold live tensors (fragmentation)
            held += ("; more was reserved but free than asked, in segments that live tensors pin: "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator hand such memory back")
    trainer = "the trainer's micro-batches with --max-tokens-per-gpu N or --micro-batch-size N, --gradient-checkpointing"
    engine = "the engine's KV cache with --rollout-mem-fraction"
    shrink = {"train": f"{trainer}, --offload-train, or {engine}", "sft": trainer, "eval": engine}.get(command)
    return (f"polyrl {command}: error: CUDA out of memory{rank}{_where(command)}"
            f"{f' ({asked.group(0)})' if asked else ''}{held}{f'; to fit, shrink {shrink}' if shrink else ''}")


def _port_line(command: str, cfg, e: BaseException | None) -> str:
    if command == "serve" and cfg is not None:
        return (f"polyrl serve: error: port {cfg.server.port} on {cfg.server.host} is already in use (30000, the default, "
                "is SGLang's too): pick a free one with --port N, or --port 0 to let the system choose")
    first = str(e).strip().splitlines()[0] if e is not None and str(e).strip() else "EADDRINUSE"
    return (f"polyrl {command}: error: an address is already in use ({first[:300]}); under torchrun pick another "
            "--master-port, and check that no earlier run is still alive")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("POLYRL_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    from polyrl.metrics import quiet_library_bars
    quiet_library_bars()  # polyrl's output holds its own lines, not the libraries' weight-loading and saving bars
    from polyrl import hf_families
    hf_families.register()  # model types transformers lacks (MiMo), for every command that loads a checkpoint
    if extras and args.command not in ("train", "eval"):
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if args.command == "plot":
        from polyrl.metrics import plot_run
        try:
            print(plot_run(args.run_dir, args.out))
        except FileNotFoundError as e:
            print(f"polyrl plot: error: {e}", file=sys.stderr)
            return 2
        return 0
    from polyrl.checkpoint import CheckpointError
    from polyrl.config import check_run_dir
    from polyrl.data import DataError
    from polyrl.metrics import PROGRESS, RunStopped, stop_consoles
    from polyrl.rollout.http_engine import EngineDeadError
    from polyrl.rollout.custom import CustomGenerateTimeout, TurnLimitError
    from polyrl.weight_sync.distributed import WeightSyncError
    PROGRESS.update(step=None, phase=None, signal=None, writing=None, stop_request=None)
    old_handlers = _install_signal_handlers()
    cfg, failed, owner = None, False, None

    def err(msg: str, code: int, every_rank: bool = False) -> int:
        import torch.distributed as dist
        if every_rank or not dist.is_initialized() or dist.get_rank() == 0:  # one line per run, not one per rank
            print(msg, file=sys.stderr, flush=True)
        return code

    try:
        cfg = config_from_args(args)
        cfg.engines.sglang_args += _sglang_passthrough(extras)
        if args.command in ("eval", "export-hf") and cfg.checkpoint.load and not cfg.model.hf_checkpoint:
            _base_model_from_checkpoint(cfg)
        if args.command == "train":
            resume_after_restart(cfg)
        validate(cfg, args.command)
        from polyrl.capabilities import check_setup  # the backend and engine tables (they import torch)
        check_setup(cfg, args.command)
        if args.command == "export-hf" and not (cfg.checkpoint.load and cfg.checkpoint.save_hf):
            raise ConfigError("polyrl export-hf needs --load CHECKPOINT and --save-hf OUT_DIR")
        check_run_dir(cfg, args.command)
        _check_backend_available(cfg)
        if args.command in ("train", "eval"):
            _warn_response_cap(cfg)
        if args.command in ("train", "sft") and cfg.checkpoint.save and os.environ.get("RANK", "0") == "0":
            from polyrl.checkpoint import claim_save_dir
            owner = claim_save_dir(cfg.checkpoint.save, f"polyrl {args.command}")  # before anything writes there
        if args.command == "train" and cfg.ray.use_ray:
            from polyrl.orchestration.ray_job import train_on_ray
            out = train_on_ray(cfg)
        elif args.command == "train":
            if cfg.rollout.async_training:
                from polyrl.loop_async import train
            else:
                from polyrl.loop import train
            out = train(cfg)
        elif args.command == "sft":
            from polyrl.sft import sft
            out = sft(cfg)
        elif args.command == "serve":
            if _port_taken(cfg.server.host, cfg.server.port):
                return err(_port_line("serve", cfg, None), 2)
            from polyrl.rollout.server import serve
            return serve(cfg)
        elif args.command == "eval":
            out = run_eval(cfg)
            print(json.dumps(out))
        else:
            run_export(cfg)
            out = {}
    except BaseException as e:  # noqa: BLE001 - every way out below is one line, or the original exception
        failed = True
        if PROGRESS["signal"] or isinstance(e, KeyboardInterrupt):
            # a signal may surface as another exception (DCP wraps it in a CheckpointException during a save)
            stop_consoles()
            code, how = _SIGNALS[PROGRESS["signal"] or "SIGINT"]
            # a torch.save cut off mid-write leaves a C++ zip writer in these frames whose destructor writes to the
            # file DCP has closed by now: a std::terminate (SIGABRT) if it ever runs
            _INTERRUPTED.append(e)
            return err(_interrupt_line(args.command, cfg, how), code)
        from polyrl.step.book import StopAtBoundary
        if isinstance(e, StopAtBoundary):  # asked for: the step in flight finished and was saved
            return err(f"polyrl {args.command}: {e}", 0)
        if isinstance(e, EngineDeadError):  # the run ends here: where it was, and what it leaves to resume from
            first, _, rest = str(e).partition("\n")
            return err(f"polyrl {args.command}: error: {first}{_where(args.command)}{_state_left(args.command, cfg)}"
                       + (f"\n{rest}" if rest else ""), 1)
        if isinstance(e, (WeightSyncError, CustomGenerateTimeout, TurnLimitError, RunStopped)):
            return err(f"polyrl {args.command}: error: {e}", 1)
        if isinstance(e, (ConfigError, DataError, CheckpointError)):
            return err(f"polyrl {args.command}: error: {e}", 2)
        if _cuda_oom(e):  # the allocator's own message and the traceback: POLYRL_LOG_LEVEL=DEBUG
            logging.getLogger("polyrl").debug("CUDA out of memory", exc_info=e)
            return err(_oom_line(args.command, e), 1, every_rank=True)
        if isinstance(e, ImportError) and "pip install" in str(e):  # optional dependency with an install hint
            return err(f"polyrl {args.command}: error: {e}", 2)
        if _address_in_use(e):
            return err(_port_line(args.command, cfg, e), 2)
        wait = _collective_timeout(e)
        if wait is not None and cfg is not None:  # said by the rank that waited, which need not be rank 0
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_initialized() else 0
            return err(f"polyrl {args.command}: error: rank {rank} waited --distributed-timeout-minutes "
                       f"{cfg.cluster.distributed_timeout_minutes:g} in a collective ({wait}){_where(args.command)} for "
                       "ranks that did not join it: another rank is hung or died, or worked alone longer than that "
                       "(then raise --distributed-timeout-minutes)", 1, every_rank=True)
        wrote = _write_error(e)
        if wrote is not None:
            stop_consoles()
            logging.getLogger("polyrl").debug("write failed", exc_info=e)
            return err(_write_line(args.command, cfg, wrote), 1)
        if type(e).__name__ == "CheckpointException":  # DCP's, a BaseException: the first failing rank's error
            from polyrl.checkpoint import first_failure
            stop_consoles()
            inner = first_failure(e)
            logging.getLogger("polyrl").debug("checkpoint failed", exc_info=e)
            first = (str(inner).strip().splitlines() or ["no message"])[0][:300]
            return err(f"polyrl {args.command}: error: checkpoint I/O failed{_where(args.command)} "
                       f"({type(inner).__name__}: {first}){_state_left(args.command, cfg)}", 1)
        raise
    finally:
        import signal
        if owner is not None:
            owner.release()
        for sig, h in old_handlers.items():
            signal.signal(sig, h)
        PROGRESS["signal"] = None  # a later run in this process (tests, notebooks) starts unsignalled
        import torch.distributed as dist
        if dist.is_initialized():
            # no rank tears the group down while another still has traffic in flight; after an error or a signal the
            # other ranks may be gone or hung, so nobody waits for them
            if dist.get_world_size() > 1 and not failed:
                dist.barrier()
            dist.destroy_process_group()
    return 0


def cli() -> int:
    """The `polyrl` command (and `python -m polyrl`): main, then the process ends with its status without finalizing
    the interpreter. After a command that a signal ended, at once, without atexit handlers either: the interrupted
    work's objects are not torn down (main keeps them), and launched servers die with the process (PR_SET_PDEATHSIG).
    After any other, once the atexit handlers (logging, multiprocessing, weakref finalizers) have run: a gloo worker
    thread can drop a finished collective's tensors after the run is over, and doing so needs the GIL, which a
    finalizing interpreter answers by ending the thread, aborting the process ("terminate called without an active
    exception", exit -6) though every rank had finished."""
    from polyrl.cpu_env import start_process
    start_process()  # before main imports torch: its OpenMP runtime reads the wait policy once, when loaded
    before = len(_INTERRUPTED)
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if len(_INTERRUPTED) == before:
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(cli())
