"""Atomic checkpoint directories.

Layout: SAVE/step_000010/{dcp/, extra_rank*.pt, loop_state.json, MANIFEST.json, COMPLETE} (plus critic/{dcp/,
extra_rank*.pt} with PPO's critic), SAVE/latest (the name of the newest complete step) and SAVE/polyrl.lock (the run
that owns SAVE). A step is written under a .tmp name and renamed when complete, and `latest` is replaced atomically
afterwards: a kill at any point leaves the previous checkpoint loadable. COMPLETE is written only after every shard
that the DCP metadata lists is there and MANIFEST.json records each file's size; loading checks the manifest again.
The next save clears what a killed one left behind, and with `keep` (--max-ckpt-to-keep) old complete steps are
deleted only after a newer one is complete. One run at a time owns SAVE (claim_save_dir): a second one is refused.

Loading runs no code from the directory: extras are read with torch.load(weights_only=True), and a file that is
missing, truncated or holds anything but tensors and plain values is an error naming it. loop_state.json never holds
a secret (api keys are redacted before it is written).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pickle
import re
import shutil
import socket
import time

import torch

from polyrl.config import ConfigError
from polyrl.dist import barrier, is_main, rank as trainer_rank, world_size
from polyrl.metrics import notice, redact_secrets, set_phase, writing

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"
LOCK = "polyrl.lock"
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


def save_checkpoint(root: str, step: int, backend, loop_state: dict, keep: int | None = None, critic=None,
                    optimizer: bool = True, background: bool = False) -> "str | PendingSave":
    """Write SAVE/step_N atomically; then, with `keep`, delete all but the newest `keep` complete steps.
    critic: a second backend (PPO's critic), saved the same way under step_N/critic/. optimizer=False: no optimizer
    state (--no-save-optim). background=True (--async-save, backends declaring async_save): the backends copy their
    state to host memory and return; the files are written on a thread, and the PendingSave returned seals the step
    when its wait() is called (on every rank); until then the previous complete step stays `latest`."""
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    set_phase(f"the checkpoint save of step {step}")
    if is_main():
        _clear_leftovers(root)
        os.makedirs(tmp)
        if critic is not None:
            os.makedirs(os.path.join(tmp, CRITIC_DIR))
    barrier()
    kw = {"background": True} if background else {}  # a backend without async_save is refused at start-up
    with writing(tmp):
        writes = [backend.save(tmp, optimizer=optimizer, **kw)]
        if critic is not None:
            writes.append(critic.save(os.path.join(tmp, CRITIC_DIR), optimizer=optimizer, **kw))
    pending = PendingSave(root, step, tmp, final, [w for w in writes if w is not None], redact_secrets(loop_state), keep)
    set_phase(None)
    return pending if background else pending.wait()


class PendingSave:
    """A checkpoint step whose state is copied and whose files are being written (or written): wait() waits for the
    writes, then seals it (manifest, COMPLETE, the rename, `latest`, --max-ckpt-to-keep), on every rank together."""

    def __init__(self, root: str, step: int, tmp: str, final: str, writes: list, loop_state: dict, keep: int | None):
        self.root, self.step, self.tmp, self.final, self.writes = root, step, tmp, final, writes
        self.loop_state, self.keep = loop_state, keep

    def wait(self, timeout: float | None = None) -> str:
        set_phase(f"the checkpoint save of step {self.step}")
        with writing(self.tmp):
            for w in self.writes:
                try:
                    w.result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    raise CheckpointError(f"the background write of checkpoint step {self.step} to {self.tmp} did not "
                                          f"finish within {timeout:.0f} s") from None
            barrier()
            if is_main():
                _atomic_write(os.path.join(self.tmp, "loop_state.json"), json.dumps(self.loop_state))
                _seal(self.tmp, self.step, self.root)
        if is_main():
            if os.path.exists(self.final):
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            _atomic_write(os.path.join(self.root, "latest"), os.path.basename(self.final))
            if self.keep is not None:
                for old in complete_steps(self.root)[:-self.keep]:
                    _delete_step(os.path.join(self.root, f"step_{old:06d}"))
        barrier()
        set_phase(None)
        return self.final


class CheckpointWriter:
    """A run's --save writes. save() seals the write before it first; with background (--async-save) it returns once
    the state is copied to host memory, and settle(), called at the end of the next step, seals it: the files are
    written while that step runs. A run that dies before settle() leaves the previous complete step `latest`."""

    def __init__(self, root: str, *, keep: int | None, optimizer: bool, background: bool, critic=None,
                 timeout: float | None = None):
        self.root, self.keep, self.optimizer, self.background = root, keep, optimizer, background
        self.critic, self.timeout = critic, timeout
        self.pending: PendingSave | None = None

    @classmethod
    def from_config(cls, cfg, critic=None) -> "CheckpointWriter | None":
        """The writer of --save (None without it), with --max-ckpt-to-keep, --no-save-optim and --async-save."""
        ck = cfg.checkpoint
        if not ck.save:
            return None
        return cls(ck.save, keep=ck.max_ckpt_to_keep, optimizer=ck.save_optim, background=ck.async_save,
                   critic=critic, timeout=60.0 * cfg.cluster.distributed_timeout_minutes)

    def save(self, step: int, backend, loop_state: dict, *, wait: bool = False) -> None:
        self.settle()
        out = save_checkpoint(self.root, step, backend, loop_state, keep=self.keep, critic=self.critic,
                              optimizer=self.optimizer, background=self.background and not wait)
        self.pending = out if isinstance(out, PendingSave) else None

    def settle(self) -> bool:
        """Seal the background write in flight, if any (on every rank); True if there was one."""
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        pending.wait(self.timeout)
        return True


def _seal(tmp: str, step: int, root: str) -> None:
    """Mark the step directory `tmp` complete: only once every shard its DCP metadata lists is there, in full, and
    MANIFEST.json records every file and its size (a file deleted or cut later is found on load)."""
    try:
        _check_dcp_files(tmp, what=f"the checkpoint save of step {step}")
    except CheckpointError as e:
        latest = latest_complete(root)
        raise CheckpointError(f"{e}; step {step} was not marked complete (did another process write to --save "
                              f"{root}?); latest complete checkpoint: {latest or 'none'}") from None
    files = {}
    for d, _, names in os.walk(tmp):
        for n in names:
            f = os.path.join(d, n)
            files[os.path.relpath(f, tmp)] = os.path.getsize(f)
    _atomic_write(os.path.join(tmp, MANIFEST), json.dumps({"step": step, "files": files}, indent=0, sort_keys=True))
    _atomic_write(os.path.join(tmp, MARKER), str(step))


def check_manifest(step_dir: str) -> str | None:
    """What is wrong with a complete step directory: a file its MANIFEST.json lists that is missing or has another
    size, or None (also for checkpoints written before manifests, which the DCP metadata check covers)."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return f"{path} is truncated or not a polyrl manifest"
    for rel, size in sorted(files.items()):
        f = os.path.join(step_dir, rel)
        if not os.path.isfile(f):
            return f"{f} is missing (listed in {MANIFEST})"
        if os.path.getsize(f) != size:
            return f"{f} has {os.path.getsize(f)} bytes, {MANIFEST} lists {size}"
    return None


def previous_complete(step_dir: str) -> str | None:
    """The newest complete, intact step before `step_dir` in the same save directory."""
    root, name = os.path.split(os.path.abspath(step_dir))
    m = STEP_DIR.fullmatch(name)
    if m is None:
        return None
    return latest_complete(root, before=int(m.group(1)))


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint under `root`, oldest first."""
    out = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = STEP_DIR.fullmatch(name)
        if m and os.path.isfile(os.path.join(root, name, MARKER)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_complete(root: str | None, before: int | None = None) -> str | None:
    """The newest complete step directory under --save `root` whose files its manifest finds intact (None when there is
    none); with `before`, the newest one before that step."""
    for step in reversed(complete_steps(root) if root else []):
        path = os.path.abspath(os.path.join(root, f"step_{step:06d}"))
        if (before is None or step < before) and check_manifest(path) is None:
            return path
    return None


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
    problem = check_manifest(path)
    if problem is not None:
        prev = previous_complete(path)
        raise CheckpointError(f"--load {path}: {problem}; this checkpoint is incomplete and polyrl does not load it. "
                              + (f"The previous complete checkpoint is {prev} (--load {prev})" if prev else
                                 "There is no earlier complete checkpoint beside it"))
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


def _check_dcp_files(step_dir: str, what: str | None = None) -> None:
    """Every DCP directory of the step (dcp, dcp_ref, critic/dcp): its .metadata readable and each shard file it names
    present and as long as the byte ranges it lists, so a torn copy is an error naming the file, not a deep DCP trace.
    what: how the error begins (default: --load STEP_DIR)."""
    what = what or f"--load {step_dir}"
    from torch.distributed.checkpoint import FileSystemReader
    for sub in ("dcp", "dcp_ref", os.path.join(CRITIC_DIR, "dcp")):
        d = os.path.join(step_dir, sub)
        meta = os.path.join(d, ".metadata")
        if not os.path.isdir(d) or not os.path.isfile(meta):
            continue
        try:
            md = FileSystemReader(d).read_metadata()
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same: the file is damaged
            raise CheckpointError(f"{what}: {meta} is truncated or unreadable ({type(e).__name__})") from None
        need: dict[str, int] = {}
        for info in (getattr(md, "storage_data", None) or {}).values():
            rel, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
            if rel:
                need[rel] = max(need.get(rel, 0), end)
        for rel, end in sorted(need.items()):
            f = os.path.join(d, rel)
            if not os.path.isfile(f):
                raise CheckpointError(f"{what}: {f} is missing (listed in {meta}); the checkpoint is incomplete")
            if os.path.getsize(f) < end:
                raise CheckpointError(f"{what}: {f} is truncated ({os.path.getsize(f)} bytes, {meta} lists data "
                                      f"up to byte {end})")


def has_optimizer_state(dcp_dir: str) -> bool:
    """Whether the DCP checkpoint `dcp_dir` holds optimizer state ("optim.*" entries): not when --no-save-optim wrote it."""
    from torch.distributed.checkpoint import FileSystemReader
    return any(k.startswith("optim.") for k in FileSystemReader(dcp_dir).read_metadata().state_dict_metadata)


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
    from torch.distributed.checkpoint.api import CheckpointException as DCPError  # a BaseException, not an Exception
    try:
        backend.load(path)
        if critic is not None:
            critic.load(os.path.join(path, CRITIC_DIR))
    except CheckpointError:
        raise
    except (Exception, DCPError) as e:  # a torn shard or another model's shapes surface here; say which checkpoint
        raise CheckpointError(_load_error(path, state, e)) from None
    notice(f"loaded checkpoint {os.path.abspath(path)} (step {state.get('step')})")
    if os.path.isfile(os.path.join(path, "dcp", ".metadata")) and not has_optimizer_state(os.path.join(path, "dcp")):
        notice("it holds no optimizer state (saved with --no-save-optim): AdamW's moments start from zero at this step")
    return state


def first_failure(e: BaseException) -> BaseException:
    """The exception inside torch's DCP CheckpointException (the first failing rank's), or `e` itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return e


def _load_error(path: str, state: dict, e: BaseException) -> str:
    inner = first_failure(e)
    text = str(inner).strip()
    line = next((ln.strip() for ln in text.splitlines() if "size" in ln.lower() and "mismatch" in ln.lower()), None)
    base = state.get("base_model") or (state.get("config") or {}).get("model", {}).get("hf_checkpoint")
    if line is not None:
        return (f"--load {path}: its tensors do not fit the model built from --hf-checkpoint ({line[:300]}); a "
                f"checkpoint loads only into the architecture and vocabulary it was trained with"
                + (f": it was trained from {base}" if base else ""))
    first = text.splitlines()[0][:300] if text else "no message"
    return f"--load {path}: could not read the checkpoint ({type(inner).__name__}: {first})"


def claim_save_dir(root: str, command: str) -> "SaveDirLock":
    """Make this process the one run writing --save `root` (SAVE/polyrl.lock, locked with flock: the kernel lets go of
    it when the process dies, so the lock of a killed run is taken over); a second run is refused naming the first."""
    return SaveDirLock(root, command)


class SaveDirLock:
    def __init__(self, root: str, command: str):
        import fcntl
        os.makedirs(root, exist_ok=True)
        self.path = os.path.join(root, LOCK)
        locked = True
        for _ in range(10):  # a racing release may unlink the file between our open and our lock: open it again
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise CheckpointError(f"--save {root} is in use by another run ({_describe(owner)}; lock file "
                                      f"{self.path}): two runs writing one save directory delete each other's "
                                      "checkpoints. Wait for that run to end, or pick another --save") from None
            except OSError as e:  # a file system without locks (some network and FUSE mounts): run, unguarded
                notice(f"WARNING --save {root}: its file system cannot lock {self.path} ({e.strerror}); a second run "
                       "on this directory would not be refused")
                locked = False
                break
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise CheckpointError(f"--save {root}: could not lock {self.path} (it kept being replaced)")
        self.fd = fd
        before = _read_owner(fd) if locked else None
        if before and before.get("pid") is not None and (before.get("pid"), before.get("host")) != (os.getpid(), socket.gethostname()):
            notice(f"--save {root}: taking over from {_describe(before)}, which is no longer running")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        try:
            with writing(self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            self.fd = None
            raise

    def release(self) -> None:
        """Unlink while still holding the lock (a run that opened the file in between finds another inode and retries)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None


def _read_owner(fd: int) -> dict | None:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (ValueError, UnicodeDecodeError, OSError):
        return None


def _describe(owner: dict | None) -> str:
    if not owner:
        return "a run that has not written its name yet"
    return (f"{owner.get('command', 'polyrl')} pid {owner.get('pid')} on host {owner.get('host')}, started "
            f"{owner.get('started', '?')}")


def export_hf(backend, out: str, tokenizer, *, adapter: bool = False, critic=None) -> None:
    """--save-hf: the backend writes OUT.tmp and swaps it into place, so a failed export (a full disk) keeps the previous
    export of OUT; what the failed one wrote is removed here."""
    try:
        with writing(out, kind="export"):
            backend.save_hf(out, tokenizer, adapter=adapter)
            if critic is not None:  # beside the actor: an HF directory --critic-load reads back
                critic.save_hf(critic_hf_dir(out), tokenizer)
    except BaseException:
        if is_main():
            for d in (out, critic_hf_dir(out)):
                shutil.rmtree(d.rstrip("/") + ".tmp", ignore_errors=True)
        raise


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
