"""Checkpoint directories: atomic steps, clearing what killed saves left, --max-ckpt-to-keep (no model needed)."""

from __future__ import annotations

import os

import pytest

from polyrl.checkpoint import MARKER, complete_steps, resolve_checkpoint, save_checkpoint


class FakeBackend:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def save(self, path: str) -> None:
        os.makedirs(os.path.join(path, "dcp"))
        with open(os.path.join(path, "dcp", ".metadata"), "w") as f:
            f.write("x")
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
