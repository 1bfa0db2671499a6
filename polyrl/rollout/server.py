"""`polyrl serve`: SGLang's HTTP API (its payloads, as of SGLang 0.5.23) around the embedded
engine (its GPU path on CUDA, the transformers path on CPU).

Routes are thin: parse and check a JSON body, call the engine, answer in SGLang's shape.
Concurrent /generate requests are batched: each prompt becomes an item in a queue; a batcher
task takes every queued item whose sampling settings (all but the seed) match the oldest one's
and runs ONE engine.generate for them on the engine thread (the engine is not thread-safe:
generation, weight updates and read-backs all run there, one at a time). When the engine was
idle, the batcher first waits until no request arrived for a short window (--batch-wait-ms, or 2%
of the last engine call if longer), so a burst lands in one batch: a request that misses a
batch waits for the whole next call. Every prompt carries its own seed (`sampling_seed`, or a random
one), and sample j of a prompt with seed s is sampled from stream (s, j) (polyrl.rollout.sampling),
so results never depend on the batch or the server that ran them.

Security (docs/security.md): binds 127.0.0.1 unless --host says otherwise; a non-loopback --host
without a key refuses to start unless --allow-unauthenticated-host; with a key (--api-key,
--api-key-file or POLYRL_API_KEY) every endpoint but /health needs `Authorization: Bearer KEY`;
without one, off loopback only generation and read-only status answer. /update_weights_from_disk
reads only under --allowed-weight-dirs. Request bodies are JSON objects only (415), at most
--max-request-bytes (413); work per request is bounded (--max-prompts-per-request, --max-n,
max_new_tokens cut to the model's context, --request-timeout-s) and so is work in flight
(--max-running-requests samples; past it 429 with Retry-After); a bad request gets a 4xx with a
message. Nothing is ever unpickled.

Deviations from SGLang (beyond features the engine lacks, which answer 400 when asked for):
- /get_weights_by_name also takes `"return_format": "sha256"` (the digest of the whole tensor's
  bytes in the engine's dtype) or `"base64"` (the whole tensor's raw bytes): an exact read-back
  for --check-weight-update-equal; without it, SGLang's truncated float lists;
- meta_info has no input_token_logprobs (the output tokens' log-probs and their top alternatives only; the GPU
  engine reports no alternatives); top_logprobs_num is at most 20; `weight_version` starts at "0";
- /update_weights_from_disk reads *.safetensors files only (never pickled .bin checkpoints).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hmac
import json
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from aiohttp import web

from polyrl.config import Config, ConfigError, ServerConfig
from polyrl.rollout.base import NO_TOP_LOGPROBS, GenerateWatch
from polyrl.rollout.embedded import EmbeddedEngine
from polyrl.rollout.gpu.engine import GPUEngine
from polyrl.types import SamplingParams
from polyrl.weight_sync.distributed import (WeightReceiver, digest, dtype_from_name, dtype_name, encode_tensor,
                                            is_loopback)
from polyrl.weight_sync.quantize import FP8_DTYPE, Dequantizer, quantized_shapes

log = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT = 20.0  # SGLang's: /health_generate fails when nothing was generated for this long
WEIGHT_SYNC_TIMEOUT = 600.0  # a receive waits at most this long for the trainer's broadcast
API_KEY_ENV = "POLYRL_API_KEY"  # how a parent process hands a server its key (never on the command line)
# what a non-loopback server without a key (--allow-unauthenticated-host) still answers: generation and status
OPEN_WITHOUT_KEY = frozenset({"/health", "/health_generate", "/generate", "/v1/chat/completions", "/v1/completions",
                              "/v1/models", "/get_load", "/get_weight_version",
                              "/get_model_info", "/model_info"})
# safetensors dtypes a weight file may hold (the engine casts them to its own dtype)
WEIGHT_FILE_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3"})
# polyrl's one sampling parameter of its own (polyrl.rollout.lengths): the response ends with EOS at this many tokens
# (n = 1 requests). Prefixed so that it never means something else: a real SGLang refuses the unknown key outright
STOP_LENGTH_KEY = "polyrl_stop_length"
MAX_TOP_LOGPROBS = 20  # top_logprobs_num's bound: the OpenAI API's, and a bounded answer per token
# SGLang sampling parameters the engine implements, with SGLang's defaults (None = the default)
SAMPLING_DEFAULTS = {"max_new_tokens": 128, "stop": None, "stop_token_ids": None, "temperature": 1.0, "top_p": 1.0,
                     "top_k": -1, "n": 1, "sampling_seed": None, "skip_special_tokens": True, "no_stop_trim": False,
                     STOP_LENGTH_KEY: None}
# SGLang sampling parameters the engine does not implement: accepted only at their defaults, never ignored
SAMPLING_UNSUPPORTED = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                        "min_new_tokens": 0, "ignore_eos": False, "json_schema": None, "regex": None, "ebnf": None,
                        "structural_tag": None, "stop_regex": None, "logit_bias": None, "custom_params": None,
                        "beam_width": None, "stream_interval": None, "spaces_between_special_tokens": True}
# /generate fields the engine cannot honour unless they hold these values
GENERATE_UNSUPPORTED = {"stream": False, "input_embeds": None, "video_data": None, "audio_data": None,
                        "lora_path": None, "session_params": None, "return_hidden_states": False,
                        "custom_logit_processor": None}


def encode_routed_experts(routes) -> str:
    """SGLang's meta_info.routed_experts: base64 (ASCII) of the raw int32 bytes of [tokens - 1, layers, k]."""
    return base64.b64encode(routes.to(torch.int32).numpy().astype("<i4", copy=False).tobytes()).decode("ascii")


class _DropMalformedHTTP(logging.Filter):
    """aiohttp logs a traceback for every request it cannot parse (and answers 400); sglang-router probes
    each worker with HTTP/2 bytes to tell gRPC workers apart, which would fill every server's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage
        return not (record.exc_info and isinstance(record.exc_info[1], BadHttpMessage))


_DROP_MALFORMED_HTTP = _DropMalformedHTTP()


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


def bad(message: str) -> HTTPError:
    return HTTPError(400, message)


def json_object(raw: bytes, content_type: str) -> dict:
    """A request body as polyrl's servers take it (the SGLang and the OpenAI routes): JSON only, one object."""
    if content_type != "application/json":
        raise HTTPError(415, f"request bodies must be JSON (Content-Type: application/json), got {content_type!r}")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- request checking ------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _field(body: dict, key: str, check: Callable[[Any], bool], what: str, default: Any = None, required: bool = False):
    if key not in body or body[key] is None:
        if required:
            raise bad(f"missing field {key!r} ({what})")
        return default
    v = body[key]
    if not check(v):
        raise bad(f"field {key!r} must be {what}, got {json.dumps(v)[:80]}")
    return v


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _is_dtype(v: Any) -> bool:
    try:
        dtype_from_name(v)
        return True
    except ValueError:
        return False


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


@dataclass(frozen=True)
class GenSettings:
    """What one engine.generate call shares: every sampling setting but the seed."""
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    n: int


@dataclass(frozen=True)
class OutSettings:
    """Per-request output shaping (no effect on sampling)."""
    skip_special_tokens: bool
    no_stop_trim: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    return_routed_experts: bool = False  # MoE: meta_info.routed_experts, SGLang's base64 of int32 [tokens - 1, layers, k]
    top_logprobs_num: int = 0  # meta_info.output_top_logprobs: per token, the k most likely [logprob, id, text]


@dataclass
class Item:
    """One prompt of a /generate request, waiting for (or in) an engine call."""
    prompt: list[int]
    gen: GenSettings
    out: OutSettings
    seed: int
    rid: str
    future: asyncio.Future  # done (answered, aborted, past its deadline, client gone): the engine stops its rows
    t0: float = field(default_factory=time.perf_counter)
    images: list | None = None  # SGLang's image_data of this prompt, decoded (PIL images)
    stop_length: int = 0  # polyrl_stop_length (0: none)
    # a streaming client's (sample index, token id) callback, called on the event loop as each token is sampled
    on_token: Callable[[int, int], None] | None = None
    aborted: str | None = None  # /abort_request while running: the engine answers with the tokens so far, and this


# ---- the engine thread -----------------------------------------------------------------------------
class Worker:
    """One daemon thread running blocking calls in order (so the process never waits for it at exit)."""

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, args, fut, loop = self._q.get()
            try:
                res, err = fn(*args), None
            except BaseException as e:  # handed to the awaiting coroutine
                res, err = None, e
            loop.call_soon_threadsafe(_settle, fut, res, err)

    async def run(self, fn: Callable, *args) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((fn, args, fut, loop))
        return await fut


def _settle(fut: asyncio.Future, res: Any, err: BaseException | None) -> None:
    if fut.done():
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(res)


class _Answerer(GenerateWatch):
    """Answers each prompt of an engine call once its n samples have finished (on the engine thread)."""

    def __init__(self, server: "EngineServer", batch: list[Item], n: int, version: str, loop) -> None:
        super().__init__()
        self.server, self.batch, self.n, self.version, self.loop = server, batch, n, version, loop
        self.got: dict[int, dict[int, Any]] = {}
        self.streams = any(it.on_token is not None for it in batch)

    def token(self, index: int, token_id: int) -> None:
        i, j = divmod(index, self.n)
        if (cb := self.batch[i].on_token) is not None:
            self.loop.call_soon_threadsafe(cb, j, token_id)

    def finished(self, index: int, sample) -> None:
        i, j = divmod(index, self.n)
        done = self.got.setdefault(i, {})
        done[j] = sample
        if len(done) == self.n:
            it, now = self.batch[i], time.perf_counter()
            res = [self.server._output(done[k], it, self.version, now) for k in range(self.n)]
            self.loop.call_soon_threadsafe(_settle, it.future, res, None)


# ---- the server ----------------------------------------------------------------------------------------
class EngineServer:
    def __init__(self, engine, cfg: ServerConfig, *, model_path: str, seed: int | None = None, device: str = "cpu"):
        from transformers import AutoConfig

        self.engine, self.cfg, self.model_path, self.device = engine, cfg, model_path, device
        self.tokenizer = engine.tokenizer
        self.hf_config = hf = AutoConfig.from_pretrained(model_path)
        self.vocab_size = hf.get_text_config().vocab_size  # a vision-language config keeps it in its text config
        # the context: the GPU path's positions, else the model's; max_new_tokens is cut to what a prompt leaves of it
        self.max_len = engine.max_len or getattr(hf.get_text_config(), "max_position_embeddings", None)
        # A text of C characters is at least C / max_token_chars tokens: no token covers more characters of the text
        # than its vocabulary string has (byte-level BPE spells each byte of it as one character, SentencePiece's "▁"
        # one space, byte fallback's "<0x0A>" one byte in six; added tokens are in the vocabulary), so a text over
        # max_len * max_token_chars cannot fit the context. Only a normalizer that deletes characters (collapsing
        # whitespace) breaks this, and then a text that would have fitted is refused, never an unfitting one admitted.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        self._tokenizer_thread = Worker("polyrl-tokenizer")  # one text at a time: its memory (~120 B a character) bounded
        # both paths of the embedded engine stop a row between decode steps (and hand back what it generated)
        self.cancellable = isinstance(engine, (EmbeddedEngine, GPUEngine))
        self.allowed_dirs = [os.path.realpath(d) for d in cfg.allowed_weight_dirs]
        self.weight_shapes = engine.weight_shapes()
        # FP8 weight sync (SGLang's block-FP8 names): 2-D weights may also arrive as FP8 + weight_scale_inv, dequantized
        # on load; the two halves of a weight may come in different buckets, so the pairing outlives one request
        self.wire_shapes = quantized_shapes(self.weight_shapes)
        self.fp8 = Dequantizer()
        self.eos_id = self.tokenizer.eos_token_id
        self.weight_version = "0"
        self.loopback = is_loopback(cfg.host)
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._engine = Worker("polyrl-engine")
        self._comm = Worker("polyrl-weight-sync")  # rendezvous and receives wait here, not on the engine
        self.receiver = WeightReceiver(engine.device)
        self._pending: list[Item] = []
        self._running: list[Item] = []
        self._inflight = 0  # samples (prompts x n) of /generate requests queued or running
        self._health_item: Item | None = None  # the one /health_generate probe queued at a time
        self._paused = False
        self._asleep = False
        self._work: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._last_progress = 0.0
        self._last_call_s = 0.0  # how long the last engine call took
        self.stats = {"engine_calls": 0, "prompts": 0, "requests": 0, "rejected_busy": 0, "aborted": 0,
                      "deadline_aborts": 0, "disconnects": 0, "clamped": 0}
        self.app = web.Application(client_max_size=cfg.max_request_bytes, middlewares=[self._guard])
        r = self.app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        from polyrl.rollout.gateway import server_routes  # the OpenAI-compatible routes, over submit()
        server_routes(self).add_to(r)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_weight_version", self.get_weight_version)
        r.add_get("/get_load", self.get_load)
        for path, handler in (("/flush_cache", self.flush_cache), ("/get_weights_by_name", self.get_weights_by_name),
                              ("/release_memory_occupation", self.release_memory),
                              ("/resume_memory_occupation", self.resume_memory)):
            r.add_get(path, handler)
            r.add_post(path, handler)
        for path, handler in (("/abort_request", self.abort_request), ("/pause_generation", self.pause_generation),
                              ("/continue_generation", self.continue_generation),
                              ("/init_weights_update_group", self.init_group),
                              ("/update_weights_from_distributed", self.update_from_distributed),
                              ("/destroy_weights_update_group", self.destroy_group),
                              ("/update_weights_from_disk", self.update_from_disk),
                              ("/update_weight_version", self.update_weight_version)):
            r.add_post(path, handler)
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)

    async def _on_startup(self, app) -> None:
        self._work, self._idle = asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._batcher = asyncio.create_task(self._batch_loop())

    async def _on_cleanup(self, app) -> None:
        self._batcher.cancel()
        self._abort(lambda it: True, "server shutting down")

    # ---- the guard: auth, admin endpoints, errors as JSON ---------------------------------------------
    @web.middleware
    async def _guard(self, request, handler):
        try:
            if self.cfg.api_key and request.path != "/health":
                got = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(got, f"Bearer {self.cfg.api_key}".encode()):
                    raise HTTPError(401, "Unauthorized: this server needs 'Authorization: Bearer <api key>'")
            if not self.cfg.api_key and not self.loopback and request.path not in OPEN_WITHOUT_KEY:
                raise HTTPError(403, f"{request.path} is refused on a non-loopback address (--host) without an API key; "
                                     "start the server with --api-key-file (or --api-key)")
            return await handler(request)
        except HTTPError as e:
            return web.json_response({"error": {"message": str(e)}}, status=e.status, headers=e.headers)
        except web.HTTPException as e:  # aiohttp's own: 404, 405, 413 (body over --max-request-bytes)
            if e.status < 400:
                raise
            return web.json_response({"error": {"message": e.reason if e.status != 413 else
                                                 f"request body over {self.cfg.max_request_bytes} bytes (--max-request-bytes)"}},
                                     status=e.status)
        except Exception as e:  # a bug or an engine failure: answer, log, keep serving
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response({"error": {"message": f"{type(e).__name__}: {e}"}}, status=500)

    async def _body(self, request) -> dict:
        """The JSON object of a request; an empty body is {} (SGLang's optional-body endpoints)."""
        if request.content_length is not None and request.content_length > self.cfg.max_request_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.cfg.max_request_bytes,
                                                actual_size=request.content_length)
        raw = await request.read()
        return json_object(raw, request.content_type) if raw else {}

    @staticmethod
    def _json(obj: Any, status: int = 200) -> web.Response:
        return web.json_response(obj, status=status)

    # ---- /generate ------------------------------------------------------------------------------------
    async def generate(self, request):
        body = await self._body(request)
        prompts, single = await self._prompts(body)
        images = self._images(body.get("image_data"), prompts, single, from_text=body.get("text") is not None)
        for k, ok in GENERATE_UNSUPPORTED.items():
            if body.get(k) not in (None, ok):
                raise bad(f"{k!r} is not supported by polyrl serve")
        if body.get("logprob_start_len") not in (None, -1):
            raise bad("polyrl serve returns the output tokens' log-probs only (no logprob_start_len)")
        B = len(prompts)
        sps = body.get("sampling_params")
        if sps is None or isinstance(sps, dict):
            sps = [sps or {}] * B
        elif not (isinstance(sps, list) and len(sps) == B and all(isinstance(s, dict) for s in sps)):
            raise bad(f"'sampling_params' must be an object or a list of {B} objects (one per prompt)")
        settings = [self._sampling(sp, p) for sp, p in zip(sps, prompts)]
        if len({g.n for g, _, _ in settings}) > 1:
            raise bad("every prompt of a request must have the same 'n'")
        n = settings[0][0].n
        stop_lens = [_field(sp, STOP_LENGTH_KEY, lambda v: _is_int(v) and v >= 1, "an int >= 1", None) or 0 for sp in sps]
        if any(stop_lens) and n != 1:
            raise bad(f"sampling_params.{STOP_LENGTH_KEY} is one sample's length: send it with n 1")
        lp = _field(body, "return_logprob", lambda v: isinstance(v, bool) or (isinstance(v, list) and len(v) == B and all(
            isinstance(x, bool) for x in v)), f"a bool or a list of {B} bools", False)
        lps = lp if isinstance(lp, list) else [lp] * B
        text_lp = _field(body, "return_text_in_logprobs", lambda v: isinstance(v, bool), "a bool", False)
        ok_top = lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS  # noqa: E731
        top = _field(body, "top_logprobs_num", lambda v: ok_top(v) or (isinstance(v, list) and len(v) == B and all(
            ok_top(x) for x in v)), f"an int in [0, {MAX_TOP_LOGPROBS}] or a list of {B}", 0)
        tops = top if isinstance(top, list) else [top] * B
        if any(k and not want for k, want in zip(tops, lps)):
            raise bad("'top_logprobs_num' comes with the output log-probs: send 'return_logprob' true")
        if any(tops) and not self.engine.reports_top_logprobs:
            raise bad(f"'top_logprobs_num': {NO_TOP_LOGPROBS}")
        routed = _field(body, "return_routed_experts", lambda v: isinstance(v, bool), "a bool", False)
        if routed and not self.engine.reports_routed_experts:
            raise bad("'return_routed_experts': the served model has no MoE router")
        if body.get("routed_experts_start_len") not in (None, 0):
            raise bad("polyrl serve returns the routed experts of every token ('routed_experts_start_len' 0)")
        rids = self._rids(body.get("rid"), B, single)
        loop = asyncio.get_running_loop()
        items = [Item(p, g, OutSettings(skip, trim, lps[i], text_lp, routed, tops[i]), seed, rids[i], loop.create_future(),
                      images=images[i], stop_length=stop_lens[i])
                 for i, (p, (g, (skip, trim), seed)) in enumerate(zip(prompts, settings))]
        results = await self.submit(items)
        outs = []
        for it, res in zip(items, results):
            for j, o in enumerate(res):
                o["meta_info"]["id"] = it.rid if n == 1 else f"{it.rid}_{j}"
                outs.append(o)
        return self._json(outs[0] if single and n == 1 else outs)

    async def submit(self, items: list[Item]) -> list[list[dict]]:
        """Queue `items` for the batcher and wait for their outputs (n SGLang output dicts each), within
        --max-running-requests and --request-timeout-s: the engine call of /generate and of the OpenAI routes."""
        samples, cap = sum(it.gen.n for it in items), self.cfg.max_running_requests
        if samples > cap:
            raise bad(f"{len(items)} prompts x n={items[0].gen.n} = {samples} samples can never fit "
                      f"--max-running-requests {cap}")
        if self._inflight + samples > cap:  # full: the client waits and asks again; nothing queues past the cap
            self.stats["rejected_busy"] += 1
            retry = max(1, min(60, round(self._last_call_s + 0.5)))
            raise HTTPError(429, f"server busy: {self._inflight} samples queued or running, {samples} more would pass "
                                 f"--max-running-requests {cap}; retry after {retry} s", {"Retry-After": str(retry)})
        self._inflight += samples
        self.stats["requests"] += 1
        futs = [it.future for it in items]
        try:
            self._pending.extend(items)
            self._work.set()
            _, late = await asyncio.wait(futs, timeout=self.cfg.request_timeout_s)
            if late:
                ids = {id(it) for it in items}
                self.stats["deadline_aborts"] += self._abort(
                    lambda it: id(it) in ids, f"request deadline passed (--request-timeout-s {self.cfg.request_timeout_s:g})")
            results = [f.result() for f in futs]
        except asyncio.CancelledError:  # the client hung up: its rows stop at the engine's next decode step
            self.stats["disconnects"] += 1
            for f in futs:
                f.cancel()
            raise
        finally:
            self._inflight -= samples
        return results

    async def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        """(prompts as token ids, whether the request was a single prompt)."""
        if (body.get("text") is None) == (body.get("input_ids") is None):
            raise bad("give exactly one of 'text' and 'input_ids'")
        given = body.get("text") if body.get("text") is not None else body["input_ids"]
        if isinstance(given, list) and given and not isinstance(given[0], int) and len(given) > self.cfg.max_prompts_per_request:
            raise bad(f"{len(given)} prompts in one request; at most --max-prompts-per-request "
                      f"{self.cfg.max_prompts_per_request}")
        if body.get("text") is not None:
            text = body["text"]
            if isinstance(text, str):
                texts, single = [text], True
            elif _str_list(text) and text:
                texts, single = text, False
            else:
                raise bad("'text' must be a string or a non-empty list of strings")
            prompts = await self._tokenize(texts)
        else:
            ids = body["input_ids"]
            if _int_list(ids) and ids:
                prompts, single = [ids], True
            elif isinstance(ids, list) and ids and all(_int_list(p) for p in ids):
                prompts, single = ids, False
            else:
                raise bad("'input_ids' must be a non-empty list of token ids, or a non-empty list of such lists")
        for i, p in enumerate(prompts):
            if not p:
                raise bad(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise bad(f"prompt {i} has token ids outside [0, {self.vocab_size})")
            if self.max_len and len(p) >= self.max_len:
                raise bad(f"prompt {i} has {len(p)} tokens; the model's context is {self.max_len} tokens, which leaves "
                          "no room for a new one")
        return prompts, single

    async def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, computed on the tokenizer thread (a long text is seconds of CPU: the event loop keeps
        answering /health meanwhile). Text over --max-text-chars in all, or longer than the context can hold, is refused
        before any of it is tokenized."""
        total = sum(map(len, texts))
        if total > self.cfg.max_text_chars:
            raise bad(f"'text' holds {total} characters; at most --max-text-chars {self.cfg.max_text_chars} in one "
                      "request (or send 'input_ids', tokenized by the client)")
        if self.max_len:
            for i, t in enumerate(texts):
                if len(t) > self.max_len * self.max_token_chars:
                    raise bad(f"prompt {i} has {len(t)} characters, more than the model's context of {self.max_len} "
                              f"tokens can hold (no token of this tokenizer spells more than {self.max_token_chars})")
        return await self._tokenizer_thread.run(self._encode, texts)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer(t)["input_ids"] for t in texts]

    def _images(self, data: Any, prompts: list[list[int]], single: bool, from_text: bool = False) -> list[list | None]:
        """SGLang's image_data: one image or a list of them for a single prompt; a list with one entry (None, an image
        or a list of images) per prompt for a batch. Images come as data URLs or base64 (a server does not read paths
        or URLs its clients name). `input_ids` hold each image's expanded pads, as the model's processor writes them;
        a `text` prompt holds one image pad per image (as the chat template renders it), which is expanded here, in
        place in `prompts`, as SGLang's processor does."""
        B = len(prompts)
        if data is None:
            return [None] * B
        proc = self.engine.processor
        if proc is None:
            raise bad("'image_data': the served model is not a vision-language model")
        if single:
            per = [data if isinstance(data, list) else [data]]
        elif isinstance(data, list) and len(data) == B:
            per = [x if isinstance(x, list) or x is None else [x] for x in data]
        else:
            raise bad(f"'image_data' must be a list of {B} entries (one per prompt: null, an image or a list of images)")
        from polyrl.multimodal import ImageError, load_image
        out: list[list | None] = []
        for i, (ids, imgs) in enumerate(zip(prompts, per)):
            if not imgs:
                out.append(None)
                continue
            if not all(isinstance(x, str) and (x.startswith("data:") or len(x) >= 64 and "." not in x[:64]) for x in imgs):
                raise bad(f"image_data of prompt {i}: send images as data URLs ('data:image/png;base64,...') or base64")
            try:
                loaded = [load_image(x) for x in imgs]
                grid = proc.pixel_inputs(loaded)["image_grid_thw"]
                if from_text and sum(1 for t in ids if t == proc.image_token_id) == len(loaded):
                    ids = prompts[i] = proc.expand(ids, grid)
                proc.check(ids, grid)
            except ImageError as e:
                raise bad(f"image_data of prompt {i}: {e}") from None
            if self.max_len and len(ids) >= self.max_len:
                raise bad(f"prompt {i} has {len(ids)} tokens with its images' pads; the model's context is "
                          f"{self.max_len} tokens, which leaves no room for a new one")
            out.append(loaded)
        return out

    def _sampling(self, sp: dict, prompt: list[int]) -> tuple[GenSettings, tuple[bool, bool], int]:
        for k, v in sp.items():
            if k in SAMPLING_UNSUPPORTED:
                if v is not None and v != SAMPLING_UNSUPPORTED[k]:
                    raise bad(f"sampling_params.{k} is not supported by polyrl serve (only its default, "
                              f"{json.dumps(SAMPLING_UNSUPPORTED[k])})")
            elif k not in SAMPLING_DEFAULTS:
                raise bad(f"unknown sampling parameter {k!r}")
        d = SAMPLING_DEFAULTS
        mnt = _field(sp, "max_new_tokens", lambda v: _is_int(v) and v >= 1, "an int >= 1", d["max_new_tokens"])
        if self.max_len and len(prompt) + mnt > self.max_len:  # cut to what the context leaves, as SGLang's scheduler does
            mnt = self.max_len - len(prompt)
            self.stats["clamped"] += 1
        temp = _field(sp, "temperature", lambda v: _is_num(v) and v >= 0, "a number >= 0", d["temperature"])
        top_p = _field(sp, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]", d["top_p"])
        top_k = _field(sp, "top_k", lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 or an int >= 1", d["top_k"])
        n = _field(sp, "n", lambda v: _is_int(v) and 1 <= v <= self.cfg.max_n, f"an int in [1, {self.cfg.max_n}] (--max-n)",
                   d["n"])
        stop = _field(sp, "stop", lambda v: isinstance(v, str) or _str_list(v), "a string or a list of strings", [])
        stop = [stop] if isinstance(stop, str) else stop
        stop_ids = _field(sp, "stop_token_ids", _int_list, "a list of token ids", [])
        seed = _field(sp, "sampling_seed", lambda v: _is_int(v) and 0 <= v < 2**63, "an int in [0, 2**63)", None)
        skip = _field(sp, "skip_special_tokens", lambda v: isinstance(v, bool), "a bool", d["skip_special_tokens"])
        trim = _field(sp, "no_stop_trim", lambda v: isinstance(v, bool), "a bool", d["no_stop_trim"])
        if seed is None:  # SGLang draws one per request too; ours lands in the per-prompt scheme
            seed = self._rng.getrandbits(62)
        gen = GenSettings(float(temp), float(top_p), top_k, mnt, tuple(s for s in stop if s), tuple(sorted(set(stop_ids))), n)
        return gen, (skip, trim), seed

    @staticmethod
    def _rids(rid: Any, B: int, single: bool) -> list[str]:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(B)]
        if isinstance(rid, str):
            return [rid] if single else [f"{rid}_{i}" for i in range(B)]
        if _str_list(rid) and len(rid) == B and len(set(rid)) == B:
            return rid
        raise bad(f"'rid' must be a string or a list of {B} distinct strings")

    # ---- the batcher -------------------------------------------------------------------------------------
    async def _batch_loop(self) -> None:
        while True:
            if not self._runnable():
                self._work.clear()
                await self._work.wait()
                window, cap = self._quiet_window()
                if window > 0:  # the engine was idle: let a burst of requests land in one batch
                    t_end = time.monotonic() + cap
                    while True:
                        before = len(self._pending)
                        await asyncio.sleep(window)
                        if len(self._pending) == before or time.monotonic() > t_end:
                            break
                continue
            # one engine call per sampling setting; budgets and stop lengths are per prompt within it
            key = dataclasses.replace(self._pending[0].gen, max_new_tokens=0)
            batch = [it for it in self._pending if dataclasses.replace(it.gen, max_new_tokens=0) == key]
            self._pending = [it for it in self._pending if dataclasses.replace(it.gen, max_new_tokens=0) != key]
            gen = batch[0].gen
            self._running = batch
            self._idle.clear()
            log.debug("engine call: %d prompts x n=%d (%d more queued), arrived over %.1f ms", len(batch), gen.n,
                      len(self._pending), 1e3 * (max(it.t0 for it in batch) - min(it.t0 for it in batch)))
            t0 = time.perf_counter()
            try:
                results = await self._engine.run(self._run_batch, batch, asyncio.get_running_loop())
            except Exception as e:
                log.exception("engine.generate failed for a batch of %d prompts", len(batch))
                for it in batch:
                    _settle(it.future, None, HTTPError(500, f"generation failed: {type(e).__name__}: {e}"))
            else:
                for it, res in zip(batch, results):
                    _settle(it.future, res, None)
            finally:
                self._last_call_s = time.perf_counter() - t0
                self._running = []
                self._last_progress = time.monotonic()
                self._idle.set()

    def _quiet_window(self) -> tuple[float, float]:
        """(window, cap): start once no request arrived for `window` seconds, or after `cap`. A request that
        misses a batch waits for the whole next engine call, so the window grows with the last call's
        length (2% of it, at most 0.1 s) above --batch-wait-ms (0: no waiting at all)."""
        base = self.cfg.batch_wait_ms / 1000
        if base <= 0:
            return 0.0, 0.0
        window = max(base, min(0.1, 0.02 * self._last_call_s))
        return window, max(50 * base, 10 * window)

    def _runnable(self) -> bool:
        self._pending = [it for it in self._pending if not it.future.done()]  # aborted while queued
        return bool(self._pending) and not self._paused and not self._asleep

    def _run_batch(self, batch: list[Item], loop: asyncio.AbstractEventLoop | None = None) -> list[list[dict]]:
        """On the engine thread: one engine.generate, then SGLang's output dicts per prompt. On an engine that stops
        rows (cancellable), a prompt whose samples have all finished is answered at once, as SGLang answers a request,
        not when the call's last row ends."""
        g = batch[0].gen
        budgets = [it.gen.max_new_tokens for it in batch]
        sp = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=max(budgets),
                            stop=list(g.stop), stop_token_ids=list(g.stop_token_ids), n=g.n,
                            prompt_seeds=[it.seed for it in batch],
                            return_routed_experts=any(it.out.return_routed_experts for it in batch),
                            top_logprobs=max(it.out.top_logprobs_num for it in batch),
                            prompt_max_new_tokens=budgets if len(set(budgets)) > 1 else None,
                            stop_lengths=[it.stop_length for it in batch for _ in range(g.n)]
                            if any(it.stop_length for it in batch) else None)
        version = self.weight_version
        # an item answered already (past its deadline, its client gone) needs no more tokens; one aborted by
        # /abort_request stops too and is answered with what it generated
        stop = {"should_stop": lambda i: batch[i].future.done() or batch[i].aborted is not None} if self.cancellable else {}
        if any(it.images for it in batch):
            stop["images"] = [it.images for it in batch]
        if self.cancellable and loop is not None:
            stop["watch"] = _Answerer(self, batch, g.n, version, loop)
        samples = self.engine.generate([it.prompt for it in batch], sp, **stop)
        self.stats["engine_calls"] += 1
        self.stats["prompts"] += len(batch)
        now = time.perf_counter()
        return [[self._output(s, it, version, now) for s in samples[i * g.n:(i + 1) * g.n]] for i, it in enumerate(batch)]

    def _output(self, s, it: Item, version: str, now: float) -> dict:
        g, o = it.gen, it.out
        ids = list(s.response_ids)
        matched: int | str | None = None
        if s.finish_reason == "stop":
            if ids and (ids[-1] in g.stop_token_ids or ids[-1] == self.eos_id):
                matched = ids[-1]
            else:  # the engine stops on a stop string found in the decoded tail, as here
                tail = self.tokenizer.decode(ids[-16:], skip_special_tokens=True)
                matched = next((x for x in g.stop if x in tail), None)
            finish = {"type": "stop", "matched": matched}
        elif s.finish_reason == "abort":
            finish = {"type": "abort", "message": it.aborted or "aborted"}
        else:
            finish = {"type": "length", "length": g.max_new_tokens}
        # SGLang's text: the matched stop token and the stop string (and what follows it) trimmed, unless no_stop_trim
        text = self.tokenizer.decode(ids[:-1] if isinstance(matched, int) and not o.no_stop_trim else ids,
                                     skip_special_tokens=o.skip_special_tokens)
        if isinstance(matched, str) and (pos := text.find(matched)) >= 0:
            text = text[:pos + len(matched)] if o.no_stop_trim else text[:pos]
        meta = {"finish_reason": finish, "prompt_tokens": len(it.prompt), "completion_tokens": len(ids),
                "cached_tokens": 0, "weight_version": version, "e2e_latency": now - it.t0}
        if o.return_logprob:
            toks = [self.tokenizer.decode([t]) for t in ids] if o.return_text_in_logprobs else [None] * len(ids)
            meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(s.rollout_logprobs, ids, toks)]
        if o.return_logprob and o.top_logprobs_num:
            k, text = o.top_logprobs_num, o.return_text_in_logprobs
            meta["output_top_logprobs"] = [[[lp, t, self.tokenizer.decode([t]) if text else None] for t, lp in pos[:k]]
                                           for pos in (s.top_logprobs or [])]
        if o.return_routed_experts:
            meta["routed_experts"] = encode_routed_experts(s.routed_experts)
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _abort(self, which: Callable[[Item], bool], message: str, partial: bool = False) -> int:
        """partial: a running item on an engine that stops rows (cancellable) is answered by the engine at its next
        decode step with the tokens it generated (SGLang's /abort_request; partial rollout continues them)."""
        n = 0
        running = {id(it) for it in self._running}
        for it in self._pending + self._running:
            if partial and self.cancellable and id(it) in running and which(it) and not it.future.done():
                if it.aborted is None:
                    it.aborted = message
                    n += 1
                continue
            if which(it) and not it.future.done():
                # SGLang answers an aborted request with finish_reason abort; a running call on the transformers path
                # drops the item's rows at its next decode step (should_stop), the GPU path's finishes and is dropped
                it.future.set_result([{"text": "", "output_ids": [], "meta_info": {
                    "finish_reason": {"type": "abort", "message": message}, "prompt_tokens": len(it.prompt),
                    "completion_tokens": 0, "cached_tokens": 0, "weight_version": self.weight_version,
                    "e2e_latency": time.perf_counter() - it.t0}} for _ in range(it.gen.n)])
                n += 1
        self.stats["aborted"] += n
        return n

    # ---- small endpoints ----------------------------------------------------------------------------------
    async def health(self, request):
        return web.Response(status=200)

    async def health_generate(self, request):
        """SGLang's: healthy when a 1-token generation completes (or any engine call finishes) within 20 s."""
        tic = time.monotonic()
        if self._health_item is None or self._health_item.future.done():  # one probe queued, however many ask
            self._health_item = Item([0], GenSettings(0.0, 1.0, -1, 1, (), (), 1), OutSettings(True, False, False, False),
                                     0, f"HEALTH_CHECK_{uuid.uuid4().hex}", asyncio.get_running_loop().create_future())
            self._pending.append(self._health_item)
            self._work.set()
        fut = self._health_item.future
        while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT:
            if (fut.done() and not fut.cancelled()) or self._last_progress > tic:
                if not fut.done():
                    fut.cancel()  # it would only repeat what the finished call proved
                return web.Response(status=200)
            await asyncio.sleep(0.05)
        fut.cancel()
        return web.Response(status=503)

    async def model_info(self, request):
        cfg = self.hf_config
        return self._json({"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                           "preferred_sampling_params": None, "weight_version": self.weight_version,
                           "served_model_name": self.model_path, "load_format": "auto",
                           "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request):
        c = self.cfg
        return self._json({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "host": c.host, "port": self.port,
            "device": self.device, "dtype": dtype_name(self.engine.dtype),
            "tp_size": 1, "dp_size": 1, "max_running_requests": c.max_running_requests, "weight_version": self.weight_version,
            "api_key_set": bool(c.api_key), "batch_wait_ms": c.batch_wait_ms, "max_request_bytes": c.max_request_bytes,
            "internal_states": [{"queued": len(self._pending), "running": len(self._running), "paused": self._paused,
                                 "memory_released": self._asleep, **self.stats}],
            "version": "polyrl", "frontend": "polyrl"})

    async def get_load(self, request):
        """What sglang-router's power_of_two policy polls (it reads "load"): sequences queued or running."""
        queued = sum(it.gen.n for it in self._pending if not it.future.done())
        running = sum(it.gen.n for it in self._running)
        return self._json({"load": queued + running, "num_reqs": running, "num_waiting_reqs": queued})

    async def get_weight_version(self, request):
        return self._json({"weight_version": self.weight_version})

    async def flush_cache(self, request):
        await self._body(request)
        # no prefix cache outlives an engine call here, so there is nothing to drop
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                                 "waiting requests, the operation will not be performed.)\n")

    async def abort_request(self, request):
        body = await self._body(request)
        rid = _field(body, "rid", lambda v: isinstance(v, str), "a string", "")
        if _field(body, "abort_all", lambda v: isinstance(v, bool), "a bool", False):
            self._abort(lambda it: True, "aborted by /abort_request (abort_all)", partial=True)
        elif rid:  # a prompt's rid, or a prefix of a batch's per-prompt rids (SGLang expands "r" to "r_0", "r_1", ...)
            self._abort(lambda it: it.rid == rid or it.rid.startswith(rid + "_"), f"aborted by /abort_request ({rid})",
                        partial=True)
        return web.Response(status=200)

    async def pause_generation(self, request):
        body = await self._body(request)
        mode = _field(body, "mode", lambda v: v in ("abort", "retract", "in_place"), "abort | retract | in_place", "abort")
        self._paused = True
        if mode == "abort":
            self._abort(lambda it: True, "aborted by /pause_generation")
        await self._idle.wait()  # the engine call under way finishes; nothing new starts
        return self._json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        await self._body(request)
        self._paused = False
        self._work.set()
        return self._json({"message": "Generation continued successfully.", "status": "ok"})

    async def release_memory(self, request):
        self._tags(await self._body(request))
        self._asleep = True  # requests queue until /resume_memory_occupation
        await self._engine.run(self.engine.sleep)
        return self._json(None)

    async def resume_memory(self, request):
        tags = self._tags(await self._body(request))
        await self._engine.run(self.engine.wake, tags)
        self._asleep = self.engine.asleep  # weights alone: updates land, generation waits
        self._work.set()
        return self._json(None)

    @staticmethod
    def _tags(body: dict) -> list[str] | None:
        # release frees weights and KV cache together whatever the tags; resume takes back the ones named
        # (cuda_graph: recaptured on the first generate after the KV cache is back)
        tags = _field(body, "tags", lambda v: _str_list(v) and set(v) <= {"weights", "kv_cache", "cuda_graph"},
                      "a list of 'weights' | 'kv_cache' | 'cuda_graph'")
        return None if tags is None else [t for t in tags if t != "cuda_graph"]

    async def update_weight_version(self, request):
        body = await self._body(request)
        version = _field(body, "new_version", lambda v: isinstance(v, str), "a string", required=True)
        if _field(body, "abort_all_requests", lambda v: isinstance(v, bool), "a bool", True):
            self._abort(lambda it: True, "aborted by /update_weight_version")
        self._set_version(version)
        return self._json({"success": True, "message": f"Weight version updated to {version}", "new_version": version})

    def _set_version(self, version: str) -> None:
        self.weight_version = version
        if version.isdigit():
            self.engine.version = int(version)

    # ---- weights ----------------------------------------------------------------------------------------
    async def get_weights_by_name(self, request):
        body = await self._body(request)
        name = _field(body, "name", lambda v: isinstance(v, str), "a string", required=True)
        if name not in self.weight_shapes:
            raise bad(f"no weight named {name!r}")
        fmt = _field(body, "return_format", lambda v: v in ("list", "sha256", "base64"), "list | sha256 | base64", "list")
        k = _field(body, "truncate_size", lambda v: _is_int(v) and v >= 0, "an int >= 0", 100)
        t = await self._engine.run(self.engine.get_weight, name)
        if fmt == "sha256":
            return self._json({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "sha256": digest(t)})
        if fmt == "base64":
            return self._json({"name": name, **encode_tensor(t)})
        return self._json(t.float()[:k].tolist() if t.dim() else t.float().tolist())  # SGLang's: the first rows, float32

    async def init_group(self, request):
        body = await self._body(request)
        addr = _field(body, "master_address", lambda v: isinstance(v, str) and v != "", "a host name or address", required=True)
        port = _field(body, "master_port", lambda v: _is_int(v) and 0 < v < 65536, "a port number", required=True)
        world = _field(body, "world_size", lambda v: _is_int(v) and v >= 2, "an int >= 2", required=True)
        rank = _field(body, "rank_offset", lambda v: _is_int(v) and 1 <= v < world, "an int in [1, world_size)", required=True)
        name = _field(body, "group_name", lambda v: isinstance(v, str) and v != "", "a non-empty string", "weight_update_group")
        backend = _field(body, "backend", lambda v: v in ("nccl", "gloo"), "nccl | gloo", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            raise bad("backend nccl needs CUDA; this server runs on CPU (use gloo)")
        try:
            await self._comm.run(self.receiver.init_group, addr, port, rank, world, name, backend, WEIGHT_SYNC_TIMEOUT)
        except Exception as e:
            return self._json({"success": False, "message": f"Failed to initialize custom process group: {e}."}, 400)
        return self._json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request):
        body = await self._body(request)
        name = _field(body, "group_name", lambda v: isinstance(v, str), "a string", "weight_update_group")
        if await self._comm.run(self.receiver.destroy_group, name):
            return self._json({"success": True, "message": "Succeeded to destroy custom process group."})
        return self._json({"success": False, "message": f"The group to be destroyed does not exist: {name!r}."}, 400)

    def _check_weights(self, names: list[str], shapes: list[list[int]], dtypes: list[str]) -> None:
        for n, s, d in zip(names, shapes, dtypes):
            if dtype_from_name(d) == FP8_DTYPE and not (n.endswith(".weight") and len(s) == 2):
                raise bad(f"{n}: {d} is for 2-D linear weights (block FP8 with a weight_scale_inv)")
            want = self.wire_shapes.get(n)
            if want is None:
                raise bad(f"no weight named {n!r} in this model")
            if tuple(s) != want:
                raise bad(f"{n}: shape {list(s)} announced, the model's is {list(want)}")

    async def update_from_distributed(self, request):
        body = await self._body(request)
        names = _field(body, "names", _str_list, "a list of weight names", required=True)
        dts = _field(body, "dtypes", lambda v: _str_list(v) and all(_is_dtype(d) for d in v),
                     "a list of torch dtype names (float32, bfloat16, ...)", required=True)
        shapes = _field(body, "shapes", lambda v: isinstance(v, list) and all(_int_list(s) and min(s, default=0) >= 0 for s in v),
                        "a list of shapes (lists of ints >= 0)", required=True)
        if not len(names) == len(dts) == len(shapes):
            raise bad(f"names, dtypes and shapes must have the same length ({len(names)}, {len(dts)}, {len(shapes)})")
        name = _field(body, "group_name", lambda v: isinstance(v, str), "a string", "weight_update_group")
        version = _field(body, "weight_version", lambda v: isinstance(v, str), "a string", None)
        load_format = _field(body, "load_format", lambda v: v in (None, "auto", "flattened_bucket"),
                             'null, "auto" or "flattened_bucket"', None)
        if load_format == "flattened_bucket" and len(set(dts)) > 1:
            raise bad(f"a flattened bucket holds tensors of one dtype, got {sorted(set(dts))}")
        if name not in self.receiver.groups:
            raise bad(f"no weight-update group {name!r}; call /init_weights_update_group first")
        self._check_weights(names, shapes, dts)
        if _field(body, "abort_all_requests", lambda v: isinstance(v, bool), "a bool", False):
            self._abort(lambda it: True, "aborted by a weight update")
        t0 = time.perf_counter()
        try:
            weights = await self._comm.run(self.receiver.receive, names, dts, shapes, name, load_format)
        except Exception as e:
            await self._comm.run(self.receiver.destroy_group, name)  # a broken group is not reused; the trainer rebuilds it
            return self._json({"success": False, "message": f"Failed to receive the weights: {e}"}, 400)
        t1 = time.perf_counter()
        await self._load(weights, version)
        log.info("weight update: %d tensors (%s) received in %.1f ms, loaded in %.1f ms", len(names),
                 load_format or "per tensor", 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1))
        return self._json({"success": True, "message": "Succeeded to update parameter online."
                           + (f" Weight version updated to {version}." if version is not None else "")})

    async def _load(self, weights: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        v = int(version) if version is not None and version.isdigit() else self.engine.version
        await self._engine.run(self.engine.update_weights, self.fp8.feed(weights), v)
        if version is not None:
            self._set_version(version)

    async def update_from_disk(self, request):
        body = await self._body(request)
        path = _field(body, "model_path", lambda v: isinstance(v, str) and v != "", "a directory path", required=True)
        version = _field(body, "weight_version", lambda v: isinstance(v, str), "a string", None)
        files = self._weight_files(path)
        header_check = await asyncio.to_thread(self._check_safetensors_headers, files)
        if header_check:
            raise bad(f"model_path {path!r}: {header_check}")
        if _field(body, "abort_all_requests", lambda v: isinstance(v, bool), "a bool", False):
            self._abort(lambda it: True, "aborted by a weight update")
        weights = await self._engine.run(self._read_safetensors, files)
        await self._load(weights, version)
        self.model_path = path
        return self._json({"success": True, "message": f"Succeeded to update model weights from {path}.",
                           "num_paused_requests": 0})

    def _weight_files(self, path: str) -> list[str]:
        """The *.safetensors files of `path`, resolved (symlinks followed), each under --allowed-weight-dirs. A path
        that does not exist and one outside the allowed directories get the same answer: it tells nothing of the disk."""
        if not self.allowed_dirs:
            raise HTTPError(403, "/update_weights_from_disk is refused: this server was started without "
                                 "--allowed-weight-dirs")
        refused = HTTPError(403, f"model_path {path!r} is not a directory of *.safetensors files under "
                                 "--allowed-weight-dirs")

        def allowed(p: str) -> bool:
            return any(os.path.commonpath([p, d]) == d for d in self.allowed_dirs)

        real = os.path.realpath(path)
        if not allowed(real) or not os.path.isdir(real):
            raise refused
        try:
            names = sorted(f for f in os.listdir(real) if f.endswith(".safetensors"))
        except OSError:
            raise refused from None
        files = [os.path.realpath(os.path.join(real, f)) for f in names]
        if not files or not all(allowed(f) and os.path.isfile(f) for f in files):
            raise refused
        return files

    def _check_safetensors_headers(self, files: list[str]) -> str | None:
        """Names, dtypes and shapes from the files' headers, before any tensor is read: what is wrong, or None."""
        from safetensors import safe_open
        seen: set[str] = set()
        for f in files:
            try:
                with safe_open(f, framework="pt", device="cpu") as st:
                    for n in st.keys():
                        sl = st.get_slice(n)
                        shape, dt = list(sl.get_shape()), sl.get_dtype()
                        want = self.wire_shapes.get(n)
                        if want is None:
                            return f"{os.path.basename(f)} holds {n!r}, which this model does not have"
                        if n in seen:
                            return f"{n!r} appears in more than one file"
                        if tuple(shape) != want:
                            return f"{n}: shape {shape} in {os.path.basename(f)}, the model's is {list(want)}"
                        if dt not in WEIGHT_FILE_DTYPES:
                            return f"{n}: dtype {dt} in {os.path.basename(f)}; expected one of {sorted(WEIGHT_FILE_DTYPES)}"
                        seen.add(n)
            except Exception as e:  # a truncated or foreign file: safetensors cannot parse its header
                return f"{os.path.basename(f)} is not a readable safetensors file ({type(e).__name__}: {e})"
        return None

    def _read_safetensors(self, files: list[str]) -> list[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        out = []
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as st:
                out.extend((n, st.get_tensor(n)) for n in st.keys())
        return out

    # ---- running ----------------------------------------------------------------------------------------
    async def start(self) -> str:
        """Bind and serve; returns the base URL (with the real port when --port 0)."""
        logging.getLogger("aiohttp.server").addFilter(_DROP_MALFORMED_HTTP)
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its items
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.url = f"http://{host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        await self._runner.cleanup()


class ServerThread:
    """An EngineServer on its own event loop in a daemon thread (tests, benchmarks): `.url`, `.stop()`."""

    def __init__(self, engine, cfg: ServerConfig, *, model_path: str, seed: int | None = None, timeout: float = 60):
        self.loop = asyncio.new_event_loop()
        self.server = EngineServer(engine, cfg, model_path=model_path, seed=seed)
        self._thread = threading.Thread(target=self.loop.run_forever, name="polyrl-serve", daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


def read_key_file(path: str, flag: str) -> str:
    """The first line of a key file; a missing, unreadable or empty file is a ConfigError naming `flag`."""
    try:
        with open(path) as f:
            key = f.readline().strip()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if not key:
        raise ConfigError(f"{flag} {path}: the file is empty (its first line is the key)")
    if mode & 0o077:
        log.warning("%s %s can be read by other users (mode %o); chmod 600 it", flag, path, mode & 0o777)
    return key


def resolve_api_key(s: ServerConfig) -> str | None:
    """--api-key, else --api-key-file, else the POLYRL_API_KEY environment variable (how polyrl train hands it over)."""
    if s.api_key and s.api_key_file:
        raise ConfigError("--api-key and --api-key-file are alternatives; give one")
    if s.api_key_file:
        return read_key_file(s.api_key_file, "--api-key-file")
    return s.api_key or os.environ.get(API_KEY_ENV) or None


def serve(cfg: Config) -> int:
    """`polyrl serve`: load the engine, listen, print one line with the address, serve until SIGTERM / SIGINT."""
    from polyrl.dist import resolve_device, set_host_threads
    from polyrl.rollout.embedded import engine_from_config

    s = cfg.server
    s.api_key = resolve_api_key(s)  # before the model loads: a refused start costs nothing
    if not is_loopback(s.host) and not s.api_key:
        if not s.allow_unauthenticated_host:
            raise ConfigError(f"--host {s.host} is not a loopback address: give the server a key (--api-key-file PATH, "
                              f"--api-key, or the {API_KEY_ENV} environment variable), or pass "
                              "--allow-unauthenticated-host to let anyone who reaches the port generate")
        log.warning("polyrl serve: --allow-unauthenticated-host: listening on %s WITHOUT an API key; anyone who can "
                    "reach it can generate (weight, memory and control endpoints are refused)", s.host)
    device = resolve_device(cfg.cluster.device)
    set_host_threads(device, 1)
    engine = engine_from_config(cfg, device)
    server = EngineServer(engine, s, model_path=cfg.model.hf_checkpoint, seed=cfg.cluster.seed, device=device)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        url = await server.start()
        print(f"polyrl serve: listening on {url}", flush=True)
        await stop.wait()
        await server.stop()

    asyncio.run(main())
    sys.stdout.flush()
    return 0
