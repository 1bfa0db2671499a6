"""--max-turns and --rollout-max-context-len: what a custom generate function receives, what polyrl enforces (turn
limit, per-call context clamp, the cut of an over-budget sample), the plain rollout's cut, prompt filtering, the
calculator example's no-tool mode, and `polyrl eval` running the custom generate function."""

from __future__ import annotations

import json
import os

import pytest

from polyrl.assemble import prompt_dataset
from polyrl.cli import main
from polyrl.config import Config, ConfigError, validate
from polyrl.rollout.custom import TurnLimitError, generate_with
from polyrl.rollout.sampling import cut_to_budget, response_budget
from polyrl.step.rollout import engine_call
from polyrl.tasks.arithmetic import build_tokenizer
from polyrl.types import PromptRecord, Sample, SamplingParams

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "tool_calculator", "calculator.py")


class _Engine:
    """Answers every call with params.max_new_tokens tokens (id 7), so a test sees the budget each call got."""
    version, concurrent_update = 3, False

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (len(token_ids), max_new_tokens)

    def generate(self, prompts, params):
        self.calls += [(len(p), params.max_new_tokens) for p in prompts]
        return [Sample(list(p), [7] * params.max_new_tokens, [-0.1] * params.max_new_tokens, "length")
                for p in prompts for _ in range(params.n)]


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return ",".join(map(str, ids))


def _items(prompt_len: int = 3) -> list:
    return [(list(range(1, prompt_len + 1)), PromptRecord("p", label=0))]


def _run(fn, engine=None, **limits) -> list[Sample]:
    return generate_with(fn, "mod:fn", engine or _Engine(), _Tok(), _items(), SamplingParams(n=1, seed=0, max_new_tokens=10),
                         timeout=5, concurrency=2, **limits)


def test_budget_rule():
    assert response_budget(3, 10, None) == 10 and response_budget(3, 10, 8) == 5 and response_budget(9, 10, 8) == 0
    s = Sample([1, 2, 3], [4, 5, 6, 7], [-1.0, -2.0, -3.0, -4.0], "stop", loss_mask=[1, 0, 0, 1])
    assert not cut_to_budget(s, 4, 7) and s.finish_reason == "stop"  # 3 + 4 = 7 fits exactly
    assert cut_to_budget(s, 4, 5)
    assert (s.response_ids, s.rollout_logprobs, s.loss_mask, s.finish_reason) == ([4, 5], [-1.0, -2.0], [1, 0], "length")


def test_function_sees_limits_and_counts_turns():
    seen = {}

    async def fn(record, sp, engine, tok):  # two turns, as record.max_turns allows
        seen.update(max_turns=record.max_turns, ctx=record.max_context_len, budget=sp.max_new_tokens)
        (a,) = await engine.generate(record.prompt_ids, SamplingParams(max_new_tokens=1, seed=sp.seed))
        (b,) = await engine.generate(record.prompt_ids + a.response_ids, SamplingParams(max_new_tokens=2, seed=sp.seed))
        return Sample([], a.response_ids + b.response_ids, a.rollout_logprobs + b.rollout_logprobs, b.finish_reason)
    (s,) = _run(fn, max_turns=2, max_context_len=8)
    assert seen == {"max_turns": 2, "ctx": 8, "budget": 5}  # 8 - 3 prompt tokens < --rollout-max-response-len 10
    assert s.metadata["turns"] == 2 and s.response_ids == [7, 7, 7] and s.weight_version == 3


def test_a_call_past_max_turns_stops_with_the_function_and_flag_named():
    async def greedy_for_turns(record, sp, engine, tok):
        for _ in range(3):
            (s,) = await engine.generate(record.prompt_ids, SamplingParams(max_new_tokens=1))
        return s
    with pytest.raises(TurnLimitError, match=r"mod:fn \(prompt 0, sample 0\) made engine call 3, past --max-turns 2"):
        _run(greedy_for_turns, max_turns=2)
    assert _run(greedy_for_turns)[0].metadata["turns"] == 3  # no --max-turns: no limit


def test_engine_calls_are_clamped_to_the_context_budget_and_long_samples_cut():
    engine = _Engine()

    async def ignores_budget(record, sp, engine, tok):
        ids = list(record.prompt_ids)
        for _ in range(3):  # asks for 4 tokens a turn and never looks at the budget
            (s,) = await engine.generate(ids, SamplingParams(max_new_tokens=4))
            ids += s.response_ids + [9, 9]  # a tool answer of 2 tokens after each turn
        resp = ids[len(record.prompt_ids):]
        return Sample([], resp, [0.0] * len(resp), "stop", loss_mask=[1] * len(resp))
    (s,) = _run(ignores_budget, engine, max_context_len=12)
    # turn 1 continues 3 tokens: 4 fit (7 < 12); turn 2 continues 9: clamped to 3; turn 3 continues 14: no room, no call
    assert engine.calls == [(3, 4), (9, 3)]
    assert len(s.prompt_ids) + len(s.response_ids) == 12 and s.finish_reason == "length"
    assert len(s.loss_mask) == len(s.rollout_logprobs) == 9 and s.response == ",".join(["7"] * 4 + ["9"] * 2 + ["7"] * 3)
    assert s.metadata["turns"] == 3
    (s,) = _run(ignores_budget, _Engine())  # without a context budget only --rollout-max-response-len (10) cuts
    assert len(s.response_ids) == 10 and s.finish_reason == "length"


def test_plain_rollout_cuts_to_the_context_budget():
    class Eng(_Engine):
        tokenizer = _Tok()
    items = [([1, 2, 3], PromptRecord("a")), ([1, 2, 3, 4, 5, 6], PromptRecord("b"))]
    out = engine_call(Eng(), items, SamplingParams(max_new_tokens=4, n=1), max_context_len=8)
    assert [len(s.response_ids) for s in out] == [4, 2] and out[1].response == "7,7"
    assert out[1].finish_reason == "length" and len(out[1].rollout_logprobs) == 2


def _cfg(tiny_model, data, **rollout) -> Config:
    cfg = Config()
    cfg.model.hf_checkpoint, cfg.data.prompt_data, cfg.reward.rm_type = tiny_model, data, "arithmetic"
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    return cfg


def test_flag_checks_and_prompt_filter(tiny_model, arith_data):
    with pytest.raises(ConfigError, match="--max-turns 2 limits the turns of a --custom-generate-function-path"):
        validate(_cfg(tiny_model, arith_data["train"], max_turns=2), "train")
    cfg = _cfg(tiny_model, arith_data["train"], rollout_max_context_len=6)
    cfg.data.rollout_max_prompt_len = 6
    with pytest.raises(ConfigError, match=r"--rollout-max-prompt-len \(6\) must be < --rollout-max-context-len \(6\)"):
        validate(cfg, "train")
    with pytest.raises(ConfigError, match=r"--max-turns must be >= 1"):
        validate(_cfg(tiny_model, arith_data["train"], max_turns=0, custom_generate_function_path=f"{EXAMPLE}:generate"))
    # prompts are `ab+cd=` (6 tokens): a budget of 6 leaves no response token, so every prompt is dropped
    cfg = _cfg(tiny_model, arith_data["train"], rollout_max_context_len=7)
    assert len(prompt_dataset(cfg, build_tokenizer(), arith_data["train"], shuffle=False)) == 256
    cfg.rollout.rollout_max_context_len = 6
    with pytest.raises(ValueError, match="longer than --rollout-max-prompt-len=5"):
        prompt_dataset(cfg, build_tokenizer(), arith_data["train"], shuffle=False)


class _Scripted:
    """Writes turn k's text (one token per call step) on call k, stopping at a stop id or EOS like a real engine."""
    version, concurrent_update = 0, False

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.calls = tok, [tok.encode(t, add_special_tokens=False) for t in turns], 0

    def generate(self, prompts, params):
        out, stops = [], {*params.stop_token_ids, self.tok.eos_token_id}
        for p in prompts:
            ids = []
            for t in self.turns[self.calls][:params.max_new_tokens]:
                ids.append(t)
                if t in stops:
                    break
            out.append(Sample(list(p), ids, [-0.5] * len(ids), "stop" if ids and ids[-1] in stops else "length"))
        self.calls += 1
        return out


def _calculator():
    import importlib.util
    spec = importlib.util.spec_from_file_location("calculator", EXAMPLE)
    calc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calc)
    return calc


@pytest.mark.parametrize("max_turns", [None, 1])
def test_calculator_uses_the_tool_only_with_two_turns(max_turns):
    calc = _calculator()
    tok = build_tokenizer(extra_tokens=calc.TOOL_TOKENS, chat_template=calc.CHAT_TEMPLATE)
    items = [(tok.encode("12*34=", add_special_tokens=False), PromptRecord("12*34=", label="408"))]
    # turn 1 calls the calculator, turn 2 copies its answer
    engine = _Scripted(tok, ["<tool_call>12*34</tool_call><eos>", "408<eos>"])
    (s,) = generate_with(calc.generate, "calc", engine, tok, items, SamplingParams(n=1, seed=0, max_new_tokens=24),
                         timeout=5, concurrency=1, max_turns=max_turns)
    if max_turns == 1:  # no tool: the call is the answer, and a wrong one
        assert s.metadata["turns"] == 1 and s.metadata["tool_calls"] == 0 and all(s.loss_mask)
        assert s.metadata["answer"] == "<tool_call>12*34</tool_call>" and calc.reward(s) == 0.0
    else:
        assert s.metadata["turns"] == 2 and s.metadata["tool_result"] == "408" and s.metadata["answer"] == "408"
        # <tool_call> 1 2 * 3 4 </tool_call> <eos> | <tool_response> 4 0 8 </tool_response> | 4 0 8 <eos>
        assert s.loss_mask == [1] * 8 + [0] * 5 + [1] * 4 and calc.reward(s) == 1.0
        assert calc.text(tok, s.response_ids) == "<tool_call>12*34</tool_call><tool_response>408</tool_response>408"
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m == 0)


def test_calculator_tool_turn_is_what_the_sft_traces_hold():
    """The tokens generate() appends for the tool are the chat template's own for that turn, so RL rollouts and the
    SFT conversations (rendered by polyrl.data.build_conversation_example) agree token for token."""
    from polyrl.data import build_conversation_example
    calc = _calculator()
    tok = build_tokenizer(extra_tokens=calc.TOOL_TOKENS, chat_template=calc.CHAT_TEMPLATE)
    chat = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "<tool_call>12*34</tool_call>"},
            {"role": "tool", "content": "408"}, {"role": "assistant", "content": "408"}]
    ids, mask = build_conversation_example(tok, chat)
    tool = calc.tool_turn(tok, "12*34=", "<tool_call>12*34</tool_call>", "408")
    assert ids[14:19] == tool and mask[14:19] == [0] * 5  # after the 6 prompt and 8 call tokens
    assert calc.CALL.fullmatch("<tool_call>12*34</tool_call>") and not calc.CALL.fullmatch("<tool_call>12*</tool_call>")


def test_eval_runs_the_custom_generate_function(tiny_model, arith_data, tmp_path, capsys):
    fn = tmp_path / "two_turns.py"
    fn.write_text("from polyrl.types import Sample\n"
                  "async def generate(record, sp, engine, tok):\n"
                  "    (a,) = await engine.generate(record.prompt_ids, sp)\n"
                  "    (b,) = await engine.generate(record.prompt_ids + a.response_ids, sp)\n"
                  "    ids = (a.response_ids + b.response_ids)\n"
                  "    return Sample([], ids, a.rollout_logprobs + b.rollout_logprobs, b.finish_reason)\n")
    common = ["eval", "--hf-checkpoint", tiny_model, "--eval-prompt-data", arith_data["eval"], "--rm-type", "arithmetic",
              "--rollout-max-response-len", "4", "--device", "cpu", "--quiet", "--run-dir", str(tmp_path)]
    assert main([*common, "--custom-generate-function-path", f"{fn}:generate", "--rollout-max-context-len", "9"]) == 0
    ev = json.load(open(tmp_path / "eval.json"))
    # prompts have 6 tokens: a context of 9 leaves 3 response tokens over both turns
    assert ev["eval/turns"] == 2.0 and ev["eval/n"] == 32 and ev["eval/response_len"] <= 3
    assert main([*common, "--custom-generate-function-path", f"{fn}:generate", "--max-turns", "1"]) == 1
    assert f"{fn}:generate (prompt 0, sample 0) made engine call 2, past --max-turns 1" in capsys.readouterr().err
