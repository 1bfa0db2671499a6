"""The OpenAI API's payloads (Chat Completions, Completions, Models), as polyrl's OpenAI-compatible routes parse and
answer them: request checking, chat rendering with the model's own chat template, tool-call parsing and response
building. No HTTP here (polyrl/rollout/gateway.py serves it), no engine (a backend's `complete` generates).

What the engine cannot do is refused with a 400 naming the field, never ignored: `top_logprobs` > 0 on an engine that
reports the sampled token's log-prob only (the GPU engine), penalties and `logit_bias`, `tool_choice` "required" or a named function (no
constrained decoding), `response_format` other than text, non-text content parts, `echo`, `suffix`, `best_of` > 1.
Fields that change nothing the model does (`user`, `metadata`, `store`, `parallel_tool_calls`, `service_tier`,
`model`: every name is served by the one model) are accepted.

Tool calls are parsed in the format of Qwen2.5 / Qwen3 (and Hermes-style) templates: `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks, any number, the text around them being the message's content. A block that is
not a JSON object with a string `name` and object `arguments`, names a tool the request did not offer, or is left
unclosed makes the whole completion plain text with finish_reason "stop". Other families' formats (Llama 3.1's bare
JSON, Mistral's [TOOL_CALLS]) are not parsed: their calls come back as text.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ROLES = ("system", "developer", "user", "assistant", "tool")
# fields that change nothing the engine does: accepted whatever their value
INERT = frozenset({"model", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "stream_options"})
# fields the engine cannot honour: accepted only at these values (OpenAI's defaults)
UNSUPPORTED = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "prediction": None, "audio": None,
               "modalities": None, "reasoning_effort": None, "web_search_options": None, "functions": None,
               "function_call": None}
CHAT_FIELDS = frozenset({"messages", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
                         "max_completion_tokens", "stop", "seed", "logprobs", "top_logprobs", "stream",
                         "response_format"})
COMPLETION_FIELDS = frozenset({"prompt", "n", "temperature", "top_p", "max_tokens", "stop", "seed", "logprobs",
                               "stream", "echo", "suffix", "best_of"})
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """A request the routes refuse: HTTP status and OpenAI's error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get(body: dict, key: str, ok, what: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not ok(v):
        raise APIError(f"'{key}' must be {what}, got {json.dumps(v)[:80]}", param=key)
    return v


@dataclass
class Request:
    """What either API asks of the engine, checked."""

    n: int = 1
    temperature: float | None = None  # None: the served default (1.0)
    top_p: float | None = None
    max_tokens: int | None = None  # None: what the context leaves (chat) / 16 (completions)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # per token, this many most likely alternatives (chat's top_logprobs, completions' logprobs)
    stream: bool = False
    include_usage: bool = False
    # chat only
    messages: list[dict] = field(default_factory=list)  # normalized (normalize_messages)
    tools: list[dict] | None = None  # None: no tools offered (or tool_choice "none")
    # completions only: one or more prompts, each text or token ids
    prompts: list[str | list[int]] = field(default_factory=list)


def _check_fields(body: dict, known: frozenset) -> None:
    for k, v in body.items():
        if k in UNSUPPORTED:
            if v is not None and v != UNSUPPORTED[k]:
                raise APIError(f"'{k}' is not supported by this server (only {json.dumps(UNSUPPORTED[k])})", param=k)
        elif k not in known and k not in INERT:
            raise APIError(f"unknown field '{k}'", param=k)


def _common(body: dict, max_n: int) -> Request:
    r = Request()
    r.n = _get(body, "n", lambda v: _int(v) and 1 <= v <= max_n, f"an integer in [1, {max_n}]", 1)
    r.temperature = _get(body, "temperature", lambda v: _num(v) and 0 <= v <= 2, "a number in [0, 2]")
    r.top_p = _get(body, "top_p", lambda v: _num(v) and 0 < v <= 1, "a number in (0, 1]")
    stop = _get(body, "stop", lambda v: isinstance(v, str) or (isinstance(v, list) and len(v) <= 4 and all(
        isinstance(s, str) for s in v)), "a string or a list of at most 4 strings", [])
    r.stop = [s for s in ([stop] if isinstance(stop, str) else stop) if s]
    r.seed = _get(body, "seed", lambda v: _int(v) and -2**63 <= v < 2**63, "a 64-bit integer")
    if r.seed is not None:
        r.seed %= 2**62
    r.stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    r.include_usage = bool(opts.get("include_usage", False))
    return r


def parse_chat(body: dict, max_n: int) -> Request:
    """A /v1/chat/completions body, checked (APIError on anything wrong)."""
    _check_fields(body, CHAT_FIELDS)
    r = _common(body, max_n)
    mt = _get(body, "max_completion_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1")
    r.max_tokens = mt if mt is not None else _get(body, "max_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1")
    r.logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    r.top_logprobs = _get(body, "top_logprobs", lambda v: _int(v) and 0 <= v <= 20, "an integer in [0, 20]", 0)
    if r.top_logprobs and not r.logprobs:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    fmt = _get(body, "response_format", lambda v: isinstance(v, dict), "an object")
    if fmt is not None and fmt.get("type") != "text":
        raise APIError("'response_format' other than {\"type\": \"text\"} is not supported (no constrained decoding)",
                       param="response_format")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list of message objects", param="messages")
    r.messages = normalize_messages(msgs)
    tools = _get(body, "tools", lambda v: isinstance(v, list), "a list of tool objects")
    if tools:
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(f, dict)
                    and isinstance(f.get("name"), str) and f["name"]):
                raise APIError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"parameters\": {...}}}}", param="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise APIError("'tool_choice' must be \"auto\" or \"none\": \"required\" and named functions need constrained "
                       "decoding, which this server lacks", param="tool_choice")
    r.tools = tools or None if choice != "none" else None
    return r


def parse_completion(body: dict, max_n: int, vocab_size: int) -> Request:
    """A /v1/completions body, checked."""
    _check_fields(body, COMPLETION_FIELDS)
    r = _common(body, max_n)
    r.max_tokens = _get(body, "max_tokens", lambda v: _int(v) and v >= 1, "an integer >= 1", COMPLETIONS_DEFAULT_MAX_TOKENS)
    lp = _get(body, "logprobs", lambda v: _int(v) and 0 <= v <= 5, "an integer in [0, 5]")
    r.logprobs, r.top_logprobs = lp is not None, lp or 0
    for k, ok in (("echo", False), ("suffix", None), ("best_of", 1)):
        if body.get(k) not in (None, ok):
            raise APIError(f"'{k}' is not supported (only {json.dumps(ok)})", param=k)
    p = body.get("prompt")
    ids_list = isinstance(p, list) and p and all(_int(x) for x in p)
    if isinstance(p, str) and p:
        r.prompts = [p]
    elif ids_list:
        r.prompts = [p]
    elif isinstance(p, list) and p and (all(isinstance(x, str) and x for x in p)
                                        or all(isinstance(x, list) and x and all(_int(t) for t in x) for x in p)):
        r.prompts = list(p)
    else:
        raise APIError("'prompt' must be a non-empty string, a list of token ids, or a non-empty list of either",
                       param="prompt")
    for x in r.prompts:
        if isinstance(x, list) and (min(x) < 0 or max(x) >= vocab_size):
            raise APIError(f"'prompt' has token ids outside [0, {vocab_size})", param="prompt")
    return r


# ---- messages and the chat template ---------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for c in content:
            if not (isinstance(c, dict) and c.get("type") in ("text", "input_text", "output_text")
                    and isinstance(c.get("text"), str)):
                raise APIError(f"{where}: only text content parts are supported", param="messages")
            parts.append(c["text"])
        return "".join(parts)
    raise APIError(f"{where}: 'content' must be a string, null or a list of text parts", param="messages")


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as templates render them: the parsed object when the JSON string holds one."""
    if isinstance(raw, str):
        try:
            v = json.loads(raw)
        except ValueError:
            return raw
        return v if isinstance(v, dict) else raw
    return raw


def normalize_messages(msgs: list) -> list[dict]:
    """OpenAI messages as HF chat templates take them: text content, `developer` as `system`, tool calls with their
    arguments parsed."""
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(f"{where} must be an object with 'role' one of {', '.join(ROLES)}", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict = {"role": role, "content": _text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise APIError(f"{where}.tool_calls must be a list", param="messages")
            msg["tool_calls"] = []
            for c in calls:
                f = c.get("function") if isinstance(c, dict) else None
                if not (isinstance(f, dict) and isinstance(f.get("name"), str)):
                    raise APIError(f"{where}.tool_calls: each needs function.name and function.arguments", param="messages")
                msg["tool_calls"].append({"id": c.get("id"), "type": "function",
                                          "function": {"name": f["name"], "arguments": _arguments(f.get("arguments", {}))}})
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
            if m.get("name"):
                msg["name"] = m["name"]
        elif m.get("name") and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def message_key(m: dict) -> tuple:
    """What two versions of one message must share to count as the same turn (ids and whitespace aside)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return m["role"], (m.get("content") or "").strip(), calls


def render(tokenizer, messages: list[dict], tools: list[dict] | None, *, generation_prompt: bool) -> str:
    """The chat template's text of `messages` (APIError when the model has no template or the template refuses them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("the served model's tokenizer has no chat template: use /v1/completions", param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False)
    except Exception as e:  # jinja's own errors and the template's raise_exception()
        raise APIError(f"the chat template refused these messages: {e}", param="messages") from None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- completions and tool calls -------------------------------------------------------------------
@dataclass
class Completion:
    """One sampled completion as a backend returns it."""

    ids: list[int]
    logprobs: list[float]
    finish: str  # "stop" | "length" | "abort"
    stop_text: str | None = None  # the stop string that ended it, if one did
    weight_version: int | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, (id, log-prob) of the likeliest first


def completion_text(tokenizer, c: Completion, eos_ids: set[int]) -> str:
    """What the client reads: the sampled text without the end-of-turn token, cut before a matched stop string."""
    ids = c.ids[:-1] if c.finish == "stop" and c.ids and c.ids[-1] in eos_ids else c.ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if c.stop_text and (pos := text.find(c.stop_text)) >= 0:
        text = text[:pos]
    return text


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a completion's text; ([the text], []) when it holds no well-formed call."""
    if not tools or "<tool_call>" not in text:
        return text, []
    names = {t["function"]["name"] for t in tools}
    calls = []
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1).strip())
        except ValueError:
            return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"] in names):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _arguments(args)
        if not isinstance(args, dict):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    rest = TOOL_CALL.sub("", text)
    if not calls or "<tool_call>" in rest or "</tool_call>" in rest:  # an unclosed or stray tag
        return text, []
    return rest.strip() or None, calls


def _top(tokenizer, c: Completion, k: int) -> list[list[tuple[str, float]]]:
    """Per token, the text and log-prob of its k likeliest alternatives ([] each when none were asked for)."""
    if not k:
        return [[] for _ in c.ids]
    if c.top_logprobs is None or len(c.top_logprobs) != len(c.ids):
        raise APIError("the engine returned no top log-probs for this completion", status=500)
    return [[(tokenizer.decode([t]), lp) for t, lp in pos[:k]] for pos in c.top_logprobs]


def _logprobs(tokenizer, c: Completion, k: int) -> dict:
    toks = [tokenizer.decode([t]) for t in c.ids]
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in top]}
                        for t, lp, top in zip(toks, c.logprobs, _top(tokenizer, c, k))]}


def chat_choice(tokenizer, c: Completion, index: int, req: Request, eos_ids: set[int]) -> dict:
    text = completion_text(tokenizer, c, eos_ids)
    content, calls = parse_tool_calls(text, req.tools)
    msg: dict = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        msg["tool_calls"] = calls
    finish = "tool_calls" if calls else "length" if c.finish == "length" else "stop"
    return {"index": index, "message": msg, "logprobs": _logprobs(tokenizer, c, req.top_logprobs) if req.logprobs else None,
            "finish_reason": finish}


def usage(prompt_tokens: int, completions: list[Completion]) -> dict:
    n = sum(len(c.ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def chat_response(model: str, choices: list[dict], use: dict) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use, "system_fingerprint": None}


def streams_tokens(req: Request) -> bool:
    """Whether a streamed chat call sends its text as it is sampled (ChatStream): not where tools are offered (a tool
    call is parsed from the whole text) or log-probs asked for; those stream each choice once it is done."""
    return req.stream and not req.tools and not req.logprobs


def _chunker(model: str):
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(i: int | None, delta: dict | None = None, finish=None, lp=None, use: dict | None = None) -> dict:
        choices = [] if i is None else [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None, "choices": choices, **({"usage": use} if i is None else {})}
    return chunk


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may still turn into a stop string."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    return n


class ChatStream:
    """The chat.completion.chunk events of a call streamed token by token: a role chunk per choice, content deltas as
    tokens arrive (cut before a stop string, held back while the text's end could still begin one or ends inside a
    character), then the rest of the final text, the finish reason and the usage. The deltas of a choice add up to the
    content a plain call returns. Each token decodes a window of a few tokens (the text before it, to place its leading
    space, and the new ones), never the whole response again."""

    def __init__(self, tokenizer, model: str, req: Request, eos_ids: set[int], stops: tuple[str, ...]):
        self.tok, self.req, self.eos_ids, self.stops = tokenizer, req, eos_ids, stops
        self.chunk = _chunker(model)
        self.ids: list[list[int]] = [[] for _ in range(req.n)]
        self.text = [""] * req.n  # the decoded text of ids[:read[j]]
        self.prefix = [0] * req.n  # where the decoding window starts
        self.read = [0] * req.n  # how many ids text holds
        self.sent = [""] * req.n
        self.cut = [False] * req.n  # a stop string showed up: nothing more of this choice streams

    def start(self) -> list[dict]:
        return [self.chunk(i, {"role": "assistant", "content": ""}) for i in range(self.req.n)]

    def token(self, j: int, token_id: int) -> list[dict]:
        ids = self.ids[j]
        ids.append(token_id)
        if self.cut[j] or token_id in self.eos_ids:
            return []
        before = self.tok.decode(ids[self.prefix[j]:self.read[j]], skip_special_tokens=True)
        now = self.tok.decode(ids[self.prefix[j]:], skip_special_tokens=True)
        if now.endswith("\ufffd"):  # a character whose bytes have not all been sampled yet
            return []
        new, start = now[len(before):], len(self.text[j])
        self.text[j] += new
        self.prefix[j], self.read[j] = self.read[j], len(ids)
        text = self.text[j]
        # a stop string ends within the new text or the longest stop before it
        look = max(0, start - max((len(s) for s in self.stops), default=0))
        hits = [p for p in (text.find(s, look) for s in self.stops) if p >= 0]
        if hits:
            self.cut[j], safe = True, text[:min(hits)]
        else:
            safe = text[:len(text) - _held_back(text, self.stops)]
        return self._delta(j, safe)

    def _delta(self, j: int, text: str) -> list[dict]:
        if not text.startswith(self.sent[j]) or len(text) == len(self.sent[j]):
            return []
        delta, self.sent[j] = text[len(self.sent[j]):], text
        return [self.chunk(j, {"content": delta})]

    def finish(self, completions: list[Completion], use: dict | None) -> list[dict]:
        out = []
        for j, c in enumerate(completions):
            ch = chat_choice(self.tok, c, j, self.req, self.eos_ids)
            final = ch["message"]["content"] or ""
            if not final.startswith(self.sent[j]):  # a prefix's decoding that the whole text's does not begin with
                raise APIError("the streamed text and the completion's text differ; call without 'stream'", status=500)
            out += self._delta(j, final) + [self.chunk(j, {}, ch["finish_reason"])]
        if use is not None:
            out.append(self.chunk(None, use=use))
        return out


def chat_chunks(model: str, choices: list[dict], use: dict | None) -> list[dict]:
    """The chat.completion.chunk events of finished choices: role, content, tool calls, finish reason (a call with
    tools or log-probs: each choice streams in a few chunks once it is done)."""
    chunk = _chunker(model)
    out = []
    for ch in choices:
        i, msg = ch["index"], ch["message"]
        out.append(chunk(i, {"role": "assistant", "content": ""}))
        if msg["content"]:
            out.append(chunk(i, {"content": msg["content"]}, lp=ch["logprobs"]))
        for k, call in enumerate(msg.get("tool_calls") or ()):
            out.append(chunk(i, {"tool_calls": [{"index": k, **call}]}))
        out.append(chunk(i, {}, ch["finish_reason"]))
    if use is not None:
        out.append(chunk(None, use=use))
    return out


def completion_choice(tokenizer, c: Completion, index: int, req: Request, eos_ids: set[int]) -> dict:
    lp = None
    if req.logprobs:
        toks = [tokenizer.decode([t]) for t in c.ids]
        top = [dict(pos) for pos in _top(tokenizer, c, req.top_logprobs)] if req.top_logprobs else None
        lp = {"tokens": toks, "token_logprobs": list(c.logprobs), "top_logprobs": top, "text_offset": None}
    return {"index": index, "text": completion_text(tokenizer, c, eos_ids), "logprobs": lp,
            "finish_reason": "length" if c.finish == "length" else "stop"}


def completion_response(model: str, choices: list[dict], use: dict) -> dict:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def models_response(model: str) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "polyrl"}]}
