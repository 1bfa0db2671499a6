"""A calculator tool for the arithmetic task (polyrl/tasks/arithmetic.py), as a --custom-generate-function-path.

Turn 1: the model writes until it emits `=` (a calculator call: the text before it, e.g. `47+38=`, is the
expression), its end of sequence, or the length limit. On `=` the tool appends the value of the expression
(digits separated by `+`; an empty operand counts as 0) as tool tokens, masked out of the loss, and the model
writes turn 2 (the answer) after them. The reward (`reward` below) checks the model's final turn against the sum.
With --max-turns 1 there is no second turn, so no calculator: the model answers in one turn (the no-tool baseline).
The response budget (`sampling_params.max_new_tokens`: --rollout-max-response-len, lowered by polyrl to what
--rollout-max-context-len leaves after the prompt) covers both turns and the tool's digits.
"""

from __future__ import annotations

import dataclasses

from polyrl.rollout.sampling import mix_seed
from polyrl.types import Sample

CALL = "="  # one token of the character tokenizer


def text(tokenizer, ids: list[int]) -> str:
    """The characters of `ids` (this tokenizer's decode puts a space between tokens; the task has no spaces)."""
    return tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "")


def calculate(expression: str) -> str:
    """The tool: the sum of the `+`-separated digit runs of `expression` (an empty one is 0)."""
    return str(sum(int(x) if x.isdigit() else 0 for x in expression.split("+")))


async def generate(record, sampling_params, engine, tokenizer) -> Sample:
    budget = sampling_params.max_new_tokens
    call_id = tokenizer.convert_tokens_to_ids(CALL)
    tool = record.max_turns is None or record.max_turns >= 2  # the answer after a tool result is a second turn
    first = dataclasses.replace(sampling_params, stop_token_ids=[*sampling_params.stop_token_ids, call_id]) if tool \
        else sampling_params
    (t1,) = await engine.generate(record.prompt_ids, first)
    ids, logprobs, mask = list(t1.response_ids), list(t1.rollout_logprobs), [1] * len(t1.response_ids)
    if not (tool and ids and ids[-1] == call_id):  # no calculator call: one turn
        return Sample(record.prompt_ids, ids, logprobs, t1.finish_reason, metadata={"tool_calls": 0, "answer": text(tokenizer, ids)})
    result = tokenizer.encode(calculate(text(tokenizer, ids[:-1])), add_special_tokens=False)
    result = result[:budget - len(ids)]  # the response never passes --rollout-max-response-len
    ids, logprobs, mask = ids + result, logprobs + [0.0] * len(result), mask + [0] * len(result)
    meta = {"tool_calls": 1, "tool_result": text(tokenizer, result), "answer": ""}
    if len(ids) >= budget:
        return Sample(record.prompt_ids, ids, logprobs, "length", loss_mask=mask, metadata=meta)
    second = dataclasses.replace(sampling_params, max_new_tokens=budget - len(ids), seed=mix_seed(sampling_params.seed, 1))
    (t2,) = await engine.generate(record.prompt_ids + ids, second)
    meta["answer"] = text(tokenizer, t2.response_ids)
    return Sample(record.prompt_ids, ids + t2.response_ids, logprobs + t2.rollout_logprobs, t2.finish_reason,
                  loss_mask=mask + [1] * len(t2.response_ids), metadata=meta)


def reward(sample: Sample) -> float:
    """1.0 when the model's final turn is exactly the sum (a tool result alone earns nothing)."""
    return 1.0 if sample.metadata.get("answer") == str(sample.label).strip() else 0.0
