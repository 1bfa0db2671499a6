"""--partial-rollout on CPU through the CLI (tiny model, the length-controlled workload): every step trains exactly
--rollout-batch-size complete groups, the cut samples come back in later steps continued (not restarted), nothing is
trained twice, a resume from --save continues the buffer as the uninterrupted run does, and the flags it cannot honour
are refused at start-up."""

from __future__ import annotations

import collections
import json
import os

import pytest

from polyrl.cli import main

REWARD = '''
def digits(sample):
    return sum(c.isdigit() for c in sample.response) / 8.0
'''


@pytest.fixture
def args(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    return ["--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:digits",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "24", "--lr", "1e-3",
            "--quiet", "--seed", "3", "--device", "cpu", "--partial-rollout", "--over-sampling-batch-size", "8",
            "--rollout-length-distribution", "lognormal:median=6,p99=20,cap=24"]


def run(args, tmp_path, name, *extra) -> tuple[list[dict], list[list[dict]]]:
    d = tmp_path / name
    saved = str(d / "rollout_{rollout_id}.jsonl")
    assert main(["train", *args, "--run-dir", str(d), "--save-debug-rollout-data", saved, *extra]) == 0
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    steps = sorted(int(f.split("_")[1].split(".")[0]) for f in os.listdir(d) if f.startswith("rollout_"))
    return rows, [[json.loads(line) for line in open(saved.format(rollout_id=k))][1:] for k in steps]


def key(s: dict) -> tuple:
    """A sample's identity: its group (a drawn prompt) and seed, and what it generated."""
    pr = s["metadata"]["partial_rollout"]
    return pr["group"], pr["seed"], tuple(s["prompt_ids"]), tuple(s["response_ids"])


def test_steps_hold_complete_groups_and_cut_samples_are_continued_once(args, tmp_path):
    rows, steps = run(args, tmp_path, "a", "--num-rollout", "4")
    assert [len(s) for s in steps] == [16] * 4
    for samples in steps:
        groups = collections.Counter(s["group_index"] for s in samples)
        assert sorted(groups) == [0, 1, 2, 3] and set(groups.values()) == {4}
        assert all(s["finish_reason"] in ("stop", "length") for s in samples)
    trained = [key(s) for samples in steps for s in samples]
    assert len(set(trained)) == len(trained)  # no sample trained twice
    assert sum(r["partial_rollout/aborted_samples"] for r in rows) > 0
    assert sum(r["partial_rollout/resumed_samples"] for r in rows[1:]) > 0  # continued in a later step
    assert rows[0]["partial_rollout/token_lag_max"] == 0 and max(r["partial_rollout/token_lag_max"] for r in rows) >= 1
    assert all(r["rollout/decode_steps"] > 0 and r["rollout/occupancy_mean"] > 0 for r in rows)  # the engine's counters
    for r in rows:  # the engine's log-probs on this policy's tokens are the trainer's; older tokens are apart
        assert r["train_rollout_logprob_abs_diff_max"] < 1e-4
    assert any(r["train_rollout_logprob_abs_diff_older_weights"] > 0 for r in rows[1:])


def test_resume_continues_the_buffer_without_loss_or_duplicates(args, tmp_path):
    _, full = run(args, tmp_path, "full", "--num-rollout", "4")
    _, first = run(args, tmp_path, "first", "--num-rollout", "2", "--save", str(tmp_path / "ck"))
    state = json.load(open(tmp_path / "ck" / "step_000002" / "loop_state.json"))
    assert state["data"]["partial_rollout"]  # the cut groups are in the checkpoint
    _, resumed = run(args, tmp_path, "second", "--num-rollout", "4", "--load", str(tmp_path / "ck"))
    assert len(first) == 2 and len(resumed) == 2  # steps 3 and 4 in the resumed run's directory
    # the interrupted run trains what the uninterrupted one does, step for step: nothing lost, nothing twice
    assert [[key(s) for s in x] for x in first + resumed] == [[key(s) for s in x] for x in full]
    trained = [key(s) for samples in first + resumed for s in samples]
    assert len(set(trained)) == len(trained)
    assert any(s["metadata"]["partial_rollout"]["carried"] for s in resumed[0])  # the buffer came back and was continued


def test_mask_offpolicy_keeps_earlier_tokens_out_of_the_loss(args, tmp_path):
    _, steps = run(args, tmp_path, "m", "--num-rollout", "3", "--mask-offpolicy-in-partial-rollout")
    carried = [(s, s["metadata"]["partial_rollout"]["carried"]) for samples in steps for s in samples]
    assert any(c for _, c in carried)
    for s, c in carried:
        mask = s["loss_mask"] or [1] * len(s["response_ids"])
        assert mask[:c] == [0] * c


def test_max_staleness_drops_old_partial_samples(args, tmp_path):
    rows, _ = run(args, tmp_path, "s", "--num-rollout", "4", "--max-staleness", "1",
                  "--rollout-length-distribution", "lognormal:median=4,p99=24,cap=24")
    assert all(r["partial_rollout/token_lag_max"] <= 1 for r in rows)


@pytest.mark.parametrize("extra, msg", [
    (["--rollout-engine", "sglang"], "--rollout-length-distribution is not honoured by --rollout-engine sglang"),
    (["--custom-generate-function-path", "x.py:f"], "--partial-rollout with --custom-generate-function-path"),
    (["--true-on-policy"], "--partial-rollout with --true-on-policy"),
])
def test_refused_combinations(args, tmp_path, capsys, extra, msg):
    assert main(["train", *args, "--run-dir", str(tmp_path / "r"), *extra]) == 2
    assert msg in capsys.readouterr().err


def test_flags_that_need_partial_rollout(args, tmp_path, capsys):
    plain = [a for a in args if a not in ("--partial-rollout",)]
    i = plain.index("--over-sampling-batch-size")
    del plain[i:i + 2]
    for extra, msg in ((["--mask-offpolicy-in-partial-rollout"], "masks the resumed tokens of --partial-rollout"),
                       (["--max-staleness", "2"], "only applies with --async or --partial-rollout"),
                       (["--over-sampling-batch-size", "8"], "--over-sampling-batch-size draws extra prompts")):
        assert main(["train", *plain, "--run-dir", str(tmp_path / "r"), *extra]) == 2
        assert msg in capsys.readouterr().err


# A server decodes the tiny model's whole 24-token tail in a few milliseconds, about what the client takes to read the
# first groups' answers and send /abort_request: at the fixture's lengths a loaded machine can see every request
# answered before its abort lands and nothing cut (the embedded engine checks the stop at every decode step instead).
# The server runs keep the median and stretch the tail to 200 tokens, so stragglers are still decoding when it lands.
SERVER_TAIL = ["--rollout-max-response-len", "200", "--rollout-length-distribution", "lognormal:median=6,p99=200,cap=200"]


@pytest.mark.parametrize("extra", [
    ["--async"],  # generation a step ahead on the rollout thread, the buffer carried between its steps
    ["--dynamic-sampling-filter-path", "polyrl.rewards.filters:nonzero_std"],  # a filtered group does not count
    ["--rollout-engine", "server", "--rollout-num-engines", "1", "--weight-sync", "distributed", *SERVER_TAIL],
    # the real sglang-router in front of two: aborts go to every worker by rid
    ["--rollout-engine", "server", "--rollout-num-engines", "2", "--weight-sync", "distributed", "--use-sglang-router",
     *SERVER_TAIL],
], ids=["async", "dynamic-sampling", "polyrl-serve", "router"])
def test_other_modes_hold_complete_groups_and_continue_cut_ones(args, tmp_path, extra):
    rows, steps = run(args, tmp_path, "o", "--num-rollout", "3", *extra)
    assert [len(s) for s in steps] == [16] * 3
    for samples in steps:
        assert set(collections.Counter(s["group_index"] for s in samples).values()) == {4}
        assert all(s["finish_reason"] in ("stop", "length") for s in samples)
    trained = [key(s) for samples in steps for s in samples]
    assert len(set(trained)) == len(trained)
    assert sum(r["partial_rollout/aborted_samples"] for r in rows) > 0
    if "--dynamic-sampling-filter-path" in extra:
        for samples in steps:  # every kept group has rewards that differ
            by = collections.defaultdict(set)
            for s in samples:
                by[s["group_index"]].add(s["reward"])
            assert all(len(v) > 1 for v in by.values())


def test_async_resume_trains_no_sample_twice(args, tmp_path):
    """--async: the checkpoint holds the buffer as the first untrained step found it (the rollout thread had collected
    a step further), and the groups drawn again after --load get the keys they had: no (group, sample) trains twice."""
    _, first = run(args, tmp_path, "first", "--num-rollout", "2", "--async", "--save", str(tmp_path / "ck"))
    _, resumed = run(args, tmp_path, "second", "--num-rollout", "4", "--async", "--load", str(tmp_path / "ck"))
    trained = [key(s)[:2] for samples in first + resumed for s in samples]
    assert len(trained) == 64 and len(set(trained)) == len(trained)


def test_groups_are_scored_while_the_others_decode(tiny_model, arith_data):
    """Streaming groups: the reward function runs on its own thread as each group completes, while the engine is still
    inside the same generate call decoding the rest (a real embedded engine, a scorer that records when it ran)."""
    import contextlib
    import threading

    from polyrl.assemble import prompt_dataset
    from polyrl.config import Config
    from polyrl.dist import Dist
    from polyrl.metrics import Timer
    from polyrl.rewards import reward_metrics
    from polyrl.rollout.embedded import EmbeddedEngine
    from polyrl.step.partial_rollout import BufferedCursor, PartialRollout

    cfg = Config()
    cfg.data.prompt_data, cfg.model.hf_checkpoint = arith_data["train"], tiny_model
    r = cfg.rollout
    r.rollout_batch_size, r.n_samples_per_prompt, r.rollout_max_response_len, r.over_sampling_batch_size = 3, 2, 40, 6
    r.partial_rollout, r.rollout_length_distribution = True, "lognormal:median=4,p99=36,cap=40"
    engine = EmbeddedEngine(tiny_model)
    inside = threading.Event()
    generate = engine.generate

    def tracked(*a, **kw):
        inside.set()
        try:
            return generate(*a, **kw)
        finally:
            inside.clear()
    engine.generate = tracked
    seen = []

    def score(samples):
        seen.append((inside.is_set(), threading.current_thread().name))
        return reward_metrics(samples)
    d = Dist(0, 1)
    cur = BufferedCursor(prompt_dataset(cfg, engine.tokenizer, cfg.data.prompt_data, shuffle=False), d, 6)
    part = PartialRollout(cfg, engine, cur, score, d, contextlib.nullcontext())
    samples, scored, m = part.collect(0, Timer())
    assert len(samples) == 6 and scored["reward/samples"] >= 6
    assert all(name.startswith("polyrl-score") for _, name in seen)
    assert any(during for during, _ in seen)  # at least one group scored before the engine call returned
    assert m["partial_rollout/aborted_samples"] > 0 and len(cur.buffer.groups) > 0
