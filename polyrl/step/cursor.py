"""The prompt cursor: draws each step's prompts and remembers where each step started, for resume."""

from __future__ import annotations

import hashlib
import json
import os
import threading

from polyrl.data import DataError, PromptDataset, parse_data_spec
from polyrl.dist import Dist
from polyrl.metrics import notice

HEAD_ROWS = 16  # the prompts whose text the identity hashes: an edit at the top of the file changes it


class PromptCursor:
    """This rank's share of each draw, and the dataset position before each step's first draw (a checkpoint records the
    position of the first step it has not trained, with the identity of the data it points into). Thread-safe: the
    async loop draws on its rollout thread and saves on the main thread.
    source: the --prompt-data spec (its file's size is part of the identity); allow_change: --allow-data-change."""

    def __init__(self, dataset: PromptDataset, d: Dist, per_draw: int, *, source: str | None = None,
                 allow_change: bool = False):
        self.dataset, self.d, self.per_draw = dataset, d, per_draw
        self.source, self.allow_change = source, allow_change
        self._lock = threading.Lock()
        self._starts: dict[int, dict] = {}  # step -> dataset position before its prompts (drawn, not yet finished)

    def draw(self, step: int, n: int | None = None) -> list:
        """This rank's prompts of the next draw of `step` (--over-sampling-batch-size of them with dynamic sampling;
        n: that many instead, what --partial-rollout's buffer leaves of a draw)."""
        with self._lock:
            self._starts.setdefault(step, self.dataset.state_dict())
            return self.d.shard(self.dataset.next_batch(n or self.per_draw))

    def position_before(self, step: int) -> dict:
        """The dataset position before the prompts of `step`, whether they were drawn already or not (the async loop
        draws ahead; steps are drawn in order, so one not drawn yet starts at the current position). Forgets the steps
        up to `step`."""
        with self._lock:
            state = self._starts.get(step, self.dataset.state_dict())
            for k in [k for k in self._starts if k <= step]:
                del self._starts[k]
            return state

    def checkpoint_state(self, step: int) -> dict:
        """What a checkpoint saved after step `step` - 1 records: position_before(step) and the data's identity."""
        return {**self.position_before(step), "data_file": self.identity()}

    def identity(self) -> dict:
        return data_identity([rec.prompt for _, rec in self.dataset.items[:HEAD_ROWS]], len(self.dataset), self.source)

    def restore(self, state: dict) -> None:
        """Resume at a saved position; refused (DataError) when the data it points into changed since the save, unless
        allow_change."""
        state = dict(state)
        if state.get("partial_rollout"):
            from polyrl.config import ConfigError
            raise ConfigError(f"--load: the checkpoint holds {len(state['partial_rollout'])} unfinished prompt groups "
                              "of --partial-rollout; resume with --partial-rollout, or they would be lost")
        saved = state.pop("data_file", None)
        if saved is not None:
            at = f"epoch {state.get('epoch')}, prompt {state.get('position')}"
            if check_same_data(saved, self.identity(), at, self.allow_change) and \
                    int(state.get("position", 0)) >= len(self.dataset):
                notice(f"the saved position is past the {len(self.dataset)} prompts now: the next epoch starts")
        with self._lock:
            self.dataset.load_state_dict(state)

    @property
    def num_dropped(self) -> int:
        return self.dataset.num_dropped


def data_identity(head: list, rows: int, source: str | None) -> dict:
    """The data a saved position counts in: how many rows, the file's size and a hash of the first HEAD_ROWS rows."""
    text = json.dumps(head[:HEAD_ROWS], sort_keys=True, default=str).encode()
    out = {"rows": rows, "head_sha256": hashlib.sha256(text).hexdigest()[:16]}
    if source:
        path = parse_data_spec(source)[0]
        out.update(file=source, bytes=os.path.getsize(path) if os.path.isfile(path) else None)
    return out


def check_same_data(saved: dict, now: dict, at: str, allow_change: bool) -> bool:
    """Whether the data changed since a checkpoint saved position `at` in it: a DataError naming what changed, or with
    allow_change (--allow-data-change) a warning and True."""
    changed = [f"{k} {saved.get(k)} -> {now.get(k)}" for k in ("rows", "bytes", "head_sha256")
               if k in saved and k in now and saved[k] != now[k]]
    if not changed:
        return False
    what = (f"the data changed since the checkpoint was saved ({saved.get('file') or 'the saved data'} then, "
            f"{now.get('file') or 'this data'} now: {', '.join(changed)}), so its position ({at}) counts in other rows")
    if not allow_change:
        raise DataError(f"--load: {what}; restore the data file, or pass --allow-data-change to resume at that position "
                        "in the new data anyway")
    notice(f"WARNING --allow-data-change: {what}; resuming there")
    return True
