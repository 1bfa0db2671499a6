"""Atomic checkpoint directories.

Layout: SAVE/step_000010/{dcp/, extra_rank*.pt, loop_state.json, COMPLETE} and SAVE/latest
(the name of the newest complete step). A step is written under a .tmp name and renamed
when complete, and `latest` is replaced atomically afterwards: a kill at any point leaves
the previous checkpoint loadable.
"""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    pass


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str, step: int, backend, loop_state: dict) -> str:
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        os.makedirs(tmp)
    _barrier()
    backend.save(tmp)
    _barrier()
    if _rank0():
        _atomic_write(os.path.join(tmp, "loop_state.json"), json.dumps(loop_state))
        _atomic_write(os.path.join(tmp, MARKER), str(step))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(os.path.join(root, "latest"), os.path.basename(final))
    _barrier()
    return final


def resolve_checkpoint(path: str) -> str:
    """--load accepts the save root (follows `latest`) or one step directory."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {path}: no such directory")
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    if not os.path.isfile(os.path.join(path, MARKER)) or not os.path.isfile(os.path.join(path, "loop_state.json")):
        raise CheckpointError(f"--load {path}: not a complete polyrl checkpoint (no {MARKER} marker or loop_state.json; "
                              "was the save interrupted?). Point --load at the save directory or a complete step_* directory.")
    if not os.path.isfile(os.path.join(path, "dcp", ".metadata")):
        raise CheckpointError(f"--load {path}: the DCP shard metadata (dcp/.metadata) is missing; the checkpoint is truncated")
    return path


def load_checkpoint(path: str, backend) -> dict:
    path = resolve_checkpoint(path)
    with open(os.path.join(path, "loop_state.json")) as f:
        state = json.load(f)
    try:
        backend.load(path)
    except Exception as e:  # a torn shard file surfaces here; say which checkpoint
        raise CheckpointError(f"--load {path}: could not read the checkpoint ({type(e).__name__}: {e})") from e
    return state
