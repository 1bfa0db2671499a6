"""A tool-using agent written with the `openai` SDK, as polyrl's --agent-function-path trains it, and its reward.

The agent is ordinary function calling: it offers a `calculator` tool, sends the chat to the model, runs every tool
call the model makes and sends the results back, until the model answers without a call (at most MAX_CALLS chat
calls). It knows nothing of polyrl beyond the client configuration it is handed; pointed at any OpenAI-compatible
endpoint it runs the same way. It returns the final messages, and `reward` (--custom-rm-path) scores the model's last
answer: 1 when it is the product.

The model is tiny (recipe.py): it writes a call as Qwen's templates do, `<tool_call>{"name": "calculator",
"arguments": {"expression": "481*773"}}</tool_call>`, which the gateway returns as an OpenAI tool call.
"""

from __future__ import annotations

import json
import re

from openai import AsyncOpenAI

MAX_CALLS = 3
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate A*B or A+B for integers A and B.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
EXPRESSION = re.compile(r"\s*(\d+)\s*([*+])\s*(\d+)\s*")


def calculator(expression: str) -> str:
    m = EXPRESSION.fullmatch(expression)
    if m is None:
        return "error: expected A*B or A+B"
    a, op, b = m.groups()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


async def agent(task, client) -> list[dict]:
    messages = list(task.messages)
    async with AsyncOpenAI(**client.openai_kwargs(), max_retries=0) as openai:
        for _ in range(MAX_CALLS):
            r = await openai.chat.completions.create(model=client.model, messages=messages, tools=TOOLS)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                try:
                    result = calculator(**json.loads(call.function.arguments))
                except (TypeError, ValueError):
                    result = "error: bad arguments"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def reward(sample) -> float:
    """1.0 when the model's final answer (the last assistant message: sample.response) is the product."""
    return 1.0 if sample.response.strip() == str(sample.label).strip() else 0.0
