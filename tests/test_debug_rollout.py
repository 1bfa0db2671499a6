"""Debug modes: --debug-rollout-only, --save-debug-rollout-data, --debug-train-only with --load-debug-rollout-data,
the saved file format and its checks, and the flag combinations they refuse. CPU, tiny model, 2 steps."""

from __future__ import annotations

import json
import shutil

import pytest

from polyrl.cli import main

REWARD = '''
def digits(sample):
    return sum(c.isdigit() for c in sample.response) / 8.0
'''
KEYS = ("loss", "pg_loss", "grad_norm", "entropy", "reward/mean", "reward/accuracy", "response_len/mean",
        "train_rollout_logprob_abs_diff")


@pytest.fixture
def args(tiny_model, arith_data):
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--lr", "1e-3", "--num-rollout", "2",
            "--quiet", "--device", "cpu", "--seed", "3"]


@pytest.fixture
def reward(tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    return ["--custom-rm-path", f"{rm}:digits"]


def rows(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def test_train_only_on_saved_rollouts_gives_the_original_losses(args, reward, tmp_path):
    data = tmp_path / "rollouts" / "step_{rollout_id}.jsonl"
    assert main([*args, *reward, "--run-dir", str(tmp_path / "orig"), "--save-debug-rollout-data", str(data)]) == 0
    files = sorted((tmp_path / "rollouts").iterdir())
    assert [f.name for f in files] == ["step_0.jsonl", "step_1.jsonl"]
    header, *samples = [json.loads(line) for line in open(files[0])]
    assert (header["format"], header["version"], header["rollout_id"], header["n_samples"]) == ("polyrl-rollout", 1, 0, 8)
    assert header["tokenizer"]["vocab_size"] > 0 and len(header["tokenizer"]["sha256"]) == 64
    assert len(samples) == 8 and {"prompt_ids", "response_ids", "rollout_logprobs", "reward"} <= samples[0].keys()

    # no reward flag: the rewards saved with the samples are used; no engine is built
    assert main([*args, "--run-dir", str(tmp_path / "replay"), "--debug-train-only",
                 "--load-debug-rollout-data", str(data)]) == 0
    orig, replay = rows(tmp_path / "orig"), rows(tmp_path / "replay")
    assert [r["step"] for r in replay] == [1, 2] and orig[0]["grad_norm"] > 0
    # Same weights (same seed, same HF init, step 1's update repeated), the same batch (ids, rewards and fp32 rollout
    # log-probs read back bit for bit from JSON) and deterministic CPU kernels: the replay computes the same numbers.
    # The tolerance (1e-6 relative) only allows for a reordered float sum; in practice they are equal.
    for a, b in zip(orig, replay):
        for k in KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), k
    assert "time/weight_sync" in replay[0]


class _SleepsLikeAGPU:
    """The real engine, but asleep after sleep() until wake(), as the GPU engine is (on CPU sleep is a no-op)."""

    def __init__(self, engine):
        self._engine, self.asleep, self.sleeps = engine, False, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def sleep(self):
        self.asleep, self.sleeps = True, self.sleeps + 1

    def wake(self, tags=None):
        self.asleep = False

    def generate(self, *a, **kw):
        assert not self.asleep, "generate() on a sleeping engine"
        return self._engine.generate(*a, **kw)


def test_rollout_only_generates_and_scores_without_training(args, reward, tmp_path, monkeypatch):
    """Nothing trains, so nothing would wake a colocated engine put to sleep after the rollout: it stays awake."""
    import polyrl.assemble as asm
    build, engines = asm.build_engine, []
    monkeypatch.setattr(asm, "build_engine", lambda cfg, plan: engines.append(_SleepsLikeAGPU(build(cfg, plan))) or engines[-1])
    data = tmp_path / "ro" / "r_{rollout_id}.jsonl"
    assert main([*args, *reward, "--run-dir", str(tmp_path / "run"), "--debug-rollout-only",
                 "--save-debug-rollout-data", str(data)]) == 0
    got = rows(tmp_path / "run")
    assert [r["step"] for r in got] == [1, 2]
    for r in got:
        assert "reward/mean" in r and "response_len/mean" in r and "time/rollout" in r
        assert "loss" not in r and "grad_norm" not in r and "time/train" not in r
    assert sorted(p.name for p in (tmp_path / "ro").iterdir()) == ["r_0.jsonl", "r_1.jsonl"]
    assert len(engines) == 1 and engines[0].sleeps == 0


def test_a_file_from_another_tokenizer_is_refused(args, reward, tiny_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    data = tmp_path / "rollouts" / "step_{rollout_id}.jsonl"
    assert main([*args, *reward, "--num-rollout", "1", "--run-dir", str(tmp_path / "orig"), "--debug-rollout-only",
                 "--save-debug-rollout-data", str(data)]) == 0
    other = tmp_path / "other_model"
    shutil.copytree(tiny_model, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(str(other))
    argv = [a if a != tiny_model else str(other) for a in args]
    assert main([*argv, "--run-dir", str(tmp_path / "replay"), "--load-debug-rollout-data", str(data)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "rollouts" / "step_0.jsonl") in err and "another tokenizer" in err
    assert f"vocab_size {len(tok) - 1} in the file vs {len(tok)} here" in err
    assert not (tmp_path / "replay" / "metrics.jsonl").exists()


def test_a_missing_or_foreign_file_is_a_clear_error(args, tmp_path, capsys):
    missing = tmp_path / "none_{rollout_id}.jsonl"
    assert main([*args, "--run-dir", str(tmp_path / "a"), "--debug-train-only", "--load-debug-rollout-data", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"no file {tmp_path / 'none_0.jsonl'}" in err and "--save-debug-rollout-data" in err
    (tmp_path / "bad_0.jsonl").write_text('{"hello": 1}\n')
    assert main([*args, "--run-dir", str(tmp_path / "b"), "--load-debug-rollout-data", str(tmp_path / "bad_{rollout_id}.jsonl")]) == 2
    assert "bad_0.jsonl: not a polyrl rollout file" in capsys.readouterr().err


@pytest.mark.parametrize("extra, needle", [
    (["--debug-train-only"], "--debug-train-only trains on saved rollouts: add --load-debug-rollout-data"),
    (["--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data", "x_{rollout_id}"], "exclude each other"),
    (["--debug-rollout-only", "--load-debug-rollout-data", "x_{rollout_id}"], "exclude each other"),
    (["--save-debug-rollout-data", "x.jsonl"], "put {rollout_id} in the path"),
    (["--save-debug-rollout-data", "a_{rollout_id}", "--load-debug-rollout-data", "a_{rollout_id}"], "write back what it reads"),
    (["--debug-rollout-only", "--async"], "drop --async"),
    (["--load-debug-rollout-data", "x_{rollout_id}", "--eval-interval", "1"], "drop --eval-interval"),
])
def test_debug_flag_combinations_exit_2_naming_the_flags(extra, needle, args, reward, capsys, monkeypatch):
    monkeypatch.setattr("polyrl.assemble.setup_command", lambda cfg: pytest.fail("validation must stop the run before set-up"))
    assert main([*args, *reward, *extra]) == 2
    assert needle in capsys.readouterr().err
