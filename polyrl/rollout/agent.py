"""--agent-function-path: agents as they are written (the `openai` SDK, the OpenAI Agents SDK, LangGraph, a bash tool
loop) trained through an OpenAI-compatible gateway that records what they did token for token (docs/agents.md).

The function:

    async def agent(task: AgentTask, client: ClientConfig) -> float | list[dict]

- `task`: the prompt record: `messages` (the prompt as chat messages; a string prompt is one user message), `label`,
  `metadata`, and where the call sits in the step (`group_index`, `sample_index`).
- `client`: `base_url`, `api_key`, `model` of a loopback gateway (`openai.AsyncOpenAI(**client.openai_kwargs())`).
  Every chat call made there belongs to this trajectory: the gateway renders it with the model's chat template,
  splices the tokens it sampled before (nothing is re-tokenized), samples with the run's settings and records the
  completion ids and log-probs (polyrl/rollout/trajectory.py).
- It returns the reward (a number), or the final messages (a list of dicts), which the configured reward function
  scores: `sample.response` is then the last assistant message's text and `sample.metadata["messages"]` the list.

polyrl calls it --n-samples-per-prompt times per prompt, at most --agent-concurrency calls at once, each within
--agent-timeout seconds. A call that raises, times out, returns something else or made no chat call is a failed
sample: reward 0, loss mask 0 on all of its tokens, counted in agent/failed with a console line; the run goes on.
Each trajectory gives the step --agent-samples-per-trajectory samples (its last segments, padded with samples that
train nothing), so that every prompt group keeps one size for the advantage baseline.
The function runs on an event loop of its own: await the client (and any other I/O); a blocking call inside it
stalls every other agent and escapes the timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from polyrl.rollout.gateway import (EngineBackend, Gateway, GatewayThread, Trajectories, TrajectorySettings,
                                    context_len, served_name)
from polyrl.rollout.sampling import cut_to_budget, mix_seed
from polyrl.rollout.trajectory import Trajectory
from polyrl.types import Sample, SamplingParams

FLAG = "--agent-function-path"


@dataclass
class AgentTask:
    """One prompt as an agent function sees it."""

    messages: list[dict]
    label: Any = None
    metadata: dict = field(default_factory=dict)
    group_index: int = 0
    sample_index: int = 0


@dataclass(frozen=True)
class ClientConfig:
    """Where the agent sends its chat calls. The key is per run and loopback only; it stays out of reprs."""

    base_url: str
    api_key: str = field(repr=False)
    model: str

    def openai_kwargs(self) -> dict:
        """`openai.AsyncOpenAI(**client.openai_kwargs())`."""
        return {"base_url": self.base_url, "api_key": self.api_key}


def resolve_agent_fn(path: str) -> Callable:
    """The --agent-function-path function (imported once; start-up validation calls this first)."""
    from polyrl.rewards import _load_attr
    fn = _load_attr(path, FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{FLAG} {path!r}: {getattr(fn, '__name__', fn)!r} is not an `async def` function; polyrl "
                         "awaits it (async def fn(task, client) -> float | list[dict])")
    return fn


def as_messages(prompt: Any) -> list[dict]:
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def final_text(messages: list) -> str:
    """The last assistant message's text (what a reward function reads as the response)."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "assistant":
            c = m.get("content")
            return c if isinstance(c, str) else "".join(p.get("text", "") for p in c or () if isinstance(p, dict))
    return ""


class AgentRunner:
    """Runs a step's agents against the loopback gateway over the run's engine and turns their records into samples
    (grouped by prompt, as RolloutEngine.generate returns them)."""

    def __init__(self, cfg, engine):
        r = cfg.rollout
        self.path = r.agent_function_path
        self.fn = resolve_agent_fn(self.path)
        self.engine, self.tok = engine, engine.tokenizer
        self.timeout, self.concurrency, self.per_trajectory = r.agent_timeout, r.agent_concurrency, r.agent_samples_per_trajectory
        self.exact = cfg.model.true_on_policy
        self.max_context, self.max_turns = r.rollout_max_context_len, r.max_turns
        self.stop, self.stop_ids = tuple(r.rollout_stop), tuple(r.rollout_stop_token_ids)
        self.model = served_name(cfg.model.hf_checkpoint)
        self.max_len = context_len(cfg.model.hf_checkpoint, engine)
        self.trajectories = Trajectories()
        self._key = secrets.token_urlsafe(32)
        self._gateway: GatewayThread | None = None
        self._backend: EngineBackend | None = None
        self._counts: dict[str, float] = {}  # since pop_metrics()

    def _url(self) -> str:
        if self._gateway is None:
            self._backend = EngineBackend(self.engine)
            self._gateway = GatewayThread(lambda: Gateway(self.tok, self.model, self._backend.complete, api_key=self._key,
                                                          max_len=self.max_len, vocab_size=len(self.tok),
                                                          trajectories=self.trajectories))
        return self._gateway.url

    def generate(self, items: list, params: SamplingParams) -> list[Sample]:
        """params.n trajectories per prompt of `items` [(prompt_ids, PromptRecord)], per_trajectory samples each;
        counted in the next pop_metrics()."""
        samples, counts = self._generate(items, params)
        for k, v in counts.items():
            self._counts[k] = self._counts.get(k, 0.0) + v
        return samples

    def evaluate(self, items: list, params: SamplingParams) -> list[Sample]:
        """generate() for held-out prompts: not counted in the training steps' agent metrics."""
        return self._generate(items, params)[0]

    def pop_metrics(self) -> dict[str, float]:
        """agent/* counters of the trajectories generated since the last call (agent/calls: mean chat calls each)."""
        c, self._counts = self._counts, {}
        if not c:
            return {}
        calls = c.pop("agent/calls")
        return {**c, "agent/calls": calls / max(c["agent/trajectories"], 1.0)}

    def _generate(self, items: list, params: SamplingParams) -> tuple[list[Sample], dict[str, float]]:
        url = self._url()
        base = params.seed if params.seed is not None else 0
        seeds: dict[str, int] = {}
        # per call of generate: evaluation and training may run at once (--async with engine servers)
        settings = TrajectorySettings(params.temperature, params.top_p, params.top_k,
                                      seed=lambda tid, k: mix_seed(seeds[tid], k), stop=self.stop,
                                      stop_token_ids=self.stop_ids)
        before = self.trajectories.overridden
        results = asyncio.run(self._all(url, items, params, base, seeds, settings))
        samples = [s for group in results for s in group[0]]
        if self.exact:  # each call was scored alone; the trainer scores the assembled sample as one sequence
            self.engine.score_trajectories([s for s in samples if not s.metadata.get("agent_padding")], params)
        failures = [(k, g[1]) for k, g in enumerate(results) if g[1]]
        m = {"agent/trajectories": float(len(results)), "agent/failed": float(len(failures)),
             "agent/timeouts": float(sum("--agent-timeout" in e for _, e in failures)),
             "agent/split_trajectories": float(sum(g[2].rewrites > 0 for g in results)),
             "agent/dropped_segments": float(sum(max(0, len(g[2].segments) - self.per_trajectory) for g in results)),
             "agent/calls": float(sum(g[2].calls for g in results)),
             "agent/sampling_overridden": float(self.trajectories.overridden - before)}
        if failures:
            k, err = failures[0]
            print(f"polyrl: warning: {len(failures)} of {len(results)} agent calls failed this step (counted in "
                  f"agent/failed, trained as nothing); first: {FLAG} {self.path} on prompt {k // params.n}, sample "
                  f"{k % params.n}: {err}", file=sys.stderr, flush=True)
        return samples, m

    async def _all(self, url: str, items: list, params: SamplingParams, base: int, seeds: dict,
                   settings: TrajectorySettings) -> list:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(i: int, j: int):
            ids, rec = items[i]
            tid = uuid.uuid4().hex
            seeds[tid] = mix_seed(base, i * params.n + j)  # one stream per (step, prompt, sample); one seed per call
            traj = Trajectory(max_response=params.max_new_tokens, max_context=self.max_context, max_calls=self.max_turns,
                              sampling=settings)
            self.trajectories.open(tid, traj)
            task = AgentTask(as_messages(rec.prompt), rec.label, dict(rec.metadata), group_index=i, sample_index=j)
            client = ClientConfig(f"{url}/trajectories/{tid}/v1", self._key, self.model)
            out, err = None, None
            async with gate:
                try:
                    out = await asyncio.wait_for(self.fn(task, client), self.timeout)
                except asyncio.TimeoutError:
                    err = f"did not return within --agent-timeout {self.timeout:g} s"
                except Exception as e:  # the agent's own failure: a failed sample, never a failed run
                    err = f"{type(e).__name__}: {e}"
                finally:
                    self.trajectories.close(tid)
            samples, err = self._samples(out, err, traj, ids, rec, i, params)
            return samples, err, traj

        return await asyncio.gather(*(one(i, j) for i in range(len(items)) for j in range(params.n)))

    def _samples(self, out: Any, err: str | None, traj: Trajectory, ids: list[int], rec, i: int,
                 params: SamplingParams) -> tuple[list[Sample], str | None]:
        segs = traj.samples()
        reward, messages = None, None
        if err is None:
            if isinstance(out, (int, float)) and not isinstance(out, bool):
                reward = float(out)
            elif isinstance(out, list) and all(isinstance(m, dict) for m in out):
                messages = out
            else:
                err = f"returned {type(out).__name__}; return the reward (a number) or the final messages (a list of dicts)"
        if err is None and not segs:
            err = "made no chat call through client.base_url (nothing to train)"
        kept = segs[-self.per_trajectory:]
        first = kept[0].prompt_ids if kept else list(ids)
        eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0
        while len(kept) < self.per_trajectory:  # a sample that trains nothing keeps every group one size
            kept.append(Sample(list(first), [eos], [0.0], "stop", loss_mask=[0], metadata={"agent_padding": 1}))
        meta = {**rec.metadata, "turns": traj.calls, "agent_segments": len(segs)}
        if messages is not None:
            meta["messages"] = messages
        for s in kept:
            cut_to_budget(s, params.max_new_tokens, self.max_context)
            s.group_index, s.label = i, rec.label
            s.prompt = rec.prompt if isinstance(rec.prompt, str) else str(rec.prompt)
            s.metadata = {**meta, **s.metadata}
            s.response = final_text(messages) if messages is not None else self.tok.decode(s.response_ids,
                                                                                             skip_special_tokens=True)
            if s.weight_version is None:
                s.weight_version = self.engine.version
            if err is not None:
                s.loss_mask = [0] * len(s.response_ids)
                s.metadata.update(agent_reward=0.0, agent_failed=err)
            elif reward is not None:
                s.metadata["agent_reward"] = reward
        return kept, err

    def close(self) -> None:
        if self._gateway is not None:
            self._gateway.stop()
            self._backend.close()
            self._gateway = None


class AgentRewards:
    """The reward of agent samples: the agent's own number where it returned one (or 0 for a failed call), else the
    configured reward function's (`inner`, a RewardManager) on the final messages. Scorer calls it as its reward."""

    def __init__(self, inner):
        self.inner = inner

    def score(self, samples: list[Sample]) -> dict[str, float]:
        from polyrl.rewards import reward_metrics
        rest = [s for s in samples if "agent_reward" not in s.metadata]
        m: dict[str, float] = {}
        if rest:
            if self.inner is None:
                raise ValueError(f"{FLAG}: the agent returned its final messages but no reward function is set "
                                 "(--rm-type, --custom-rm-path or --rm-url); return a number or set one")
            m = self.inner.score(rest)
        for s in samples:
            if "agent_reward" in s.metadata:
                s.reward = s.metadata["agent_reward"]
        return {**m, **reward_metrics(samples, int(m.get("reward/errors", 0)), int(m.get("reward/timeouts", 0)))}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

