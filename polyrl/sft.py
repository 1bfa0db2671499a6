"""Supervised fine-tuning on prompt/response rows (loss on response tokens) and conversations (loss on every
assistant turn: polyrl.data.build_conversation_example). Either way the loss mask is the RL path's `loss_mask`."""

from __future__ import annotations

import dataclasses
import time

import torch

from polyrl import assemble as asm
from polyrl.algorithms.losses import sft_loss
from polyrl.checkpoint import CheckpointWriter, export_hf, load_checkpoint
from polyrl.config import Config
from polyrl.data import DataError, build_sft_example, load_sft_records
from polyrl.multimodal import VisionProcessor, build_image_sft_example, parse_multimodal_keys
from polyrl.metrics import Timer, logger_from_config, notice, stop_if_signalled
from polyrl.step.book import StopAtBoundary, boundary_stop, run_identity
from polyrl.step.cursor import check_same_data, data_identity
from polyrl.types import TrainBatch

PROGRESS_LINES = 10  # without the live view (--quiet, as `make demo` runs): a line at every tenth of the steps


def sft(cfg: Config) -> dict:
    device, d = asm.setup_command(cfg)
    tok = asm.load_tokenizer(cfg)
    keys = parse_multimodal_keys(cfg.data.multimodal_keys)
    rows = load_sft_records(cfg.data.prompt_data, cfg.data.input_key, cfg.data.response_key, multimodal_keys=keys)
    processor = VisionProcessor.from_pretrained(cfg.model.hf_checkpoint, tok) if keys else None
    examples = []
    for prompt, response, source, *images in rows:
        mm = None
        try:
            if images and images[0] is not None:  # an image prompt: the processor renders it, its pixels go along
                ids, mask, mm = build_image_sft_example(processor, prompt, response, images[0])
            else:
                ids, mask = build_sft_example(tok, prompt, response, cfg.data.apply_chat_template)
        except (DataError, ValueError) as e:
            raise DataError(f"{source}: {e}") from None
        if not any(mask):
            raise DataError(f"{source}: empty response; nothing to train on")
        start = mask.index(1)
        examples.append((torch.tensor(ids), start, torch.tensor(mask[start:], dtype=torch.float32), mm))
    gbs = cfg.batch.global_batch_size or min(32, len(examples))
    if gbs % d.world:
        raise DataError(f"--global-batch-size {gbs} is not divisible by the {d.world} ranks")
    per_epoch = len(examples) // gbs
    if per_epoch == 0:
        raise DataError(f"{cfg.data.prompt_data}: {len(examples)} rows is fewer than --global-batch-size {gbs}")
    total = per_epoch * cfg.batch.num_epoch
    backend = asm.build_backend(cfg, device, total_steps=total, need_ref=False)
    logger = logger_from_config(cfg, total_steps=total, enabled=d.is_main, title="polyrl sft")
    start = 0
    identity = data_identity([list(r[:2]) for r in rows[:16]], len(examples), cfg.data.prompt_data)
    if cfg.checkpoint.load:
        state = load_checkpoint(cfg.checkpoint.load, backend)
        start = state["step"]
        asm.announce_changed_rates(state, cfg)
        if state.get("data_file") is not None:  # the order of step k's rows depends on the row count
            check_same_data(state["data_file"], identity, f"step {start}", cfg.data.allow_data_change)
        if start >= total:
            notice(f"nothing to train: the checkpoint is at step {start}, at or past the {total} steps of this run "
                   "(--num-epoch x rows / --global-batch-size)")
    writer = CheckpointWriter.from_config(cfg)
    t0 = time.perf_counter()
    for step in range(start, total):
        epoch, k = divmod(step, per_epoch)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.cluster.seed + epoch)).tolist()
        idx = d.shard(order[k * gbs:(k + 1) * gbs])
        mms = [examples[i][3] for i in idx]
        batch = TrainBatch([examples[i][0] for i in idx], [examples[i][1] for i in idx],
                           {"loss_mask": [examples[i][2] for i in idx]},
                           multimodal=mms if any(m is not None for m in mms) else None)
        timer = Timer()
        with timer("train"):
            m = backend.train_step(batch, sft_loss)
        why = boundary_stop(cfg, d, t0, timer.times["train"]) if step + 1 < total else None
        if writer is not None and writer.pending is not None:
            with timer("save_wait"):  # the previous save's background write (--async-save), sealed now
                writer.settle()
        if writer is not None and (step + 1 == total or why is not None or (
                cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0)):
            with timer("save"):  # before the log: the step's row says what its save took
                writer.save(step + 1, backend, {"step": step + 1, "data_file": identity, **run_identity(cfg),
                                                "config": dataclasses.asdict(cfg)}, wait=step + 1 == total or why is not None)
        m.update({f"time/{k}": v for k, v in timer.times.items()}, epoch=epoch)
        logger.log(step + 1, m)
        if logger.quiet and d.is_main and _progress_step(step + 1, start, total):
            notice(f"sft step {step + 1}/{total} (epoch {epoch + 1}/{cfg.batch.num_epoch}) loss {m.get('loss', float('nan')):.4f}, "
                   f"{time.perf_counter() - t0:.0f} s")
        stop_if_signalled()
        if why is not None:
            logger.close()
            saved = (f"checkpoint of step {step + 1} in --save {cfg.checkpoint.save}; resume with --load "
                     f"{cfg.checkpoint.save}" if cfg.checkpoint.save else "nothing saved (no --save)")
            raise StopAtBoundary(f"stopped after step {step + 1} of {total} on {why}: {saved}")
    logger.close()
    if cfg.checkpoint.save_hf:
        export_hf(backend, cfg.checkpoint.save_hf, tok, adapter=cfg.checkpoint.save_hf_adapter)
    return {"steps": total - start, "wall_seconds": time.perf_counter() - t0, "last": m if total > start else {}}


def _progress_step(step: int, start: int, total: int) -> bool:
    """Whether `step` (1-based) crosses one of the PROGRESS_LINES marks of the run's steps (the last step always does)."""
    n = max(total - start, 1)
    return step == total or (step - start) * PROGRESS_LINES // n > (step - 1 - start) * PROGRESS_LINES // n
