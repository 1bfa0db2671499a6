"""--rollout-external: a long-lived server that another run updated still samples the first rollout of a new run from
that run's trainer weights (the trainer pushes them before the first rollout)."""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from serve_procs import serving  # noqa: E402

from polyrl.cli import main  # noqa: E402


REWARD = '''
def digits(sample):
    """partial credit: non-zero advantages on an untrained model, so the first run's weights really move"""
    return sum(c.isdigit() for c in sample.response) / 4.0
'''


def test_two_runs_against_one_server_each_sample_from_their_own_trainer(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    with serving(tiny_model, tmp_path, 1) as (srv,):
        def run(name: str, steps: int) -> list[dict]:
            run_dir = tmp_path / name
            assert main(["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:digits",
                         "--rollout-external", "--rollout-external-engine-addrs", srv.url, "--rollout-batch-size", "2",
                         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--lr", "1e-2",
                         "--num-rollout", str(steps), "--seed", "3", "--quiet", "--device", "cpu",
                         "--run-dir", str(run_dir)]) == 0
            return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]

        first = run("first", 2)  # leaves the server at the first run's step-2 weights (lr 1e-2 moves them)
        second = run("second", 1)
    assert first[0]["grad_norm"] > 0 and first[1]["grad_norm"] > 0
    # FP32 on CPU: the server's and the trainer's log-probs of the same weights agree to rounding (the embedded engine's
    # bound in tests/test_loop.py); the first run's trained weights would differ by far more than that
    for rows in (first, second):
        assert rows[0]["train_rollout_logprob_abs_diff_max"] < 1e-4, rows[0]


def test_an_unreachable_external_engine_is_named_after_a_short_wait(tiny_model, arith_data, tmp_path, capsys):
    """Nothing listens at the --rollout-external address: one line says what is waited for, and after
    --rollout-external-startup-timeout the run stops with one line naming the URL and that flag (not
    --rollout-engine-startup-timeout, which attached servers refuse, naming the one that applies)."""
    from polyrl.dist import free_port
    url = f"http://127.0.0.1:{free_port()}"  # free now: nothing answers there
    common = ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rollout-external",
              "--rollout-external-engine-addrs", url, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
              "--rm-type", "arithmetic", "--num-rollout", "1", "--quiet", "--device", "cpu"]
    assert main(common + ["--rollout-external-startup-timeout", "1", "--run-dir", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert f"polyrl: waiting for --rollout-external engine {url} to answer /health, up to 1 s " \
           "(--rollout-external-startup-timeout)" in err, err
    line = [x for x in err.splitlines() if x.startswith("polyrl train: error:")]
    assert len(line) == 1 and f"engine 0 ({url}) did not answer /health within 1 s " \
                              "(--rollout-external-startup-timeout)" in line[0] and "reachable" in line[0], err
    assert main(common + ["--rollout-engine-startup-timeout", "5", "--run-dir", str(tmp_path / "b")]) == 2
    assert "--rollout-external-startup-timeout bounds the wait" in capsys.readouterr().err


def test_an_external_server_of_another_vocabulary_is_named_as_refusing_the_weights(tiny_model, arith_data, tmp_path,
                                                                                  capsys):
    """The trainer's model has one token more than the served one: the first weight push is refused by the live
    server, and the one line says so (with the server's reason), not that the server is gone."""
    from polyrl.tasks.arithmetic import build_model, build_tokenizer
    wider = tmp_path / "wider"
    build_model(str(wider), hidden=64, layers=2, tokenizer=build_tokenizer(extra_tokens=("<tool_call>",)))
    with serving(tiny_model, tmp_path, 1) as (srv,):
        assert main(["train", "--hf-checkpoint", str(wider), "--prompt-data", arith_data["train"], "--rm-type",
                     "arithmetic", "--rollout-external", "--rollout-external-engine-addrs", srv.url,
                     "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4",
                     "--num-rollout", "1", "--quiet", "--device", "cpu", "--run-dir", str(tmp_path / "run")]) == 1
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("polyrl train: error:")]
    assert len(line) == 1, line
    assert f"{srv.url} refused it" in line[0], line
    assert re.search(r"model\.embed_tokens\.weight: shape \[(\d+), 64\] announced, the model's is \[(\d+), 64\]", line[0]), line
    assert "gone" not in line[0], line
