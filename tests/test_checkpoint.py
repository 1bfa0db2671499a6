"""Checkpoint directories: atomic steps, clearing what killed saves left, --max-ckpt-to-keep (no model needed)."""

from __future__ import annotations

import os

import pytest

from polyrl.checkpoint import MARKER, complete_steps, resolve_checkpoint, save_checkpoint


class FakeBackend:
    """Writes a real one-tensor DCP directory, as the backends' save does."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save(self, path: str, *, optimizer: bool = True) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        dcp.save({"w": torch.arange(8.0)}, checkpoint_id=os.path.join(path, "dcp"), no_dist=True)
        if self.fail:
            raise KeyboardInterrupt("killed mid-save")


def save(root, step, keep=None, fail=False):
    return save_checkpoint(str(root), step, FakeBackend(fail), {"step": step}, keep=keep)


def test_next_save_clears_what_killed_saves_left(tmp_path):
    save(tmp_path, 1)
    os.makedirs(tmp_path / "step_000002.tmp" / "dcp")  # killed while writing
    (tmp_path / "latest.tmp4242").write_text("step_000002")  # killed while replacing `latest`
    os.makedirs(tmp_path / "step_000000")  # killed while deleting an old step (its marker went first)
    (tmp_path / "notes.txt").write_text("mine")  # not ours: left alone
    save(tmp_path, 3)
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes.txt", "step_000001", "step_000003"]


def test_keep_deletes_oldest_only_after_a_newer_one_is_complete(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep=2)
    assert complete_steps(str(tmp_path)) == [2, 3]
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 4, keep=2, fail=True)  # killed: nothing may be deleted for a step that never completed
    assert complete_steps(str(tmp_path)) == [2, 3] and resolve_checkpoint(str(tmp_path)).endswith("step_000003")
    save(tmp_path, 5, keep=1)
    assert complete_steps(str(tmp_path)) == [5] and sorted(os.listdir(tmp_path)) == ["latest", "step_000005"]
    assert os.path.isfile(tmp_path / "step_000005" / MARKER)


def test_default_keeps_every_checkpoint(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
    assert complete_steps(str(tmp_path)) == [1, 2, 3]


# ---- loading runs no code; every torn file is named ----

class _RunsCode:
    """A pickle payload that would create a file when unpickled with weights_only=False."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_tampered_extras_are_refused_naming_the_file_and_run_nothing(tmp_path):
    import torch

    from polyrl.checkpoint import CheckpointError, load_extras
    marker = tmp_path / "pwned"
    torch.save({"scheduler": {}, "cpu_rng": torch.get_rng_state(), "evil": _RunsCode(str(marker))},
               tmp_path / "extra_rank0.pt")
    with pytest.raises(CheckpointError, match="extra_rank0.pt holds objects other than tensors") as e:
        load_extras(str(tmp_path), rank=0)
    assert str(tmp_path / "extra_rank0.pt") in str(e.value) and not marker.exists()
    torch.save({"scheduler": {"last_epoch": 3}, "cpu_rng": torch.get_rng_state(), "cuda_rng": None, "skipped_steps": 0},
               tmp_path / "extra_rank0.pt")
    assert load_extras(str(tmp_path), rank=1)["scheduler"] == {"last_epoch": 3}  # rank 1 of a resume onto more ranks
    os.remove(tmp_path / "extra_rank0.pt")
    with pytest.raises(CheckpointError, match="extra_rank0.pt is missing"):
        load_extras(str(tmp_path), rank=0)


def test_dcp_shards_shorter_than_their_metadata_say_are_named(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from polyrl.checkpoint import CheckpointError, _check_dcp_files
    dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(tmp_path / "dcp"))
    _check_dcp_files(str(tmp_path))  # intact
    (shard,) = [f for f in os.listdir(tmp_path / "dcp") if f.endswith(".distcp")]
    with open(tmp_path / "dcp" / shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'dcp' / shard} is truncated"):
        _check_dcp_files(str(tmp_path))
    with open(tmp_path / "dcp" / ".metadata", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated or unreadable"):
        _check_dcp_files(str(tmp_path))


# ---- secrets ----

def test_saved_loop_state_has_every_secret_redacted_and_row_keys_kept(tmp_path):
    import dataclasses
    import json

    from polyrl.config import Config
    cfg = Config()
    cfg.engines.api_key = cfg.server.api_key = "sk-123-secret"
    save_checkpoint(str(tmp_path), 1, FakeBackend(), {"step": 1, "config": dataclasses.asdict(cfg),
                                                      "extra": {"hf_token": "hf_abc", "api_key_file": "/k"}})
    for d, _, files in os.walk(tmp_path):
        for f in files:
            data = open(os.path.join(d, f), "rb").read()
            assert b"sk-123-secret" not in data and b"hf_abc" not in data, f
    state = json.load(open(tmp_path / "step_000001" / "loop_state.json"))
    assert state["config"]["engines"]["api_key"] == state["config"]["server"]["api_key"] == "<redacted>"
    assert state["extra"] == {"hf_token": "<redacted>", "api_key_file": "<redacted>"}
    assert state["config"]["data"]["label_key"] == "label" and state["step"] == 1
    assert cfg.engines.api_key == "sk-123-secret"  # the run's own config is not touched


def test_latest_complete_names_the_newest_complete_step(tmp_path):
    from polyrl.checkpoint import latest_complete
    assert latest_complete(str(tmp_path)) is None and latest_complete(None) is None
    save(tmp_path, 1)
    save(tmp_path, 2)
    os.makedirs(tmp_path / "step_000003.tmp")
    assert latest_complete(str(tmp_path)) == os.path.abspath(tmp_path / "step_000002")


# ---- complete means every file is there ----

def test_a_checkpoint_with_a_deleted_shard_is_refused_naming_the_file_and_the_previous_one(tmp_path):
    from polyrl.checkpoint import CheckpointError, MANIFEST, latest_complete
    save(tmp_path, 1)
    save(tmp_path, 2)
    manifest = (tmp_path / "step_000002" / MANIFEST).read_text()
    (shard,) = [f for f in os.listdir(tmp_path / "step_000002" / "dcp") if f.endswith(".distcp")]
    assert f"dcp/{shard}" in manifest and "loop_state.json" in manifest
    os.remove(tmp_path / "step_000002" / "dcp" / shard)
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(str(tmp_path))  # follows `latest` to step 2
    msg = str(e.value)
    assert f"{tmp_path / 'step_000002' / 'dcp' / shard} is missing" in msg
    assert f"previous complete checkpoint is {tmp_path / 'step_000001'}" in msg
    assert latest_complete(str(tmp_path)) == str(tmp_path / "step_000001")  # a restart resumes from the intact one
    assert resolve_checkpoint(str(tmp_path / "step_000001")).endswith("step_000001")


def test_a_save_whose_shard_vanished_before_it_was_sealed_is_not_marked_complete(tmp_path):
    """What a second writer's cleanup did to the first run: the step is never marked complete without its shard."""
    from polyrl.checkpoint import CheckpointError

    class Vanishing(FakeBackend):
        def save(self, path, *, optimizer=True):
            super().save(path)
            for f in os.listdir(os.path.join(path, "dcp")):
                if f.endswith(".distcp"):
                    os.remove(os.path.join(path, "dcp", f))

    save(tmp_path, 1)
    with pytest.raises(CheckpointError, match=r"is missing .*step 2 was not marked complete.*latest complete "
                                              r"checkpoint: .*step_000001"):
        save_checkpoint(str(tmp_path), 2, Vanishing(), {"step": 2})
    assert complete_steps(str(tmp_path)) == [1]
    assert not (tmp_path / "step_000002").exists()


# ---- one run owns a save directory ----

def test_a_second_process_is_refused_the_save_dir_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    import signal
    import subprocess
    import sys
    import time

    from polyrl.checkpoint import LOCK, CheckpointError, claim_save_dir
    code = ("import sys, time; from polyrl.checkpoint import claim_save_dir; claim_save_dir(sys.argv[1], 'polyrl train'); "
            "print('owned', flush=True); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "owned"  # the other process holds the lock now
        with pytest.raises(CheckpointError) as e:
            claim_save_dir(str(tmp_path), "polyrl sft")
        msg = str(e.value)
        assert f"--save {tmp_path} is in use by another run (polyrl train pid {other.pid} on host" in msg
        assert str(tmp_path / LOCK) in msg
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(timeout=30)
    lock = claim_save_dir(str(tmp_path), "polyrl sft")  # killed: the kernel let go of its lock
    assert f"taking over from polyrl train pid {other.pid}" in capsys.readouterr().err
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK).read_text()
    lock.release()
    assert not (tmp_path / LOCK).exists()
    claim_save_dir(str(tmp_path), "polyrl sft").release()  # released: free for the next run, nothing to take over
    assert "taking over" not in capsys.readouterr().err


def test_a_file_system_without_locks_runs_unguarded_and_says_so(tmp_path, monkeypatch, capsys):
    import errno
    import fcntl

    from polyrl.checkpoint import LOCK, claim_save_dir

    def no_locks(fd, op):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = claim_save_dir(str(tmp_path), "polyrl train")
    assert f"cannot lock {tmp_path / LOCK}" in capsys.readouterr().err
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK).read_text()  # still names its run for a reader
    lock.release()
