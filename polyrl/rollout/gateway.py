"""OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models) over an engine, and the loopback
gateway that records agents' trajectories for training.

The routes are one thin layer over a backend's `complete(prompt_ids, Call, on_token=None) -> [Completion]` (on_token:
each token as it is sampled, for a streamed chat): on `polyrl serve` the server's own batcher (the engine call its SGLang /generate routes make), in `polyrl train` the run's RolloutEngine
(EngineBackend: in this process, launched servers or external ones, behind the same micro-batching). Payload parsing
and response building live in polyrl/rollout/openai_api.py; trajectory records in polyrl/rollout/trajectory.py.

Under /trajectories/<id>/v1/... a call belongs to trajectory <id>: its prompt is spliced from the tokens already
sampled (never re-tokenized), its completion recorded with its log-probs, and it takes the run's sampling settings
(the temperature, top-p and top-k the trainer scores with, and a seed per call) in place of the request's;
`n` must be 1 there. The gateway `polyrl train` starts only knows the ids its agent rollout opened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from polyrl.rollout import openai_api as oa
from polyrl.rollout.base import NO_TOP_LOGPROBS, GenerateWatch
from polyrl.rollout.openai_api import APIError, Completion
from polyrl.rollout.trajectory import Trajectory
from polyrl.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """One prompt's sampling request to a backend."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0  # per token, this many likeliest alternatives with their log-probs


@dataclass
class TrajectorySettings:
    """How calls under /trajectories/<id>/ sample: the run's settings; `seed(id, call)` gives each call its seed."""

    temperature: float
    top_p: float
    top_k: int
    seed: Callable[[str, int], int]
    stop: tuple[str, ...] = ()  # --rollout-stop, added to the request's
    stop_token_ids: tuple[int, ...] = ()  # --rollout-stop-token-ids


class Trajectories:
    """The gateway's records, by id. open()/close() are the agent rollout's; only opened ids are served."""

    def __init__(self, settings: TrajectorySettings | None = None):
        self.settings = settings
        self._records: dict[str, Trajectory] = {}
        self.overridden = 0  # calls whose temperature / top_p / seed the run's settings replaced
        self._lock = threading.Lock()

    def open(self, tid: str, record: Trajectory) -> None:
        with self._lock:
            self._records[tid] = record

    def close(self, tid: str) -> Trajectory | None:
        with self._lock:
            return self._records.pop(tid, None)

    def get(self, tid: str) -> Trajectory:
        rec = self._records.get(tid)
        if rec is None:
            raise APIError(f"no trajectory {tid!r} is open on this gateway", status=404)
        return rec


class OpenAIRoutes:
    """The /v1 routes for one model. `read_body(request) -> dict` parses a bounded JSON body (the server's rules)."""

    def __init__(self, tokenizer, model_name: str, complete: Callable[[list[int], Call], Awaitable[list[Completion]]],
                 read_body: Callable, *, max_len: int | None, max_n: int, vocab_size: int,
                 trajectories: Trajectories | None = None, max_text_chars: int = 4 * 1024**2):
        self.tok, self.model, self.complete, self.read_body = tokenizer, model_name, complete, read_body
        self.max_len, self.max_n, self.vocab_size, self.trajectories = max_len, max_n, vocab_size, trajectories
        # text bounds before any template or tokenizer runs, as /generate's (polyrl.rollout.server): at most
        # max_text_chars a request, and no more than the context times the longest token's characters
        self.max_text_chars = max_text_chars
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if eos is not None else set()
        self.eot_text = tokenizer.decode([eos]) if eos is not None else ""
        # templates and tokenizers run here, one request at a time: a long chat costs the event loop nothing
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="polyrl-openai-tokenizer")

    def _bound(self, *texts) -> None:
        chars = _chars(texts)
        if chars > self.max_text_chars:
            raise APIError(f"the request holds {chars} characters of text; at most {self.max_text_chars} in one request "
                           "(--max-text-chars)", param="messages")
        if self.max_len and chars > self.max_len * self.max_token_chars:
            raise APIError(f"the request holds {chars} characters of text, more than the model's context of "
                           f"{self.max_len} tokens can hold (no token spells more than {self.max_token_chars})",
                           param="messages")

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, fn, *args)

    def add_to(self, router) -> None:
        prefixes = ["/v1"] + (["/trajectories/{tid}/v1"] if self.trajectories is not None else [])
        for p in prefixes:
            router.add_post(f"{p}/chat/completions", self.chat)
            router.add_post(f"{p}/completions", self.completions)
            router.add_get(f"{p}/models", self.models)

    # ---- routes -----------------------------------------------------------------------------------------
    async def models(self, request):
        return web.json_response(oa.models_response(self.model))

    async def chat(self, request):
        body = await self.read_body(request)
        try:
            req = oa.parse_chat(body, self.max_n)
            self._bound(req.messages, req.tools)
            tid = request.match_info.get("tid")
            if tid is None:
                ids = await self._off_loop(lambda: oa.encode(self.tok, oa.render(self.tok, req.messages, req.tools,
                                                                                generation_prompt=True)))
                call, done = self._call(req, ids, None), None
            else:
                ids, call, done = await self._chat_traced(tid, req)
            if req.stream and oa.streams_tokens(req):
                return await self._stream_chat(request, req, ids, call, done)
            outs = await self._generate(ids, req, call)
            if done is not None:
                done(outs[0])
            choices = [oa.chat_choice(self.tok, c, i, req, self.eos_ids) for i, c in enumerate(outs)]
            use = oa.usage(len(ids), outs)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        if req.stream:
            return await self._sse(request, oa.chat_chunks(self.model, choices, use if req.include_usage else None))
        return web.json_response(oa.chat_response(self.model, choices, use))

    async def _stream_chat(self, request, req: oa.Request, ids: list[int], call: Call, done):
        """Server-sent events as the engine samples: each choice's text in deltas, held back where it might still be
        the start of a stop string or an unfinished character, then the finish reason (and usage). The deltas add up
        to the text a plain call returns."""
        queue: asyncio.Queue = asyncio.Queue()

        async def generate():
            try:
                return await self._generate(ids, req, call, on_token=lambda j, t: queue.put_nowait((j, t)))
            finally:
                queue.put_nowait(None)  # after every token: the engine's callbacks were queued on this loop first
        task = asyncio.ensure_future(generate())
        stream = oa.ChatStream(self.tok, self.model, req, self.eos_ids, call.stop)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            for e in stream.start():
                await self._event(resp, e)
            while (item := await queue.get()) is not None:
                for e in stream.token(*item):
                    await self._event(resp, e)
            try:
                outs = task.result()
                if done is not None:
                    done(outs[0])
                events = stream.finish(outs, oa.usage(len(ids), outs) if req.include_usage else None)
            except APIError as e:  # the stream has begun: the error goes as an event, as OpenAI's does
                events = [e.body()]
            for e in events:
                await self._event(resp, e)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            if not task.done():  # the client went away: its completion is not waited for
                task.cancel()
        return resp

    @staticmethod
    async def _event(resp, e: dict) -> None:
        await resp.write(f"data: {json.dumps(e)}\n\n".encode())

    async def completions(self, request):
        body = await self.read_body(request)
        try:
            req = oa.parse_completion(body, self.max_n, self.vocab_size)
            self._bound([p for p in req.prompts if isinstance(p, str)])
            tid = request.match_info.get("tid")
            if tid is not None and len(req.prompts) != 1:
                raise APIError("a trajectory's /completions call takes one prompt", param="prompt")
            choices, total, outs_all = [], 0, []
            for p in req.prompts:
                ids = p if isinstance(p, list) else await self._off_loop(oa.encode, self.tok, p)
                if not ids:
                    raise APIError("'prompt' renders to no tokens", param="prompt")
                if tid is None:
                    outs = await self._generate(ids, req, self._call(req, ids, None))
                else:
                    rec = self.trajectories.get(tid)
                    ids, kept = rec.plan_ids(list(ids))
                    outs = await self._generate(ids, req, self._traced_call(tid, rec, req, ids, kept))
                    rec.record(ids, kept, outs[0])
                total += len(ids)
                outs_all += outs
                choices += [oa.completion_choice(self.tok, c, len(choices) + i, req, self.eos_ids)
                            for i, c in enumerate(outs)]
            use = oa.usage(total, outs_all)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        resp = oa.completion_response(self.model, choices, use)
        if req.stream:
            return await self._sse(request, [resp])
        return web.json_response(resp)

    # ---- generation ---------------------------------------------------------------------------------------
    async def _chat_traced(self, tid: str, req: oa.Request) -> tuple[list[int], Call, Callable[[Completion], None]]:
        """A trajectory's call: its prompt ids, its sampling, and what records its completion."""
        rec = self.trajectories.get(tid)
        if req.n != 1:
            raise APIError("a trajectory records one completion per call: 'n' must be 1", param="n")
        ids, kept = await self._off_loop(rec.plan, self.tok, req.messages, req.tools, self.eot_text)
        call = self._traced_call(tid, rec, req, ids, kept)

        def record(c: Completion) -> None:
            reply = oa.chat_choice(self.tok, c, 0, req, self.eos_ids)["message"]
            norm = oa.normalize_messages([{k: v for k, v in reply.items() if k != "refusal"}])[0]
            # a stop token id ended it (EOS, or --rollout-stop-token-ids: a base model's <|im_end|>): its text ends the turn
            ended = c.finish == "stop" and bool(c.ids) and c.ids[-1] in self.eos_ids | set(call.stop_token_ids)
            rec.record(ids, kept, c, messages=req.messages, tools=req.tools, reply=norm,
                       eot=self.tok.decode([c.ids[-1]]) if ended else None)
        return ids, call, record

    def _check_prompt(self, ids: list[int]) -> None:
        if self.max_len and len(ids) >= self.max_len:
            raise APIError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_len} tokens, which "
                           "leaves no room for a new one", param="messages", code="context_length_exceeded")

    def _call(self, req: oa.Request, ids: list[int], room: int | None) -> Call:
        self._check_prompt(ids)
        left = [x for x in (room, self.max_len - len(ids) if self.max_len else None) if x is not None]
        mnt = req.max_tokens if req.max_tokens is not None else min(left) if left else 1024
        mnt = min([mnt, *left])
        return Call(req.n, 1.0 if req.temperature is None else float(req.temperature),
                    1.0 if req.top_p is None else float(req.top_p), -1, mnt, tuple(req.stop), req.seed,
                    top_logprobs=req.top_logprobs)

    def _traced_call(self, tid: str, rec: Trajectory, req: oa.Request, ids: list[int], kept: int) -> Call:
        room = rec.room(len(ids), kept)
        if rec.segments and (room == 0 or (self.max_len and len(ids) >= self.max_len)):
            # a later turn past the budget or the context: an empty "length" answer ends the agent's loop the way a
            # full context ends a sample, instead of an error that would fail the whole trajectory
            return Call(1, 1.0, 1.0, -1, 0, (), None)
        call = self._call(req, ids, room)
        s = rec.sampling if rec.sampling is not None else self.trajectories.settings
        if s is None:
            return call
        if (req.temperature, req.top_p, req.seed) != (None, None, None):
            self.trajectories.overridden += 1
        return dataclasses.replace(call, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                   seed=s.seed(tid, rec.calls), stop=tuple(dict.fromkeys(call.stop + s.stop)),
                                   stop_token_ids=s.stop_token_ids)

    async def _generate(self, ids: list[int], req: oa.Request, call: Call, on_token=None) -> list[Completion]:
        if call.max_new_tokens <= 0:  # the budget is spent: what the engine would answer, without asking it
            return [Completion([], [], "length") for _ in range(call.n)]
        outs = await (self.complete(ids, call) if on_token is None else self.complete(ids, call, on_token=on_token))
        if any(c.finish == "abort" for c in outs):
            raise APIError("the request was aborted (weight update, shutdown or deadline)", status=503)
        return outs

    @staticmethod
    async def _sse(request, events: list[dict]):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for e in events:
            await resp.write(f"data: {json.dumps(e)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


# ---- backends -------------------------------------------------------------------------------------------
def finish_of(tokenizer, ids: list[int], finish_reason: str, stop: tuple[str, ...], stop_ids: set[int]) -> str | None:
    """The stop string that ended a "stop" completion (None: a stop token ended it, or it ran out of length)."""
    if finish_reason != "stop" or not stop or (ids and ids[-1] in stop_ids):
        return None
    tail = tokenizer.decode(ids[-16:], skip_special_tokens=True)
    return next((x for x in stop if x in tail), None)


class EngineBackend:
    """A RolloutEngine as the routes' backend: concurrent calls with the same settings (all but the seed) that arrive
    within `window_s` of each other share one engine.generate, each prompt with its own seed. An engine in this
    process runs one generate at a time on one thread of our own; engine servers take them concurrently."""

    def __init__(self, engine, window_s: float = 0.002):
        self.engine, self.window_s = engine, window_s
        self._pool = ThreadPoolExecutor(1 if not engine.concurrent_update else 16, thread_name_prefix="polyrl-gateway")
        self._lock = asyncio.Lock() if not engine.concurrent_update else None
        self._pending: list[tuple[list[int], Call, asyncio.Future, Callable | None]] = []
        self._task: asyncio.Task | None = None
        eos = engine.tokenizer.eos_token_id
        self._stop_ids = {eos} if eos is not None else set()

    async def complete(self, ids: list[int], call: Call, on_token: Callable[[int, int], None] | None = None
                       ) -> list[Completion]:
        """on_token(sample index, token id): called on this loop as an in-process engine samples each token."""
        if call.top_logprobs and not self.engine.reports_top_logprobs:
            raise APIError(NO_TOP_LOGPROBS, param="top_logprobs")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((ids, call, fut, on_token))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        await asyncio.sleep(self.window_s)
        while self._pending:
            key = dataclasses.replace(self._pending[0][1], seed=None)
            batch = [p for p in self._pending if dataclasses.replace(p[1], seed=None) == key]
            self._pending = [p for p in self._pending if dataclasses.replace(p[1], seed=None) != key]
            batch = [p for p in batch if not p[2].done()]  # the agent hung up while it waited
            if not batch:
                continue
            if self._lock is None:
                asyncio.create_task(self._run(batch, key))
            else:
                async with self._lock:
                    await self._run(batch, key)

    async def _run(self, batch, c: Call) -> None:
        import random
        seeds = [p[1].seed if p[1].seed is not None else random.getrandbits(62) for p in batch]
        sp = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=c.max_new_tokens,
                            stop=list(c.stop), stop_token_ids=list(c.stop_token_ids), n=c.n, prompt_seeds=seeds,
                            top_logprobs=c.top_logprobs)
        version = self.engine.version
        loop = asyncio.get_running_loop()
        kw = {"watch": _Tokens([p[3] for p in batch], c.n, loop)} if any(p[3] for p in batch) else {}
        try:
            samples = await loop.run_in_executor(self._pool, functools.partial(
                self.engine.generate, [p[0] for p in batch], sp, **kw))
        except Exception as e:
            log.exception("engine.generate failed for %d gateway calls", len(batch))
            for p in batch:
                if not p[2].done():
                    p[2].set_exception(APIError(f"generation failed: {type(e).__name__}: {e}", status=500))
            return
        for i, p in enumerate(batch):
            outs = [Completion(list(s.response_ids), list(s.rollout_logprobs), s.finish_reason,
                               finish_of(self.engine.tokenizer, s.response_ids, s.finish_reason, c.stop,
                                         self._stop_ids | set(c.stop_token_ids)),
                               s.weight_version if s.weight_version is not None else version, s.top_logprobs)
                    for s in samples[i * c.n:(i + 1) * c.n]]
            if not p[2].done():
                p[2].set_result(outs)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Tokens(GenerateWatch):
    """Hands each sampled token to its call's on_token on the gateway's loop (an in-process engine calls token())."""

    streams = True

    def __init__(self, callbacks: list, n: int, loop) -> None:
        super().__init__()
        self.callbacks, self.n, self.loop = callbacks, n, loop

    def token(self, index: int, token_id: int) -> None:
        i, j = divmod(index, self.n)
        if (cb := self.callbacks[i]) is not None:
            self.loop.call_soon_threadsafe(cb, j, token_id)


# ---- the loopback gateway ---------------------------------------------------------------------------------
class Gateway:
    """An aiohttp app with the OpenAI routes (and the trajectory routes) over a backend, behind a Bearer key; JSON
    bodies only, at most `max_request_bytes`."""

    def __init__(self, tokenizer, model_name: str, complete, *, api_key: str, max_len: int | None, vocab_size: int,
                 trajectories: Trajectories | None = None, max_request_bytes: int = 16 * 1024**2, max_n: int = 64):
        self.api_key, self.max_request_bytes = api_key, max_request_bytes
        self.app = web.Application(client_max_size=max_request_bytes, middlewares=[self._guard])
        self.routes = OpenAIRoutes(tokenizer, model_name, complete, self._body, max_len=max_len, max_n=max_n,
                                   vocab_size=vocab_size, trajectories=trajectories)
        self.routes.add_to(self.app.router)

    @web.middleware
    async def _guard(self, request, handler):
        try:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, f"Bearer {self.api_key}".encode()):
                raise APIError("Unauthorized: this gateway needs 'Authorization: Bearer <api key>'", status=401)
            return await handler(request)
        except APIError as e:
            return web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413
            if e.status < 400:
                raise
            msg = f"request body over {self.max_request_bytes} bytes" if e.status == 413 else e.reason
            return web.json_response(APIError(msg, status=e.status).body(), status=e.status)
        except Exception as e:  # a bug or an engine failure: answer, log, keep serving
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(APIError(f"{type(e).__name__}: {e}", status=500).body(), status=500)

    async def _body(self, request) -> dict:
        from polyrl.rollout.server import HTTPError, json_object
        try:
            return json_object(await request.read(), request.content_type)
        except HTTPError as e:
            raise APIError(str(e), status=e.status) from None


class GatewayThread:
    """A Gateway on 127.0.0.1 (any free port) on its own event loop in a daemon thread: `.url`, `.stop()`."""

    def __init__(self, make_gateway: Callable[[], Gateway], timeout: float = 60):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="polyrl-gateway", daemon=True)
        self._thread.start()

        async def start() -> str:
            self.gateway = make_gateway()
            self._runner = web.AppRunner(self.gateway.app, access_log=None, handle_signals=False,
                                         handler_cancellation=True)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

        try:
            self.url = asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout)
        except TimeoutError:
            raise TimeoutError(f"the agent gateway did not start listening within {timeout:g} s") from None

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def served_name(model_path: str) -> str:
    """The model name the routes report: the checkpoint directory's name."""
    import os
    return os.path.basename(os.path.normpath(model_path)) or model_path


def context_len(model_path: str, engine) -> int | None:
    """Most tokens a sequence may hold: an in-process engine's limit, else the model config's."""
    from transformers import AutoConfig

    from polyrl.rollout.base import InProcessEngine
    own = engine.max_len if isinstance(engine, InProcessEngine) else None
    return own or getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)


class ServerBackend:
    """`polyrl serve`'s batcher as the routes' backend: each call is one queued item, batched with /generate's."""

    def __init__(self, server):
        self.server = server

    async def complete(self, ids: list[int], call: Call, on_token: Callable[[int, int], None] | None = None
                       ) -> list[Completion]:
        import uuid

        from polyrl.rollout.server import GenSettings, Item, OutSettings
        s = self.server
        if call.top_logprobs and not s.engine.reports_top_logprobs:
            raise APIError(NO_TOP_LOGPROBS, param="top_logprobs")
        gen = GenSettings(call.temperature, call.top_p, call.top_k, call.max_new_tokens, call.stop,
                          tuple(sorted(set(call.stop_token_ids))), call.n)
        seed = call.seed if call.seed is not None else s._rng.getrandbits(62)
        item = Item(list(ids), gen, OutSettings(skip_special_tokens=True, no_stop_trim=True, return_logprob=True,
                                                return_text_in_logprobs=False, top_logprobs_num=call.top_logprobs),
                    seed, f"oai-{uuid.uuid4().hex}", asyncio.get_running_loop().create_future(), on_token=on_token)
        (outs,) = await s.submit([item])
        res = []
        for o in outs:
            meta, fin = o["meta_info"], o["meta_info"]["finish_reason"]
            matched = fin.get("matched") if fin["type"] == "stop" else None
            version = meta["weight_version"]
            tops = meta.get("output_top_logprobs")
            res.append(Completion(list(o["output_ids"]), [x[0] for x in meta.get("output_token_logprobs", [])],
                                  fin["type"], matched if isinstance(matched, str) else None,
                                  int(version) if str(version).isdigit() else None,
                                  [[(x[1], x[0]) for x in pos] for pos in tops] if tops is not None else None))
        return res


def server_routes(server) -> OpenAIRoutes:
    """The OpenAI routes of a `polyrl serve` EngineServer (its key, body rules and batcher)."""
    return OpenAIRoutes(server.tokenizer, served_name(server.model_path), ServerBackend(server).complete, server._body,
                        max_len=server.max_len, max_n=server.cfg.max_n, vocab_size=server.vocab_size,
                        max_text_chars=server.cfg.max_text_chars)


def _chars(x) -> int:
    """Characters of every string in a JSON value (message contents, tool schemas, prompts)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, dict):
        return sum(_chars(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_chars(v) for v in x)
    return 0
