"""The OpenAI-compatible routes with the official `openai` client: on `polyrl serve` (an EngineServer in a thread,
sharing /generate's batcher) and on the loopback gateway `polyrl train` starts (EngineBackend over the engine), with
its token-exact trajectory records. A tiny random chat model (tests/chat_model.py); ScriptedEngine answers chosen
texts where a test needs the model to call a tool."""

from __future__ import annotations

import json
import os

import pytest
import torch

from chat_model import ScriptedEngine, make_chat_model
from polyrl.config import ServerConfig
from polyrl.rollout.gateway import EngineBackend, Gateway, GatewayThread, Trajectories, TrajectorySettings
from polyrl.rollout.server import ServerThread
from polyrl.rollout.trajectory import Trajectory

openai = pytest.importorskip("openai")  # make install adds it; GPU machines collect this file without it

KEY = "test-key"
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                           "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "what is 12+30?"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(str(tmp_path_factory.mktemp("chat_model")))


@pytest.fixture(scope="module")
def engine(chat_dir):
    return ScriptedEngine(chat_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def served(engine, chat_dir):
    st = ServerThread(engine, ServerConfig(port=0, api_key=KEY, batch_wait_ms=1), model_path=chat_dir, seed=0)
    client = openai.OpenAI(base_url=st.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        yield client
    finally:
        client.close()
        st.stop()


@pytest.fixture(scope="module")
def gateway(engine, chat_dir):
    trajectories = Trajectories(TrajectorySettings(temperature=1.0, top_p=1.0, top_k=-1, seed=lambda tid, k: 7 + k))
    gt = GatewayThread(lambda: Gateway(engine.tokenizer, "chat_model", EngineBackend(engine).complete, api_key=KEY,
                                       max_len=256, vocab_size=len(engine.tokenizer), trajectories=trajectories))
    gt.trajectories = trajectories
    try:
        yield gt
    finally:
        gt.stop()


def test_chat_completion_schema_usage_and_logprobs(served, engine, chat_dir):
    r = served.chat.completions.create(model="anything", messages=ASK, max_tokens=8, seed=3, logprobs=True, n=2)
    assert r.object == "chat.completion" and len(r.choices) == 2 and r.model == os.path.basename(chat_dir)
    prompt = engine.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    for c in r.choices:
        assert c.finish_reason in ("stop", "length") and c.message.role == "assistant"
        assert all(t.logprob <= 0 for t in c.logprobs.content)
    again = served.chat.completions.create(model="m", messages=ASK, max_tokens=8, seed=3, n=2)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]  # the seed decides
    assert [m.id for m in served.models.list().data] == [os.path.basename(chat_dir)]


def test_streaming_gives_the_same_text_as_a_plain_call(served):
    plain = served.chat.completions.create(model="m", messages=ASK, max_tokens=10, seed=5)
    chunks = list(served.chat.completions.create(model="m", messages=ASK, max_tokens=10, seed=5, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (plain.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [plain.choices[0].finish_reason]
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_a_stream_arrives_token_by_token_and_adds_up_to_the_plain_answer(served, gateway, engine):
    """Without tools or log-probs a streamed chat sends its text as the engine samples it: for each of n choices more
    than one content delta, whose concatenation is the plain call's content (also when a stop string cuts it), then
    its finish reason; tokens that could still begin the stop string are held back, never sent and taken back."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        for api in (served, client):
            plain = api.chat.completions.create(model="m", messages=ASK, max_tokens=16, seed=9, n=2)
            texts = [c.message.content or "" for c in plain.choices]
            assert all(len(engine.tokenizer(t, add_special_tokens=False)["input_ids"]) >= 4 for t in texts), texts
            for kw, want in (({}, texts), ({"stop": [texts[0][3:5]]}, None)):
                ref = plain if want is not None else api.chat.completions.create(model="m", messages=ASK,
                                                                                  max_tokens=16, seed=9, n=2, **kw)
                chunks = list(api.chat.completions.create(model="m", messages=ASK, max_tokens=16, seed=9, n=2,
                                                          stream=True, stream_options={"include_usage": True}, **kw))
                for i, c in enumerate(ref.choices):
                    deltas = [ch.choices[0].delta.content for ch in chunks
                              if ch.choices and ch.choices[0].index == i and ch.choices[0].delta.content]
                    assert "".join(deltas) == (c.message.content or "")
                    assert want is None or len(deltas) > 1, deltas  # token by token, not one finished text
                    ends = [ch.choices[0].finish_reason for ch in chunks
                            if ch.choices and ch.choices[0].index == i and ch.choices[0].finish_reason]
                    assert ends == [c.finish_reason]
                assert chunks[-1].usage.total_tokens == ref.usage.total_tokens
        # in a trajectory the streamed call is recorded as a plain one is: its sampled tokens, loss-masked in
        traced, rec = open_trajectory(gateway, "streamed")
        chunks = list(traced.chat.completions.create(model="m", messages=ASK, max_tokens=8, stream=True,
                                                     stream_options={"include_usage": True}))
        (sample,) = rec.samples()
        assert len(sample.response_ids) == chunks[-1].usage.completion_tokens and sum(sample.loss_mask) == \
            len(sample.response_ids)
    finally:
        client.close()


def test_completions_with_text_and_token_ids(served, engine):
    a = served.completions.create(model="m", prompt="1+2=", max_tokens=4, seed=1, logprobs=0)
    ids = engine.tokenizer("1+2=", add_special_tokens=False)["input_ids"]
    b = served.completions.create(model="m", prompt=ids, max_tokens=4, seed=1)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    assert len(a.choices[0].logprobs.token_logprobs) == a.usage.completion_tokens


def test_top_logprobs_through_both_apis_on_the_server_and_the_gateway(served, gateway, engine):
    """Chat's top_logprobs and completions' logprobs k: k alternatives a token, likeliest first, the sampled token's
    log-prob equal to its own entry where it is one of them (one engine call computes both; 1e-5 covers fp32's two
    reductions of one row); the text is that of the same call without them."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        for api in (served, client):
            plain = api.chat.completions.create(model="m", messages=ASK, max_tokens=6, seed=4, temperature=0.9)
            r = api.chat.completions.create(model="m", messages=ASK, max_tokens=6, seed=4, temperature=0.9,
                                            logprobs=True, top_logprobs=3)
            assert r.choices[0].message.content == plain.choices[0].message.content
            content = r.choices[0].logprobs.content
            assert len(content) == r.usage.completion_tokens
            for t in content:
                alts = [a.logprob for a in t.top_logprobs]
                assert len(alts) == 3 and alts == sorted(alts, reverse=True)
                assert all(a.bytes == list(a.token.encode()) for a in t.top_logprobs)
                mine = [a.logprob for a in t.top_logprobs if a.token == t.token]
                assert not mine or abs(mine[0] - t.logprob) < 1e-5
            c = api.completions.create(model="m", prompt="1+2=", max_tokens=4, seed=1, logprobs=2)
            lp = c.choices[0].logprobs
            assert len(lp.top_logprobs) == len(lp.tokens) and all(len(d) <= 2 for d in lp.top_logprobs)
            assert all(max(d.values()) >= lp_t - 1e-5 for d, lp_t in zip(lp.top_logprobs, lp.token_logprobs))
        engine.reports_top_logprobs = False  # as the GPU engine: refused by name, on both
        for api in (served, client):
            with pytest.raises(openai.BadRequestError, match="sampled token's log-prob only"):
                api.chat.completions.create(model="m", messages=ASK, max_tokens=2, logprobs=True, top_logprobs=1)
    finally:
        engine.reports_top_logprobs = True
        client.close()


def test_tool_calls_are_parsed_and_malformed_ones_are_text(served, engine):
    engine.script = ['let me see<tool_call>{"name": "calc", "arguments": {"e": "12+30"}}</tool_call>']
    r = served.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=80)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "let me see"
    (call,) = c.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"e": "12+30"}
    for bad in ('<tool_call>{"name": "calc", "arguments": {"e": </tool_call>',  # not JSON
                '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # a tool the request did not offer
                '<tool_call>{"name": "calc", "arguments": {}}'):  # never closed
        engine.script = [bad]
        r = served.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=80)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == bad
        assert not r.choices[0].message.tool_calls


def test_bad_requests_get_4xx_and_the_server_keeps_serving(served, chat_dir):
    for kwargs in ({"top_logprobs": 2}, {"top_logprobs": 21, "logprobs": True}, {"tool_choice": "required", "tools": TOOLS},
                   {"frequency_penalty": 0.5}, {"temperature": 3}, {"n": 0}):
        with pytest.raises(openai.BadRequestError) as e:
            served.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kwargs)
        assert e.value.status_code == 400 and e.value.message
    with pytest.raises(openai.BadRequestError):
        served.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        served.chat.completions.create(model="m", messages=[{"role": "user", "content": "9" * 400}])
    # refused by its characters before the template or the tokenizer runs (as /generate's text)
    with pytest.raises(openai.BadRequestError, match="characters of text, more than the model's context"):
        served.chat.completions.create(model="m", messages=[{"role": "user", "content": "9" * 200_000}])
    with pytest.raises(openai.BadRequestError, match="characters of text, more than the model's context"):
        served.completions.create(model="m", prompt="9" * 200_000)
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        served.chat.completions.create(model="m", messages=ASK, extra_body={"bogus": 1})
    wrong = openai.OpenAI(base_url=str(served.base_url), api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="m", messages=ASK)
    assert served.chat.completions.create(model="m", messages=ASK, max_tokens=2).choices


def open_trajectory(gateway, tid: str, **limits) -> tuple[openai.OpenAI, Trajectory]:
    rec = Trajectory(**limits)
    gateway.trajectories.open(tid, rec)
    return openai.OpenAI(base_url=f"{gateway.url}/trajectories/{tid}/v1", api_key=KEY, max_retries=0, timeout=60), rec


def tool_turns(client, answer: str = "42") -> list[dict]:
    """A two-call tool conversation through `client`: the call, the tool's result, the answer."""
    r1 = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, temperature=0.0)
    msg = r1.choices[0].message
    history = [*ASK, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42"}]
    r2 = client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    return [*history, r2.choices[0].message.model_dump(exclude_none=True)]


def test_a_tool_conversation_is_one_token_exact_sample(gateway, engine):
    client, rec = open_trajectory(gateway, "t1")
    call = 'sure <tool_call>{"name":"calc","arguments":{"e":"12+30"}}</tool_call>'  # not the template's spacing
    engine.script, engine.prompts = [call, "it is 42"], []
    tool_turns(client)
    tok, eos = engine.tokenizer, engine.tokenizer.eos_token_id
    (seg,) = rec.segments
    first, second = engine.prompts
    call_ids = tok.encode(call, add_special_tokens=False) + [eos]
    assert first == seg.prompt_ids and second[:len(first) + len(call_ids)] == first + call_ids  # spliced, not re-tokenized
    s = rec.samples()[0]
    assert s.prompt_ids + s.response_ids == second + tok.encode("it is 42", add_special_tokens=False) + [eos]
    between = second[len(first) + len(call_ids):]  # the template's tool turn and generation prompt
    assert tok.decode(between) == "<|im_start|>user\n<tool_response>42</tool_response><eos><|im_start|>assistant\n"
    assert s.loss_mask == [1] * len(call_ids) + [0] * len(between) + [1] * (len(s.response_ids) - len(call_ids) - len(between))
    assert [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m] == [-0.25] * sum(s.loss_mask)
    assert rec.rewrites == 0 and rec.calls == 2 and gateway.trajectories.overridden == 1  # temperature=0.0 replaced


def test_a_rewritten_history_splits_the_trajectory(gateway, engine):
    client, rec = open_trajectory(gateway, "t2")
    engine.script = ["first answer", "second answer"]
    r1 = client.chat.completions.create(model="m", messages=ASK)
    summary = [{"role": "user", "content": "summary: " + r1.choices[0].message.content}]  # history rewritten
    client.chat.completions.create(model="m", messages=summary)
    assert len(rec.segments) == 2 and rec.rewrites == 1
    assert [s.loss_mask.count(1) for s in rec.samples()] == [len("first answer") + 1, len("second answer") + 1]


def test_trajectory_budgets_and_unknown_ids(gateway, engine):
    client, rec = open_trajectory(gateway, "t3", max_response=5, max_calls=2)
    engine.script = []
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=50)
    assert r.usage.completion_tokens <= 5
    history = [*ASK, r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    calls = len(engine.prompts)
    r2 = client.chat.completions.create(model="m", messages=history)  # the budget is spent: no engine work
    assert r2.choices[0].finish_reason == "length" and not r2.choices[0].message.content
    assert len(engine.prompts) == calls and len(rec.segments) == 1
    with pytest.raises(openai.BadRequestError, match="max-turns"):
        client.chat.completions.create(model="m", messages=ASK)
    stray = openai.OpenAI(base_url=f"{gateway.url}/trajectories/nope/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError):
        stray.chat.completions.create(model="m", messages=ASK)
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        open_trajectory(gateway, "t4")[0].chat.completions.create(model="m", messages=ASK, n=2)


def test_completions_in_a_trajectory_continue_by_token_prefix(gateway, engine):
    client, rec = open_trajectory(gateway, "t5")
    engine.script = ["12", "34"]
    ids = engine.tokenizer.encode("1+2=", add_special_tokens=False)
    r1 = client.completions.create(model="m", prompt=ids, max_tokens=8)
    done = ids + engine.prompts[-1][len(ids):] + engine.tokenizer.encode("12", add_special_tokens=False) + [
        engine.tokenizer.eos_token_id]
    assert r1.choices[0].text == "12"
    client.completions.create(model="m", prompt=done + engine.tokenizer.encode("3+4=", add_special_tokens=False))
    (s,) = rec.samples()  # the second prompt extends the first prompt + completion: one sample
    assert s.loss_mask == [1, 1, 1] + [0] * 4 + [1, 1, 1] and rec.rewrites == 0


def test_the_gateway_refuses_what_the_server_refuses(gateway, served):
    import urllib.error
    import urllib.request

    def post(url, data: bytes, ctype: str, key: str = KEY) -> int:
        req = urllib.request.Request(url, data=data, headers={"Content-Type": ctype, "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            assert json.loads(e.read())["error"]["message"]  # always a JSON error object
            return e.code

    for base in (gateway.url + "/v1", str(served.base_url).rstrip("/")):
        url = base + "/chat/completions"
        assert post(url, b"hello", "text/plain") == 415
        assert post(url, b"[1, 2]", "application/json") == 400
        assert post(url, b"{bad json", "application/json") == 400
        assert post(url, json.dumps({"messages": ASK}).encode(), "application/json", key="nope") == 401


def test_the_gateway_streams_lists_its_model_and_honours_stop_and_top_p(gateway):
    """The in-process gateway's own /v1 (no trajectory): the same stream as a plain call, its model name, a stop string
    cutting the text before its first occurrence, and a top_p small enough to leave one token a step (greedy)."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        assert [m.id for m in client.models.list().data] == ["chat_model"]
        plain = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, seed=5)
        text = plain.choices[0].message.content or ""
        chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=12, seed=5, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert len(text) >= 4, text  # a stop string from the middle of the text the same seed gives
        cut = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, seed=5, stop=[text[2:4]])
        assert cut.choices[0].message.content == text[:text.index(text[2:4])]
        assert cut.choices[0].finish_reason == "stop"
        greedy = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=0.0)
        narrow = client.chat.completions.create(model="m", messages=ASK, max_tokens=12, temperature=1.0, top_p=1e-9,
                                                seed=11)
        assert narrow.choices[0].message.content == greedy.choices[0].message.content
    finally:
        client.close()
