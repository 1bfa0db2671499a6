"""The prompt cursor: draws each step's prompts and remembers where each step started, for resume."""

from __future__ import annotations

import threading

from polyrl.data import PromptDataset
from polyrl.dist import Dist


class PromptCursor:
    """This rank's share of each draw, and the dataset position before each step's first draw (a checkpoint records the
    position of the first step it has not trained). Thread-safe: the async loop draws on its rollout thread and saves
    on the main thread."""

    def __init__(self, dataset: PromptDataset, d: Dist, per_draw: int):
        self.dataset, self.d, self.per_draw = dataset, d, per_draw
        self._lock = threading.Lock()
        self._starts: dict[int, dict] = {}  # step -> dataset position before its prompts (drawn, not yet finished)

    def draw(self, step: int) -> list:
        """This rank's prompts of the next draw of `step` (--over-sampling-batch-size of them with dynamic sampling)."""
        with self._lock:
            self._starts.setdefault(step, self.dataset.state_dict())
            return self.d.shard(self.dataset.next_batch(self.per_draw))

    def position_before(self, step: int) -> dict:
        """The dataset position before the prompts of `step`, whether they were drawn already or not (the async loop
        draws ahead; steps are drawn in order, so one not drawn yet starts at the current position). Forgets the steps
        up to `step`."""
        with self._lock:
            state = self._starts.get(step, self.dataset.state_dict())
            for k in [k for k in self._starts if k <= step]:
                del self._starts[k]
            return state

    def restore(self, state: dict) -> None:
        with self._lock:
            self.dataset.load_state_dict(state)

    @property
    def num_dropped(self) -> int:
        return self.dataset.num_dropped
