"""--custom-generate-function-path: a 2-step CPU run with a tool turn (masked tool tokens reach the trainer), the loss over a masked batch equals the loss over its model tokens, and the flag's checks."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import torch

from polyrl.algorithms.losses import LossSettings, rl_loss
from polyrl.cli import main
from polyrl.rollout.custom import generate_with
from polyrl.types import PromptRecord, Sample, SamplingParams

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "tool_calculator", "calculator.py")
RECORDER = '''
import json, os
def record(sample):
    with open(os.environ["POLYRL_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps({"prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids,
                            "loss_mask": sample.loss_mask, "logprobs": sample.rollout_logprobs, "group": sample.group_index,
                            "label": sample.label, "version": sample.weight_version, "meta": sample.metadata}) + "\\n")
    return float(len(sample.response_ids) % 2)
'''
# a tool turn after every model turn: the model writes up to 3 tokens, the tool answers `99` (masked), the model goes on
TWO_TURNS = '''
import dataclasses
from polyrl.types import Sample
async def generate(record, sp, engine, tok):
    (a,) = await engine.generate(record.prompt_ids, dataclasses.replace(sp, max_new_tokens=3))
    tool = tok.encode("99", add_special_tokens=False)
    ids = a.response_ids + tool
    (b,) = await engine.generate(record.prompt_ids + ids, dataclasses.replace(sp, max_new_tokens=sp.max_new_tokens - len(ids)))
    return Sample([], ids + b.response_ids, a.rollout_logprobs + [0.0] * 2 + b.rollout_logprobs, b.finish_reason,
                  loss_mask=[1] * len(a.response_ids) + [0, 0] + [1] * len(b.response_ids), metadata={"first": len(a.response_ids)})
'''


def _args(tiny_model, arith_data, tmp_path, *extra: str) -> list[str]:
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--num-rollout", "2", "--quiet", "--seed", "1",
            "--device", "cpu", "--run-dir", str(tmp_path / "run"), *extra]


def test_train_with_a_tool_turn_masks_tool_tokens(tiny_model, arith_data, tmp_path, monkeypatch):
    """The masks and logprobs a custom generate function returns reach the trainer through `polyrl train` (the
    calculator example's own run: tests/test_tool_calculator.py)."""
    from polyrl.tasks.arithmetic import build_tokenizer
    rm, fn = tmp_path / "rm.py", tmp_path / "two_turns.py"
    rm.write_text(RECORDER)
    fn.write_text(TWO_TURNS)
    out = tmp_path / "samples.jsonl"
    monkeypatch.setenv("POLYRL_TEST_SAMPLES", str(out))
    assert main(_args(tiny_model, arith_data, tmp_path, "--custom-generate-function-path", f"{fn}:generate",
                      "--custom-rm-path", f"{rm}:record", "--rollout-temperature", "1.5")) == 0
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 2 * 2 * 4
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all("pg_loss" in m for m in metrics)
    nines = build_tokenizer().encode("99", add_special_tokens=False)
    for r in rows:  # model tokens, the tool's `99` (mask 0, logprob 0.0), model tokens
        n, k = len(r["response_ids"]), r["meta"]["first"]
        assert len(r["loss_mask"]) == n == len(r["logprobs"]) and r["meta"]["turns"] == 2
        assert r["loss_mask"] == [1] * k + [0, 0] + [1] * (n - k - 2) and r["response_ids"][k:k + 2] == nines
        assert r["logprobs"][k:k + 2] == [0.0, 0.0] and all(lp < 0 for lp in r["logprobs"][:k])
        assert r["version"] in (0, 1) and r["label"] is not None
    assert {r["version"] for r in rows[8:]} == {1}  # step 2 rolls out with the weights step 1 trained
    for step in (rows[:8], rows[8:]):  # groups of 4 per prompt, in order
        assert [r["group"] for r in step] == [0] * 4 + [1] * 4


def _mb(mask: list[float]) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(0)
    T = len(mask)
    logp = (-torch.rand(T, generator=g) * 2).requires_grad_()
    mb = {"loss_mask": torch.tensor(mask), "seq_ids": torch.tensor([0, 0, 0, 0, 1, 1, 1][:T]),
          "advantages": torch.randn(T, generator=g), "old_logprobs": logp.detach() - 0.1 * torch.randn(T, generator=g),
          "ref_logprobs": logp.detach() - 0.2 * torch.rand(T, generator=g), "rollout_logprobs": logp.detach() - 0.05}
    return logp, mb


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("gspo", [False, True])
def test_masked_loss_equals_loss_over_model_tokens(agg, gspo):
    mask = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]  # tool tokens at 2 and 4
    s = LossSettings(loss_agg_mode=agg, sequence_ratio=gspo, use_kl_loss=True, kl_loss_coef=0.3, entropy_coef=0.01,
                     use_tis=True)
    logp, mb = _mb(mask)
    ent = torch.rand(len(mask), generator=torch.Generator().manual_seed(1))
    loss, m = rl_loss(logp, ent, mb, s, num_tokens=5.0, num_seqs=2.0)
    loss.backward()
    keep = torch.tensor(mask).bool()
    logp2 = logp.detach()[keep].clone().requires_grad_()
    mb2 = {k: v[keep] for k, v in mb.items()}
    mb2["loss_mask"] = torch.ones(5)
    loss2, m2 = rl_loss(logp2, ent[keep], mb2, s, num_tokens=5.0, num_seqs=2.0)
    loss2.backward()
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(logp.grad[keep], logp2.grad)
    assert logp.grad[~keep].abs().max() == 0  # a tool token gets no gradient
    for k in m2:
        torch.testing.assert_close(m[k], m2[k])


def test_flag_errors(tiny_model, arith_data, tmp_path, capsys):
    bad = tmp_path / "gen.py"
    bad.write_text("def generate(record, sampling_params, engine, tokenizer):\n    return None\n")
    cases = [
        (["--custom-generate-function-path", str(tmp_path / "missing.py:generate")], "no file"),
        (["--custom-generate-function-path", f"{EXAMPLE}:nope"], "has no function 'nope'"),
        (["--custom-generate-function-path", f"{bad}:generate"], "not an `async def`"),
        (["--custom-generate-function-path", f"{EXAMPLE}:generate", "--debug-train-only", "--load-debug-rollout-data",
          str(tmp_path / "r_{rollout_id}.jsonl")], "--debug-train-only"),
    ]
    for extra, msg in cases:
        assert main(_args(tiny_model, arith_data, tmp_path, "--rm-type", "arithmetic", *extra)) == 2
        err = capsys.readouterr().err
        assert "--custom-generate-function-path" in err and msg in err, err


class _Engine:
    """One token per call (the seed), so tests see which seed each call used."""
    version, concurrent_update = 7, False

    def generate(self, prompts, params):
        return [Sample(list(p), [params.seed % 100], [-0.5], "stop") for p in prompts for _ in range(params.n)]


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return ",".join(map(str, ids))


def _items(n: int = 2) -> list:
    return [([1, 2, i], PromptRecord(f"p{i}", label=i, metadata={"k": i})) for i in range(n)]


def test_generate_with_sets_fields_and_distinct_seeds():
    async def fn(record, sp, engine, tok):
        (s,) = await engine.generate(record.prompt_ids, sp)
        s.metadata = {"j": record.sample_index}
        return s
    out = generate_with(fn, "t:fn", _Engine(), _Tok(), _items(), SamplingParams(n=3, seed=5), timeout=5, concurrency=2)
    assert [s.group_index for s in out] == [0, 0, 0, 1, 1, 1]
    assert [s.label for s in out] == [0, 0, 0, 1, 1, 1] and out[4].prompt == "p1"
    assert out[4].metadata == {"k": 1, "j": 1, "turns": 1} and out[0].response == str(out[0].response_ids[0])
    assert out[4].metadata == {"k": 1, "j": 1, "turns": 1} and all(s.weight_version == 7 and s.loss_mask == [1] for s in out)
    seeds = [s.response_ids[0] for s in out]
    again = generate_with(fn, "t:fn", _Engine(), _Tok(), _items(), SamplingParams(n=3, seed=5), timeout=5, concurrency=2)
    assert seeds == [s.response_ids[0] for s in again]  # reproducible
    other = generate_with(fn, "t:fn", _Engine(), _Tok(), _items(), SamplingParams(n=3, seed=6), timeout=5, concurrency=2)
    assert seeds != [s.response_ids[0] for s in other]  # another step draws other seeds


def test_generate_with_timeout_and_bad_samples_name_the_function():
    async def stuck(record, sp, engine, tok):
        await asyncio.sleep(60)
    with pytest.raises(TimeoutError, match=r"--custom-generate-function-path mod:stuck did not return within"):
        generate_with(stuck, "mod:stuck", _Engine(), _Tok(), _items(), SamplingParams(n=2, seed=0), timeout=0.2, concurrency=4)

    async def short_mask(record, sp, engine, tok):
        return Sample(record.prompt_ids, [3, 4], [0.0, 0.0], "stop", loss_mask=[1])
    with pytest.raises(ValueError, match="2 response tokens but 1 loss_mask"):
        generate_with(short_mask, "mod:f", _Engine(), _Tok(), _items(), SamplingParams(n=1, seed=0), timeout=5, concurrency=4)


def test_a_hung_engine_call_times_out_without_waiting_for_it():
    class Hung(_Engine):
        def generate(self, prompts, params):
            time.sleep(3)
            return super().generate(prompts, params)

    async def fn(record, sp, engine, tok):
        return (await engine.generate(record.prompt_ids, sp))[0]
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="mod:fn did not return within --rollout-request-timeout 0.2 s"):
        generate_with(fn, "mod:fn", Hung(), _Tok(), _items(), SamplingParams(n=1, seed=0), timeout=0.2, concurrency=4)
    assert time.perf_counter() - t0 < 2


def test_train_stops_with_an_error_naming_a_stuck_function(tiny_model, arith_data, tmp_path, capsys):
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import asyncio\nasync def generate(record, sampling_params, engine, tokenizer):\n"
                     "    await asyncio.sleep(60)\n")
    assert main(_args(tiny_model, arith_data, tmp_path, "--rm-type", "arithmetic", "--rollout-request-timeout", "0.3",
                      "--custom-generate-function-path", f"{stuck}:generate")) == 1
    assert f"--custom-generate-function-path {stuck}:generate did not return within" in capsys.readouterr().err


def test_calls_of_one_step_must_return_as_many_samples():
    async def uneven(record, sp, engine, tok):
        s = (await engine.generate(record.prompt_ids, sp))[0]
        return [s] if record.sample_index == 0 else [s, Sample(record.prompt_ids, [5], [0.0], "stop")]
    with pytest.raises(ValueError, match=r"returned \[1, 2\] samples from different calls"):
        generate_with(uneven, "mod:f", _Engine(), _Tok(), _items(), SamplingParams(n=2, seed=0), timeout=5, concurrency=4)
