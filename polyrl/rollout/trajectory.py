"""Token-in / token-out records of agent trajectories: what the OpenAI-compatible gateway rendered and sampled, turned
into training samples without re-tokenizing any completion (docs/agents.md).

A trajectory is a run of chat calls under one id. Each call's prompt is built here:
- when the call's messages are the previous call's messages, then the assistant message the gateway returned (same
  role, text and tool calls; ids and surrounding whitespace aside), then new messages (tool results, user turns), the
  prompt is the previous prompt + the sampled completion ids + the template's tokens for the new messages (the
  difference between two renderings of the chat template: what it writes after an assistant turn's end);
- otherwise the messages are rendered afresh, and when those token ids still start with the previous prompt +
  completion (a token-level prefix check), the call continues the same sample;
- otherwise the agent rewrote its history (a summary, dropped turns, an edited message): a new segment starts, and
  the trajectory becomes one sample per segment.
A segment's response holds every token after its first prompt: the model's (loss mask 1, their sampled log-probs)
and the template's, the tools' and the users' (loss mask 0, log-prob 0.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polyrl.rollout.openai_api import APIError, Completion, encode, message_key, render
from polyrl.types import Sample

# a stand-in conversation before new messages: renders what a template writes after an assistant turn when the real
# history does not render as a prefix of itself (templates that restyle earlier turns, e.g. Qwen3's reasoning)
_STAND_IN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


@dataclass
class Segment:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    weight_version: int | None = None
    turns: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_sample(self) -> Sample:
        return Sample(list(self.prompt_ids), list(self.response_ids), list(self.logprobs), self.finish_reason,
                      loss_mask=list(self.loss_mask), weight_version=self.weight_version)


@dataclass
class Trajectory:
    """One agent run's record. `max_response` / `max_context`: a segment's response budget and its context budget
    (--rollout-max-response-len / --rollout-max-context-len); `max_calls`: --max-turns."""

    max_response: int | None = None
    max_context: int | None = None
    max_calls: int | None = None
    sampling: Any = None  # how its calls sample (polyrl.rollout.gateway.TrajectorySettings; None: the gateway's own)
    segments: list[Segment] = field(default_factory=list)
    calls: int = 0
    rewrites: int = 0  # calls that started a new segment after the first (the agent rewrote its history)
    _messages: list[dict] | None = None  # the last call's messages and tools, and the reply the gateway returned
    _tools: list | None = None
    _reply: dict | None = None
    _eot: str | None = None  # the text of the stop token that ended the last completion (None: no stop token did)

    def plan(self, tokenizer, messages: list[dict], tools: list | None, eot_text: str) -> tuple[list[int], int]:
        """(prompt ids, how many of them are already in the current segment) for a chat call; starts a new segment
        when the history does not continue the last one. `eot_text`: the end-of-turn text the template writes after an
        assistant turn (the EOS token's) when the completion did not end with a stop token of its own."""
        if self.max_calls is not None and self.calls >= self.max_calls:
            raise APIError(f"this trajectory made {self.calls} calls, the most --max-turns allows", status=400,
                           code="max_turns")
        seg = self.segments[-1] if self.segments else None
        if seg is not None:
            extra = self._spliced(tokenizer, messages, tools, eot_text)
            if extra is not None:
                return seg.ids + extra, len(seg.ids)
        ids = encode(tokenizer, render(tokenizer, messages, tools, generation_prompt=True))
        return self.plan_ids(ids)

    def plan_ids(self, ids: list[int]) -> tuple[list[int], int]:
        """The token-level prefix check: a prompt that starts with the current segment's tokens continues it."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and len(ids) > len(seg.ids) and ids[:len(seg.ids)] == seg.ids:
            return ids, len(seg.ids)
        return ids, 0

    def _spliced(self, tokenizer, messages: list[dict], tools: list | None, eot_text: str) -> list[int] | None:
        """The tokens after the sampled completion when `messages` continue the last call, else None."""
        prev, k = self._messages, len(self._messages or ())
        if prev is None or tools != self._tools or len(messages) <= k:
            return None
        if [message_key(m) for m in messages[:k]] != [message_key(m) for m in prev]:
            return None
        if message_key(messages[k]) != message_key(self._reply):
            return None
        new = messages[k + 1:]
        for base in (messages[:k + 1], _STAND_IN):
            hist = render(tokenizer, base, tools, generation_prompt=False)
            full = render(tokenizer, [*base, *new], tools, generation_prompt=True) if new else None
            if full is not None and not full.startswith(hist):
                continue
            eot = self._eot or eot_text
            pos = hist.rfind(eot) if eot else -1
            if pos < 0:
                continue
            after = hist[pos + len(eot):] + (full[len(hist):] if full is not None else "")
            # a completion cut by its budget or a stop string gets the end-of-turn token the template writes
            return encode(tokenizer, (eot if self._eot is None else "") + after)
        return None

    def room(self, prompt_len: int, kept: int) -> int | None:
        """Most new tokens this call may sample (None: no budget): what the segment's response budget and context
        budget leave."""
        budgets = []
        if self.max_response is not None:
            first = self.segments[-1].prompt_ids if kept else None
            used = prompt_len - (len(first) if first is not None else prompt_len)
            budgets.append(self.max_response - used)
        if self.max_context is not None:
            budgets.append(self.max_context - prompt_len)
        return max(0, min(budgets)) if budgets else None

    def record(self, prompt_ids: list[int], kept: int, c: Completion, *, messages: list[dict] | None = None,
               tools: list | None = None, reply: dict | None = None, eot: str | None = None) -> None:
        """Append one call: the prompt's tokens past `kept` (not the model's: mask 0) and the completion (mask 1)."""
        self.calls += 1
        if not kept:
            if self.segments:
                self.rewrites += 1
            self.segments.append(Segment(list(prompt_ids), weight_version=c.weight_version))
            extra = []
        else:
            extra = prompt_ids[kept:]
        seg = self.segments[-1]
        seg.response_ids += extra + list(c.ids)
        seg.loss_mask += [0] * len(extra) + [1] * len(c.ids)
        seg.logprobs += [0.0] * len(extra) + list(c.logprobs)
        seg.finish_reason = "length" if c.finish == "length" else "stop"
        seg.turns += 1
        self._messages, self._tools, self._reply, self._eot = messages, tools, reply, eot

    def samples(self) -> list[Sample]:
        return [s.to_sample() for s in self.segments]
