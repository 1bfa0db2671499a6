"""The step parts on their own: the cursor, the rollout (plain and dynamic sampling) and the scorer, with a scripted
engine and real datasets, configs and reward functions (no loop object)."""

from __future__ import annotations

import contextlib

import pytest

from polyrl.assemble import prompt_dataset
from polyrl.config import Config
from polyrl.dist import Dist
from polyrl.metrics import Timer
from polyrl.rewards import RewardManager
from polyrl.rollout.dynamic_sampling import DynamicSamplingError, GroupFilter
from polyrl.step.cursor import PromptCursor
from polyrl.step.rollout import EngineRollout, FileRollout, Scorer
from polyrl.tasks.arithmetic import build_tokenizer
from polyrl.types import Sample


class ScriptedEngine:
    """Answers each prompt's n samples with the digit '7' repeated (response length = the sample's index in the group
    + 1), so the arithmetic reward and group filters see known values; records every call's seed."""

    version, concurrent_update = 0, False

    def __init__(self):
        self.tokenizer = build_tokenizer()
        self.seeds: list[int] = []

    def generate(self, prompts, params):
        self.seeds.append(params.seed)
        seven = self.tokenizer.convert_tokens_to_ids("7")
        return [Sample(p, [seven] * (j + 1), [0.0] * (j + 1), "stop", group_index=i, response="7" * (j + 1))
                for i, p in enumerate(prompts) for j in range(params.n)]


@pytest.fixture
def cfg(arith_data) -> Config:
    c = Config()
    c.data.prompt_data = arith_data["train"]
    c.rollout.rollout_batch_size, c.rollout.n_samples_per_prompt, c.rollout.num_rollout = 2, 3, 5
    c.reward.rm_type = "exact"
    return c


def cursor(cfg, per_draw=None, d=Dist(0, 1)) -> PromptCursor:
    ds = prompt_dataset(cfg, build_tokenizer(), cfg.data.prompt_data, shuffle=False)
    return PromptCursor(ds, d, per_draw or cfg.rollout.rollout_batch_size)


def test_cursor_remembers_where_each_step_started(cfg):
    c = cursor(cfg)
    start = c.dataset.state_dict()
    first = c.draw(0)
    c.draw(0)  # a second draw of the same step (dynamic sampling) keeps the step's start
    after_step0 = c.dataset.state_dict()
    c.draw(1)
    assert c.position_before(0) == start and c.position_before(1) == after_step0
    assert c.position_before(2) == c.dataset.state_dict()  # not drawn yet: the current position
    c.restore(start)
    assert [r.prompt for _, r in c.draw(0)] == [r.prompt for _, r in first]


def test_cursor_gives_each_rank_its_share(cfg):
    cfg.rollout.rollout_batch_size = 4
    a, b = cursor(cfg, d=Dist(0, 2)).draw(0), cursor(cfg, d=Dist(1, 2)).draw(0)
    assert len(a) == len(b) == 2 and {r.prompt for _, r in a}.isdisjoint({r.prompt for _, r in b})


def test_engine_rollout_generates_scores_and_times(cfg):
    eng = ScriptedEngine()
    ro = EngineRollout(cfg, eng, cursor(cfg), Scorer(cfg, None), Dist(0, 1), contextlib.nullcontext())
    timer = Timer()
    samples, scored, m = ro.collect(3, timer)
    assert len(samples) == 6 and m == {} and set(timer.times) == {"rollout", "reward"}
    assert eng.seeds == [cfg.rollout.rollout_seed + 3]  # seed + step * world + rank
    assert all(s.prompt and s.weight_version == 0 for s in samples)  # records attached, version stamped
    assert scored["reward/mean"] == 0.0


def test_dynamic_sampling_keeps_groups_the_filter_passes_and_draws_again(cfg, tmp_path):
    flt = tmp_path / "flt.py"
    flt.write_text("calls = []\ndef every_other(group):\n    calls.append(1)\n    return len(calls) % 2 == 0\n")
    eng = ScriptedEngine()
    ro = EngineRollout(cfg, eng, cursor(cfg, per_draw=2), Scorer(cfg, RewardManager.from_config(cfg.reward)), Dist(0, 1),
                       contextlib.nullcontext(), group_filter=GroupFilter(f"{flt}:every_other", Dist(0, 1)))
    samples, scored, m = ro.collect(0, Timer())
    # each draw of 2 prompts keeps 1 group: 2 draws fill the step's 2 groups, renumbered 0 and 1
    assert m["dynamic_sampling/extra_draws"] == 1 and m["dynamic_sampling/dropped_groups"] == 2
    assert sorted({s.group_index for s in samples}) == [0, 1] and len(samples) == 6
    assert len(eng.seeds) == 2 and eng.seeds[0] != eng.seeds[1]  # each draw samples with its own seed
    flt.write_text("def never(group):\n    return False\n")
    ro.group_filter = GroupFilter(f"{flt}:never", Dist(0, 1))
    with pytest.raises(DynamicSamplingError, match="kept 0 of --rollout-batch-size 2 groups in step 2"):
        ro.collect(1, Timer())


def test_scorer_adds_the_overlong_penalty_after_the_reward(cfg):
    cfg.rollout.rollout_max_response_len, cfg.reward.overlong_buffer_len = 4, 2
    samples = ScriptedEngine().generate([[1], [2]], type("P", (), {"n": 4, "seed": 0})())
    for s in samples:
        s.label = "7"
    m = Scorer(cfg, RewardManager.from_config(cfg.reward))(samples)
    # length 1 and 2 fit max - L = 2 tokens; 3 and 4 lose (len - 2) / 2 of the factor 1.0; only "7" matches the label
    assert [s.reward for s in samples[:4]] == [1.0, 0.0, -0.5, -1.0]
    assert m["reward/overlong_penalty"] == pytest.approx(-3.0 / 8)


def test_file_rollout_draws_so_the_data_position_matches(cfg, tmp_path):
    from polyrl.debug_rollout import RolloutFiles
    tok = build_tokenizer()
    files = RolloutFiles(str(tmp_path / "r{rollout_id}.jsonl"), tokenizer=tok, hf_checkpoint=_model_dir(tmp_path),
                         rollout_batch_size=2, n_samples_per_prompt=3, rank=0, world=1)
    saved = ScriptedEngine().generate([[1], [2]], type("P", (), {"n": 3, "seed": 0})())
    for s in saved:
        s.reward = 0.25
    files.save(0, saved)
    c = cursor(cfg)
    samples, scored, _ = FileRollout(files, c, Scorer(cfg, None)).collect(0, Timer())
    assert [s.reward for s in samples] == [0.25] * 6 and scored["reward/mean"] == 0.25
    assert c.dataset.state_dict() != cursor(cfg).dataset.state_dict()  # drawn: the cursor moved past step 0


def _model_dir(tmp_path) -> str:
    import json
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                               "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1}))
    return str(d)


def test_book_reports_the_steps_gpu_memory_peaks_and_retries(monkeypatch):
    """The step's CUDA allocator figures (polyrl.step.book.Book.gpu_memory) against a scripted allocator: peaks in GiB,
    reset after every step, and the retries of this step only (the allocator's count is cumulative, from start-up);
    nothing at all on CPU."""
    import torch

    from polyrl.step.book import Book
    state = {"allocated": 0, "reserved": 0, "retries": 2, "resets": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a: {"num_alloc_retries": state["retries"]})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: state.update(resets=state["resets"] + 1))
    book = Book(Config(), Dist(0, 1), None, None, None, None, None, "cuda")  # 2 retries before the first step
    on_cpu = Book(Config(), Dist(0, 1), None, None, None, None, None, "cpu")
    try:
        state.update(allocated=3 * 2**29, reserved=2**31, retries=5)
        assert book.gpu_memory() == {"memory/peak_allocated_gib": 1.5, "memory/peak_reserved_gib": 2.0,
                                     "memory/alloc_retries": 3}
        state.update(allocated=2**30)
        assert book.gpu_memory()["memory/alloc_retries"] == 0 and state["resets"] == 2
        assert on_cpu.gpu_memory() == {}
    finally:
        book.close()
        on_cpu.close()
