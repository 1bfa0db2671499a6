"""A calculator tool for multi-digit multiplication, as a --custom-generate-function-path (and its reward).

The model's vocabulary is the arithmetic task's characters plus `*` and four tags (TOOL_TOKENS), and its chat
template (CHAT_TEMPLATE) writes each message's content, an assistant turn closed by `<eos>`, a tool turn wrapped in
`<tool_response>...</tool_response>`. A solved problem, as the SFT traces (recipe.py) spell it:

    user       123*456=
    assistant  <tool_call>123*456</tool_call><eos>
    tool       <tool_response>56088</tool_response>
    assistant  56088<eos>

`generate` plays it out: turn 1 is the model's, up to its end of turn; if that turn is exactly one call
`<tool_call>A*B</tool_call>` (or `A+B`), Python computes it and the tool turn's tokens (what the chat template writes
for it) follow with `loss_mask` 0 and rollout logprob 0.0, then the model writes turn 2, its answer. `reward` scores
1 when the model's final turn is the label: the tool's digits alone earn nothing, the model must copy them.
With --max-turns 1 the run has no tool: the first turn is the answer (the no-tool baseline of recipe.py).
The response budget (`sampling_params.max_new_tokens`) covers both turns and the tool's tokens.
"""

from __future__ import annotations

import dataclasses
import re

from polyrl.rollout.sampling import mix_seed
from polyrl.types import Sample

TOOL_TOKENS = ("*", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
                 "{% else %}{{ m['content'] }}{% endif %}{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}")
CALL = re.compile(r"<tool_call>(\d+)([*+])(\d+)</tool_call>")


def text(tokenizer, ids: list[int]) -> str:
    """The text of `ids` without special tokens (this tokenizer's decode puts a space between tokens; the task has
    no spaces)."""
    return tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "")


def calculate(a: str, op: str, b: str) -> str:
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


def tool_turn(tokenizer, prompt: str, call: str, result: str) -> list[int]:
    """The tokens the chat template writes for the tool's message after the assistant turn `call` (and the
    generation prompt of the turn after it): the difference between the two renderings, so the rollout sees what
    the SFT traces had there."""
    chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": call}]
    before = tokenizer.apply_chat_template(chat, tokenize=False)
    after = tokenizer.apply_chat_template([*chat, {"role": "tool", "content": result}], tokenize=False,
                                          add_generation_prompt=True)
    return tokenizer.encode(after[len(before):], add_special_tokens=False)


async def generate(record, sampling_params, engine, tokenizer) -> Sample:
    budget = sampling_params.max_new_tokens
    (t1,) = await engine.generate(record.prompt_ids, sampling_params)
    ids, logprobs, turn = list(t1.response_ids), list(t1.rollout_logprobs), text(tokenizer, t1.response_ids)
    call = CALL.fullmatch(turn) if t1.finish_reason == "stop" else None
    tool = record.max_turns is None or record.max_turns >= 2  # the answer after a tool result is a second turn
    if not (tool and call):  # no (well-formed) call, or no tool in this run: turn 1 is the answer
        return Sample(record.prompt_ids, ids, logprobs, t1.finish_reason, metadata={"tool_calls": 0, "answer": turn})
    result = calculate(*call.groups())
    tool_ids = tool_turn(tokenizer, str(record.prompt), turn, result)[:budget - len(ids)]  # within the budget
    mask = [1] * len(ids) + [0] * len(tool_ids)
    ids, logprobs = ids + tool_ids, logprobs + [0.0] * len(tool_ids)
    meta = {"tool_calls": 1, "tool_result": result, "answer": ""}
    if len(ids) >= budget:
        return Sample(record.prompt_ids, ids, logprobs, "length", loss_mask=mask, metadata=meta)
    second = dataclasses.replace(sampling_params, max_new_tokens=budget - len(ids), seed=mix_seed(sampling_params.seed, 1))
    (t2,) = await engine.generate(record.prompt_ids + ids, second)
    meta["answer"] = text(tokenizer, t2.response_ids)
    return Sample(record.prompt_ids, ids + t2.response_ids, logprobs + t2.rollout_logprobs, t2.finish_reason,
                  loss_mask=mask + [1] * len(t2.response_ids), metadata=meta)


def reward(sample: Sample) -> float:
    """1.0 when the model's final turn is exactly the label (a tool result alone earns nothing)."""
    return 1.0 if sample.metadata.get("answer") == str(sample.label).strip() else 0.0
