"""On-policy distillation through the CLI (`polyrl train --opd-teacher-load`) on CPU: a teacher of another size,
a teacher equal to the student, and the start-up checks of the teacher's directory and tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from polyrl.cli import main
from tests.conftest import make_model_dir

CONSTANT = '''
def zero(sample):
    return 0.0
'''


@pytest.fixture(scope="module")
def small_teacher(tmp_path_factory) -> str:
    """Another size than tiny_model (1 layer, hidden 32 vs 2 layers, hidden 64), other weights, the same tokenizer."""
    return make_model_dir(tmp_path_factory.mktemp("teacher"), layers=1, hidden=32, seed=7)


def _args(tiny_model, arith_data, tmp_path, *extra: str) -> list[str]:
    rm = tmp_path / "rm.py"
    rm.write_text(CONSTANT)
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:zero",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
            "--num-rollout", "2", "--quiet", "--seed", "3", "--device", "cpu", "--run-dir", str(tmp_path / "run"), *extra]


def _rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(tmp_path, "run", "metrics.jsonl"))]


def test_teacher_of_another_size_trains_and_logs_opd_metrics(tiny_model, small_teacher, arith_data, tmp_path):
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-teacher-load", small_teacher, "--lr", "1e-3")) == 0
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["opd/teacher_logprob"] < 0 and abs(r["opd/reverse_kl"]) > 1e-3  # two random models disagree
        # the reward is constant, so GRPO's advantage is 0: every gradient comes from the teacher's term
        assert r["grad_norm"] > 0
        # one minibatch on policy: ratio 1, so pg_loss = -mean(A) = -mean(1 * (teacher - student)) = opd/reverse_kl
        assert r["pg_loss"] == pytest.approx(r["opd/reverse_kl"], rel=1e-5)


def test_opd_runs_in_the_one_step_off_loop(tiny_model, small_teacher, arith_data, tmp_path):
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-teacher-load", small_teacher, "--async")) == 0
    assert all("opd/reverse_kl" in r and "opd/teacher_logprob" in r for r in _rows(tmp_path))


def test_teacher_equal_to_the_student_gives_zero_reverse_kl_and_no_update_signal(tiny_model, arith_data, tmp_path):
    # lr 1e-12: Adam moves each weight by ~1e-12, below one fp32 ulp of weights ~1e-2, so the student stays
    # bit-identical to the teacher in step 2 too. Both logprobs then come from the same fp32 CPU kernels on
    # the same weights and token ids (the student in train mode, the teacher in eval mode: no dropout in these
    # models), so they agree exactly; 1e-6 leaves room for fp32 rounding should a kernel reduce in another order.
    # With reward 0 the task advantage is 0, so advantage = 5 * (teacher - student) ~ 0: loss and gradient ~ 0.
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-teacher-load", tiny_model, "--opd-coef", "5",
                      "--lr", "1e-12")) == 0
    for r in _rows(tmp_path):
        assert abs(r["opd/reverse_kl"]) < 1e-6
        assert r["opd/teacher_logprob"] < 0
        assert abs(r["pg_loss"]) < 1e-6 and r["grad_norm"] < 1e-5


def test_mismatched_tokenizer_exits_2_naming_both_directories(tiny_model, arith_data, tmp_path, capsys):
    from transformers import AutoTokenizer
    other = make_model_dir(tmp_path / "other", layers=1, hidden=32)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<tool>"])  # one more token: ids no longer mean the same text in both
    tok.save_pretrained(other)
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-teacher-load", other)) == 2
    err = capsys.readouterr().err
    assert "--opd-teacher-load" in err and other in err and tiny_model in err and "tokenizer" in err
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # refused before any model was built


def test_flag_checks(tiny_model, arith_data, tmp_path, capsys):
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-coef", "0.5")) == 2  # a weight without a teacher
    assert "--opd-teacher-load" in capsys.readouterr().err
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-teacher-load", str(tmp_path / "nope"))) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(_args(tiny_model, arith_data, tmp_path, "--opd-teacher-load", tiny_model, "--opd-coef", "-1")) == 2
    assert main(["sft", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--opd-teacher-load", tiny_model,
                 "--device", "cpu", "--quiet", "--run-dir", str(tmp_path / "sft")]) == 2
    assert "polyrl sft" in capsys.readouterr().err
