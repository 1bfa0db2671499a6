"""Atomic checkpoint directories.

Layout: SAVE/step_000010/{dcp/, extra_rank*.pt, loop_state.json, COMPLETE} (plus critic/{dcp/, extra_rank*.pt}
with PPO's critic) and SAVE/latest
(the name of the newest complete step). A step is written under a .tmp name and renamed
when complete, and `latest` is replaced atomically afterwards: a kill at any point leaves
the previous checkpoint loadable. The next save clears what a killed one left behind, and
with `keep` (--max-ckpt-to-keep) old complete steps are deleted only after a newer one is
complete.

Loading runs no code from the directory: extras are read with torch.load(weights_only=True), and a file that is
missing, truncated or holds anything but tensors and plain values is an error naming it. loop_state.json never holds
a secret (api keys are redacted before it is written).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil

import torch

from polyrl.config import ConfigError
from polyrl.dist import barrier, is_main, rank as trainer_rank, world_size
from polyrl.metrics import notice, redact_secrets, set_phase

MARKER = "COMPLETE"
CRITIC_DIR = "critic"
STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    pass


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(root: str, step: int, backend, loop_state: dict, keep: int | None = None, critic=None) -> str:
    """Write SAVE/step_N atomically; then, with `keep`, delete all but the newest `keep` complete steps.
    critic: a second backend (PPO's critic), saved the same way under step_N/critic/."""
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    set_phase(f"the checkpoint save of step {step}")
    loop_state = redact_secrets(loop_state)
    if is_main():
        _clear_leftovers(root)
        os.makedirs(tmp)
        if critic is not None:
            os.makedirs(os.path.join(tmp, CRITIC_DIR))
    barrier()
    backend.save(tmp)
    if critic is not None:
        critic.save(os.path.join(tmp, CRITIC_DIR))
    barrier()
    if is_main():
        _atomic_write(os.path.join(tmp, "loop_state.json"), json.dumps(loop_state))
        _atomic_write(os.path.join(tmp, MARKER), str(step))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write(os.path.join(root, "latest"), os.path.basename(final))
        if keep is not None:
            for old in complete_steps(root)[:-keep]:
                _delete_step(os.path.join(root, f"step_{old:06d}"))
    barrier()
    set_phase(None)
    return final


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint under `root`, oldest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = STEP_DIR.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, MARKER)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_complete(root: str | None) -> str | None:
    """The newest complete step directory under --save `root` (None when there is none)."""
    steps = complete_steps(root) if root else []
    return os.path.abspath(os.path.join(root, f"step_{steps[-1]:06d}")) if steps else None


def _delete_step(path: str) -> None:
    os.remove(os.path.join(path, MARKER))  # first: a kill mid-delete leaves a step that no longer claims to be complete
    shutil.rmtree(path)


def _clear_leftovers(root: str) -> None:
    """What killed saves and deletions left: step_N.tmp directories, step_N directories without
    their COMPLETE marker (never loadable), and temporary `latest` files."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        stale_step = (name.startswith("step_") and name.endswith(".tmp") and os.path.isdir(path)) or \
            (STEP_DIR.fullmatch(name) is not None and not os.path.isfile(os.path.join(path, MARKER)))
        if stale_step:
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith("latest.tmp") and os.path.isfile(path):
            os.remove(path)


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


def resolve_on_rank0(path: str) -> str:
    """resolve_checkpoint as rank 0 sees it, for every rank: each rank that followed `latest` (or a restart's listing of
    --save) on its own could load another step than rank 0 where a shared file system shows one node's writes late."""
    if world_size() == 1:
        return resolve_checkpoint(path)
    import torch.distributed as dist
    box: list = [None, None]  # (step directory, error)
    if is_main():
        try:
            box[0] = resolve_checkpoint(path)
        except CheckpointError as e:
            box[1] = str(e)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointError(box[1])
    return box[0]


def critic_hf_dir(save_hf: str) -> str:
    """Where --save-hf DIR puts PPO's critic: DIR_critic."""
    return save_hf.rstrip("/") + "_critic"


def has_critic(path: str) -> bool:
    """Whether the checkpoint at --load `path` (root or step directory) holds a critic."""
    return os.path.isdir(os.path.join(resolve_checkpoint(path), CRITIC_DIR))


def load_extras(path: str, rank: int | None = None) -> dict:
    """A backend's extra_rank{rank}.pt under `path` (rank 0's when a resume runs on more ranks than saved): tensors and
    plain values only (weights_only=True: a pickle that would run code is refused), errors naming the file."""
    rank = trainer_rank() if rank is None else rank
    f = os.path.join(path, f"extra_rank{rank}.pt")
    if not os.path.exists(f):
        f = os.path.join(path, "extra_rank0.pt")
    if not os.path.isfile(f):
        raise CheckpointError(f"--load {path}: {f} is missing (the backend's scheduler and RNG state); the checkpoint is "
                              "incomplete")
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses any global it does not know: code, or a foreign object
        raise CheckpointError(f"--load {path}: {f} holds objects other than tensors and plain values; polyrl does not "
                              f"load it, since unpickling it could run code ({str(e).splitlines()[0][:200]})") from None
    except (EOFError, RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(f"--load {path}: {f} is truncated or unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else 'end of file'})") from None


def _check_dcp_files(step_dir: str) -> None:
    """Every DCP directory of the step (dcp, dcp_ref, critic/dcp): its .metadata readable and each shard file it names
    present and as long as the byte ranges it lists, so a torn copy is an error naming the file, not a deep DCP trace."""
    from torch.distributed.checkpoint import FileSystemReader
    for sub in ("dcp", "dcp_ref", os.path.join(CRITIC_DIR, "dcp")):
        d = os.path.join(step_dir, sub)
        meta = os.path.join(d, ".metadata")
        if not os.path.isdir(d) or not os.path.isfile(meta):
            continue
        try:
            md = FileSystemReader(d).read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same: the file is damaged
            raise CheckpointError(f"--load {step_dir}: {meta} is truncated or unreadable ({type(e).__name__})") from None
        need: dict[str, int] = {}
        for info in (getattr(md, "storage_data", None) or {}).values():
            rel, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
            if rel:
                need[rel] = max(need.get(rel, 0), end)
        for rel, end in sorted(need.items()):
            f = os.path.join(d, rel)
            if not os.path.isfile(f):
                raise CheckpointError(f"--load {step_dir}: {f} is missing (listed in {meta}); the checkpoint is incomplete")
            if os.path.getsize(f) < end:
                raise CheckpointError(f"--load {step_dir}: {f} is truncated ({os.path.getsize(f)} bytes, {meta} lists data "
                                      f"up to byte {end})")


def load_checkpoint(path: str, backend, critic=None) -> dict:
    """Every rank loads the step directory rank 0 resolved `path` to (the save root or one step directory)."""
    path = resolve_on_rank0(path)
    state_file = os.path.join(path, "loop_state.json")
    try:
        with open(state_file) as f:
            state = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"--load {path}: {state_file} is truncated or not JSON ({e})") from None
    _check_dcp_files(path)
    if critic is not None and not os.path.isfile(os.path.join(path, CRITIC_DIR, "dcp", ".metadata")):
        raise CheckpointError(f"--load {path}: no critic in this checkpoint ({CRITIC_DIR}/dcp); it was saved by a run "
                              "without --advantage-estimator gae, whose critic this run would have to start afresh")
    try:
        backend.load(path)
        if critic is not None:
            critic.load(os.path.join(path, CRITIC_DIR))
    except CheckpointError:
        raise
    except Exception as e:  # a torn shard file surfaces here; say which checkpoint
        raise CheckpointError(f"--load {path}: could not read the checkpoint ({type(e).__name__}: {e})") from e
    notice(f"loaded checkpoint {os.path.abspath(path)} (step {state.get('step')})")
    return state


def resume_latest(cfg, restart: int, limit) -> None:
    """A trainer started again after a rank died (restart number `restart` of `limit`): point `cfg` at the newest
    complete checkpoint under --save, or start afresh when the first attempt completed none."""
    ck = cfg.checkpoint
    if not ck.save:
        raise ConfigError("this run was restarted after a rank died, and without --save it has no checkpoint to resume "
                          "from: add --save DIR --save-interval N to survive a lost rank")
    latest = latest_complete(ck.save)
    if latest is None:
        cfg.log.overwrite = True  # the first attempt logged steps that no checkpoint holds: they are trained again
        notice(f"restart {restart} of {limit}: no complete checkpoint in {ck.save} yet; starting afresh")
    else:
        ck.load = latest
        notice(f"restart {restart} of {limit}: resuming from {latest}")
