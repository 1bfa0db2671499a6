"""--agent-function-path: agents written against the OpenAI API, trained through the loopback gateway. A 2-step CPU
`polyrl train` with an `openai` SDK agent (samples reach the trainer token-exact), failing and hanging agents counted
and survived, final messages scored by the reward function, the OpenAI Agents SDK and LangGraph used unchanged (a tool
call and its answer become one sample), runs against a launched and an external `polyrl serve`, and the flag's
start-up checks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from chat_model import PLAIN_AGENT, ScriptedEngine, make_chat_model
from polyrl.cli import main
from polyrl.types import PromptRecord, SamplingParams

AGENTS = PLAIN_AGENT + '''
import asyncio, json, os

async def rewrites(task, client):
    """The second call does not extend the first: it replaces the history with a summary (a new segment)."""
    async with openai.AsyncOpenAI(**client.openai_kwargs(), max_retries=0) as oa:
        r1 = await oa.chat.completions.create(model=client.model, messages=task.messages, max_tokens=4)
        summary = [{"role": "user", "content": "so far: " + (r1.choices[0].message.content or "")[:8]}]
        r2 = await oa.chat.completions.create(model=client.model, messages=summary, max_tokens=4)
    return [*summary, r2.choices[0].message.model_dump(exclude_none=True)]

async def flaky(task, client):
    """Sample 0 of every prompt raises, sample 1 hangs, the others answer and return their messages."""
    if task.sample_index == 0:
        raise RuntimeError("tool backend down")
    if task.sample_index == 1:
        await asyncio.sleep(3600)
    async with openai.AsyncOpenAI(**client.openai_kwargs(), max_retries=0) as oa:
        r = await oa.chat.completions.create(model=client.model, messages=task.messages, max_tokens=3)
    return [*task.messages, r.choices[0].message.model_dump(exclude_none=True)]
'''
RECORDER = '''
import json, os
def record(sample):
    with open(os.environ["POLYRL_TEST_SAMPLES"], "a") as f:
        f.write(json.dumps({"prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids,
                            "loss_mask": sample.loss_mask, "response": sample.response, "meta": sample.metadata}) + "\\n")
    return 1.0
'''


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_chat_model(str(tmp_path_factory.mktemp("agent_chat_model")))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("agent_data") / "train.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"add {a}+{a}", "label": str(2 * a)}) + "\n" for a in range(8)))
    return str(p)


def _args(chat_dir, prompts, tmp_path, *extra):
    return ["train", "--hf-checkpoint", chat_dir, "--prompt-data", prompts, "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "40", "--num-rollout", "2", "--quiet",
            "--seed", "1", "--device", "cpu", "--run-dir", str(tmp_path / "run"), *extra]


def test_an_openai_agent_trains_token_exact(chat_dir, prompts, tmp_path, monkeypatch):
    fn = tmp_path / "agents.py"
    fn.write_text(AGENTS)
    assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:plain")) == 0
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all("pg_loss" in m for m in metrics)
    for m in metrics:
        assert m["agent/trajectories"] == 8 and m["agent/failed"] == 0 and m["agent/calls"] == 2
        assert m["agent/split_trajectories"] == 0  # the second call extends the first: one sample each


def test_a_two_call_agent_under_true_on_policy_trains_on_exactly_the_reported_log_probs(chat_dir, prompts, tmp_path):
    """--true-on-policy: each call is scored alone when it is made; the assembled sample (both turns and the template
    tokens between them) is scored once more, whole, by the engine's scoring function, so the trainer's log-probs of
    every sampled token equal the reported ones bit for bit (the run stops on any difference above 0)."""
    fn = tmp_path / "agents.py"
    fn.write_text(AGENTS)
    assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:plain", "--true-on-policy",
                      "--ci-train-rollout-logprob-abs-diff-threshold", "0")) == 0
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["agent/calls"] == 2 and m["agent/split_trajectories"] == 0
        assert m["train_rollout_logprob_abs_diff_max"] == 0.0 and m["grad_norm"] > 0


def test_the_samples_hold_both_turns_with_the_template_masked(chat_dir, prompts, tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    fn, rm = tmp_path / "agents.py", tmp_path / "rm.py"
    fn.write_text(AGENTS.replace("return float(len(", "return [*history, r2.choices[0].message.model_dump()] or float(len("))
    rm.write_text(RECORDER)
    out = tmp_path / "samples.jsonl"
    monkeypatch.setenv("POLYRL_TEST_SAMPLES", str(out))
    assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:plain", "--custom-rm-path",
                      f"{rm}:record", "--num-rollout", "1")) == 0
    tok = AutoTokenizer.from_pretrained(chat_dir)
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 8
    for r in rows:
        text = tok.decode(r["prompt_ids"] + r["response_ids"])
        assert text.startswith(tok.apply_chat_template(r["meta"]["messages"][:1], add_generation_prompt=True,
                                                       tokenize=False))
        masked = tok.decode([t for t, m in zip(r["response_ids"], r["loss_mask"]) if not m])
        assert "<|im_start|>user\nmore<eos>\n<|im_start|>assistant\n" in masked  # the user's turn, never trained
        assert r["meta"]["turns"] == 2 and r["response"] == (r["meta"]["messages"][-1]["content"] or "")


def test_an_agent_that_rewrites_its_history_splits_into_segments_that_train(chat_dir, prompts, tmp_path, monkeypatch):
    """Through `polyrl train`: every trajectory splits at its second call; --agent-samples-per-trajectory 2 trains both
    segments (each its own prompt: the task's, then the summary's), each with the trajectory's reward."""
    fn, rm = tmp_path / "agents.py", tmp_path / "rm.py"
    fn.write_text(AGENTS)
    rm.write_text(RECORDER)
    out = tmp_path / "samples.jsonl"
    monkeypatch.setenv("POLYRL_TEST_SAMPLES", str(out))
    assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:rewrites", "--custom-rm-path",
                      f"{rm}:record", "--num-rollout", "1", "--agent-samples-per-trajectory", "2")) == 0
    (m,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert m["agent/split_trajectories"] == 8 and m["agent/dropped_segments"] == 0 and m["agent/calls"] == 2
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(chat_dir)
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 16 and all(r["meta"]["agent_segments"] == 2 for r in rows)
    firsts = [r for r in rows if "so far: " not in tok.decode(r["prompt_ids"])]
    seconds = [r for r in rows if "so far: " in tok.decode(r["prompt_ids"])]
    assert len(firsts) == len(seconds) == 8  # one sample of each segment per trajectory, none a padding sample
    assert all(any(r["loss_mask"]) and "agent_padding" not in r["meta"] for r in rows)


def test_failing_and_hanging_agents_are_counted_not_fatal(chat_dir, prompts, tmp_path, capfd):
    fn, rm = tmp_path / "agents.py", tmp_path / "rm.py"
    fn.write_text(AGENTS)
    rm.write_text("def one(sample):\n    return 1.0\n")
    assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:flaky", "--agent-timeout", "2",
                      "--custom-rm-path", f"{rm}:one", "--num-rollout", "1")) == 0
    (m,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert m["agent/failed"] == 4 and m["agent/timeouts"] == 2  # two prompts x (one raised, one hung)
    assert m["reward/mean"] == 0.5  # failed samples score 0, the others' messages 1
    err = capfd.readouterr().err
    assert "4 of 8 agent calls failed" in err and "RuntimeError: tool backend down" in err


def test_flag_checks(chat_dir, prompts, tmp_path, capsys):
    fn = tmp_path / "agents.py"
    fn.write_text(AGENTS + "\ndef not_async(task, client):\n    return 1.0\n")
    for extra, msg in (([f"--agent-function-path", f"{fn}:not_async"], "not an `async def`"),
                       (["--agent-timeout", "5", "--rm-type", "exact"], "--agent-function-path"),
                       ([f"--agent-function-path", f"{fn}:plain", "--custom-generate-function-path", f"{fn}:plain"],
                        "keep one"),
                       ([f"--agent-function-path", f"{fn}:plain", "--partial-rollout"], "cannot be paused"),
                       ([f"--agent-function-path", f"{fn}:plain", "--true-on-policy", "--rollout-engine", "server"],
                        "--true-on-policy with --agent-function-path and --rollout-engine server")):
        assert main(_args(chat_dir, prompts, tmp_path, *extra)) != 0
        assert msg in capsys.readouterr().err


AGENTS_SDK = '''
from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)

@function_tool
def calc(e: str) -> str:
    """Evaluate an addition such as 12+30."""
    a, b = e.split("+")
    return str(int(a) + int(b))

async def agent(task, client):
    model = OpenAIChatCompletionsModel(model=client.model, openai_client=AsyncOpenAI(**client.openai_kwargs(), max_retries=0))
    bot = Agent(name="adder", instructions="use calc", tools=[calc], model=model)
    result = await Runner.run(bot, task.messages[0]["content"], run_config=RunConfig(tracing_disabled=True))
    return float(result.final_output.strip() == task.label)
'''


def test_the_openai_agents_sdk_runs_unchanged(chat_dir, tmp_path):
    """Runner.run with a function tool: the model's call, the SDK's tool turn, the model's answer, one sample."""
    from polyrl.config import Config
    from polyrl.rollout.agent import AgentRewards, AgentRunner
    fn = tmp_path / "sdk_agent.py"
    fn.write_text(AGENTS_SDK)
    cfg = Config()
    cfg.model.hf_checkpoint, cfg.rollout.agent_function_path = chat_dir, f"{fn}:agent"
    engine = ScriptedEngine(chat_dir, dtype=torch.float32)
    engine.script = ['<tool_call>{"name": "calc", "arguments": {"e": "12+30"}}</tool_call>', "42"]
    runner = AgentRunner(cfg, engine)
    try:
        (s,) = runner.generate([([1], PromptRecord("12+30", label="42"))], SamplingParams(n=1, max_new_tokens=200, seed=0))
    finally:
        runner.close()
    AgentRewards(None).score([s])
    assert s.reward == 1.0 and s.metadata["turns"] == 2 and s.metadata["agent_segments"] == 1
    tok = engine.tokenizer
    trained = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    eos = tok.eos_token_id
    assert trained == tok.encode('<tool_call>{"name": "calc", "arguments": {"e": "12+30"}}</tool_call>',
                                 add_special_tokens=False) + [eos] + tok.encode("42", add_special_tokens=False) + [eos]
    between = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m])
    assert between == "<|im_start|>user\n<tool_response>42</tool_response><eos><|im_start|>assistant\n"
    assert engine.prompts[1] == s.prompt_ids + s.response_ids[:len(engine.prompts[1]) - len(s.prompt_ids)]


LANGGRAPH = '''
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

@tool
def calc(e: str) -> str:
    """Evaluate an addition such as 12+30."""
    a, b = e.split("+")
    return str(int(a) + int(b))

async def agent(task, client):
    llm = ChatOpenAI(model=client.model, base_url=client.base_url, api_key=client.api_key, max_retries=0).bind_tools([calc])

    async def model(state):
        return {"messages": [await llm.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode([calc]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", lambda s: "tools" if s["messages"][-1].tool_calls else END)
    graph.add_edge("tools", "model")
    out = await graph.compile().ainvoke({"messages": [("user", task.messages[0]["content"])]})
    return float(out["messages"][-1].content.strip() == task.label)
'''


def test_a_langgraph_tool_agent_runs_unchanged(chat_dir, tmp_path):
    """A LangGraph graph (ChatOpenAI with a bound tool, LangGraph's ToolNode) against the gateway: the model's tool
    call, the tool's answer and the final answer are one sample, as with the OpenAI Agents SDK above."""
    pytest.importorskip("langgraph")
    from polyrl.config import Config
    from polyrl.rollout.agent import AgentRewards, AgentRunner
    fn = tmp_path / "graph_agent.py"
    fn.write_text(LANGGRAPH)
    cfg = Config()
    cfg.model.hf_checkpoint, cfg.rollout.agent_function_path = chat_dir, f"{fn}:agent"
    engine = ScriptedEngine(chat_dir, dtype=torch.float32)
    engine.script = ['<tool_call>{"name": "calc", "arguments": {"e": "12+30"}}</tool_call>', "42"]
    runner = AgentRunner(cfg, engine)
    try:
        (s,) = runner.generate([([1], PromptRecord("12+30", label="42"))], SamplingParams(n=1, max_new_tokens=200, seed=0))
    finally:
        runner.close()
    AgentRewards(None).score([s])
    assert "agent_failed" not in s.metadata, s.metadata.get("agent_failed")
    assert s.reward == 1.0 and s.metadata["turns"] == 2 and s.metadata["agent_segments"] == 1
    tok = engine.tokenizer
    trained = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    assert trained == tok.encode('<tool_call>{"name": "calc", "arguments": {"e": "12+30"}}</tool_call>',
                                 add_special_tokens=False) + [tok.eos_token_id] + tok.encode("42", add_special_tokens=False) \
        + [tok.eos_token_id]
    assert "<tool_response>42</tool_response>" in tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m])


def test_agents_train_against_a_launched_server(chat_dir, prompts, tmp_path):
    """The gateway over engine servers: each agent call is one SGLang /generate with token ids on a launched
    `polyrl serve`, calls of concurrent agents in flight together."""
    fn = tmp_path / "agents.py"
    fn.write_text(AGENTS)
    assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:plain", "--rollout-engine", "server",
                      "--num-rollout", "1", "--n-samples-per-prompt", "2")) == 0
    (m,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert m["agent/trajectories"] == 4 and m["agent/failed"] == 0 and m["agent/calls"] == 2 and "pg_loss" in m


def test_agents_train_against_an_external_server_and_sample_from_the_trained_weights(chat_dir, prompts, tmp_path):
    """--rollout-external: the gateway sends the agents' calls to a `polyrl serve` this run did not start; after step
    1 the run pushed its weights there, so step 2's calls sample from the trained policy (the trainer's log-probs of
    those tokens agree with the server's to FP32 rounding, tests/test_external_engine.py's bound)."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from serve_procs import serving
    fn = tmp_path / "agents.py"
    fn.write_text(AGENTS)
    with serving(chat_dir, tmp_path, 1) as (srv,):
        assert main(_args(chat_dir, prompts, tmp_path, "--agent-function-path", f"{fn}:plain", "--rollout-external",
                          "--rollout-external-engine-addrs", srv.url, "--n-samples-per-prompt", "2", "--lr", "1e-2")) == 0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agent/trajectories"] == 4 and r["agent/failed"] == 0 and r["agent/calls"] == 2 and "pg_loss" in r
        assert r["train_rollout_logprob_abs_diff_max"] < 1e-4, r
    assert rows[0]["grad_norm"] > 0  # step 1 moved the weights that step 2's calls were answered with
