"""Weight sync from distributed: the trainer and every engine server form a process group of
their own, and each bucket of the HF-named stream is announced over HTTP and broadcast.

SGLang's protocol, both sides:
  trainer rank 0 = group rank 0; server k = rank 1 + k (`rank_offset`)
  POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}
       (to every server at once: each blocks in the rendezvous until all have joined)
  per bucket: POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version}
       to every server at once, then broadcast the bucket's tensors from rank 0 in that order
  POST /destroy_weights_update_group {group_name}
NCCL on GPU, gloo on CPU. The group is built from a TCPStore and the backend's ProcessGroup
class directly, so it never touches the trainer's default process group; its store keys follow
torch's layout for a named group (`{group_name}/{device}/...`), the one SGLang's servers use.
Only tensors cross the group; the HTTP side carries JSON metadata (nothing is pickled). The
group is kept across steps and rebuilt when the set of servers changes (`engine.membership`).
Every wait is bounded, and a server that answers with an error ends a broadcast at once.

A server that dies or hangs during a push: the engine says which (`lost_during_sync`). Without
fault tolerance that is one EngineDeadError naming the engine and its log; with it, the push goes
on to the others, and the engine restarts the lost server and re-sends it the last pushed weights
(`push_to`), which rank 0 keeps in host memory for a fault-tolerant engine.

`--check-weight-update-equal` reads every weight back from every server. `polyrl serve` answers
/get_weights_by_name {"return_format": "sha256"} (a polyrl extension) with the digest of the
whole tensor's bytes in its dtype, so the check is exact and cheap; an SGLang server ignores the
field and answers with float lists, compared as such.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import hashlib
import ipaddress
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from polyrl.dist import rank as trainer_rank, world_size as trainer_world
from polyrl.rollout.http_client import EngineHTTPError
from polyrl.weight_sync import buckets

log = logging.getLogger(__name__)

GROUP_NAME = "polyrl_weight_update_group"
RESYNC_GROUP = "polyrl_weight_resync_group"
ABANDONED = "polyrl/abandoned"  # set in a group's store by the trainer when a broadcast on it failed  # one server that came back gets the last weights on a group of its own


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the server(s) and what they said."""


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (C order, native byte order): bit equality in one string."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def encode_tensor(t: torch.Tensor) -> dict:
    """A tensor as JSON: dtype, shape and its raw bytes in base64."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
            "data": base64.b64encode(flat.view(torch.uint8).numpy().tobytes()).decode()}


def decode_tensor(obj: dict) -> torch.Tensor:
    raw = bytearray(base64.b64decode(obj["data"]))
    dt = dtype_from_name(obj["dtype"])
    return torch.frombuffer(raw, dtype=dt).reshape(obj["shape"]) if raw else torch.empty(obj["shape"], dtype=dt)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (loopback for a loopback peer)."""
    if is_loopback(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # a UDP connect sends nothing: it only picks the route
        return s.getsockname()[0]


def new_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
              timeout_s: float, store: dist.Store | None = None):
    """A process group outside torch.distributed's default one (both the trainer and a server may
    have their own). Rank 0 passes the TCPStore it opened (port 0: the OS picks a free one);
    the others connect to it. Returns (backend process group, store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
    named = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # bind where the peers reach us (loopback stays loopback), not wherever the hostname resolves
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(master_address))]
        pg = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", named), rank, world_size, opts)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", named), rank, world_size, opts)
    else:
        raise ValueError(f"weight-update group backend {backend!r}: expected nccl or gloo")
    return pg, store


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as a collective moves it: FP8 as its bytes (gloo has no float8 type; NCCL moves them as bytes too)."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _broadcast_opts() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    return opts


def broadcast(pg, tensor: torch.Tensor, timeout_s: float) -> None:
    work = pg.broadcast([tensor], _broadcast_opts())
    if not work.wait(datetime.timedelta(seconds=timeout_s)):
        raise WeightSyncError(f"broadcast did not finish within {timeout_s:.0f} s")


class WeightReceiver:
    """Server side: joins the trainer's group and receives buckets into tensors on `device`.
    Blocking calls: `polyrl serve` runs them on a thread of their own, off its event loop."""

    def __init__(self, device: torch.device):
        self.device = device
        self.groups: dict[str, tuple] = {}

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
                   backend: str, timeout_s: float = 300.0) -> None:
        self.destroy_group(group_name)
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA device; this server runs on CPU (use gloo)")
        self.groups[group_name] = (*new_group(backend, master_address, int(master_port), int(rank_offset), int(world_size),
                                              group_name, timeout_s), timeout_s)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                load_format: str | None = None) -> list[tuple[str, torch.Tensor]]:
        """load_format "flattened_bucket" (SGLang's name): the bucket's tensors, all of one dtype, arrive as
        one broadcast of their concatenation; otherwise one broadcast per tensor, in order."""
        if group_name not in self.groups:
            raise ValueError(f"no weight-update group {group_name!r}: call /init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        pg, _, timeout_s = self.groups[group_name]
        nccl = self.device.type == "cuda" and type(pg).__name__ == "ProcessGroupNCCL"
        dev = self.device if nccl else torch.device("cpu")
        shapes = [[int(x) for x in s] for s in shapes]
        if load_format == "flattened_bucket":
            if len(set(dtypes)) > 1:
                raise ValueError(f"a flattened bucket holds one dtype, got {sorted(set(dtypes))}")
            sizes = [math.prod(s) for s in shapes]
            flat = torch.empty(sum(sizes), dtype=dtype_from_name(dtypes[0]), device=dev)
            works = [pg.broadcast([_wire(flat)], _broadcast_opts())]
            out = [(n, x.view(s)) for n, x, s in zip(names, flat.split(sizes), shapes)]
        else:
            out = [(n, torch.empty(s, dtype=dtype_from_name(d), device=dev)) for n, d, s in zip(names, dtypes, shapes)]
            works = [pg.broadcast([_wire(t)], _broadcast_opts()) for _, t in out]  # all posted at once: no per-tensor round trip
        _wait_or_abandoned(works, self.groups[group_name][1], timeout_s)
        if nccl:
            torch.cuda.current_stream(dev).synchronize()  # the engine thread reads them next
        return out

    def destroy_group(self, group_name: str) -> bool:
        g = self.groups.pop(group_name, None)
        if g is not None:
            _shutdown(g[0])
        return g is not None


def _wait_or_abandoned(works: list, store, timeout_s: float) -> None:
    """Until the broadcasts completed; a trainer that gave up on them (a peer was lost) says so in the store."""
    deadline = time.monotonic() + timeout_s
    next_look = time.monotonic() + 0.2
    while not all(w.is_completed() for w in works):
        now = time.monotonic()
        if now > next_look:  # a round trip to the trainer's store, so not at every poll
            if store.check([ABANDONED]):
                raise WeightSyncError("the trainer abandoned this broadcast (another server of the group failed)")
            next_look = now + 0.2
        if now > deadline:
            raise WeightSyncError(f"broadcast did not finish within {timeout_s:.0f} s")
        time.sleep(0.0005)
    for w in works:
        w.wait()  # raises a failed work's error


def _shutdown(pg) -> None:
    try:
        pg.shutdown() if hasattr(pg, "shutdown") else pg.abort()
    except Exception:  # a peer that died already, or a backend without either: nothing to release cleanly
        pass


def _failed(ans: Any) -> bool:
    return isinstance(ans, dict) and ans.get("success") is False


def _refused(f: concurrent.futures.Future) -> bool:
    """A weight-update call that a live server answered with an error (not one that got no answer)."""
    e = f.exception()
    return _failed(f.result()) if e is None else isinstance(e, EngineHTTPError) and e.status is not None


def _answers(futs: dict, wait_s: float) -> str:
    """What each server has said so far, for an error message."""
    out = []
    for url, f in futs.items():
        try:
            ans = f.result(wait_s)
            out.append(f"{url}: {ans.get('message') if _failed(ans) else 'ok'}")
        except concurrent.futures.TimeoutError:
            out.append(f"{url}: no answer yet")
        except Exception as e:
            out.append(f"{url}: {e}")
    return "; ".join(out)


def _check_answers(futs: dict, what: str, timeout_s: float) -> None:
    for url, f in futs.items():
        try:
            ans = f.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(f"{url}{what}: no answer within {timeout_s:.0f} s") from None
        except Exception as e:
            raise WeightSyncError(f"{what} failed on {url}: {e}") from None
        if _failed(ans):
            raise WeightSyncError(f"{url}{what}: {ans.get('message')}")


class _Targets:
    """The servers of the engines a push goes to (one HTTP client: every engine of a job shares the api key).
    urls: only these (a re-sync), else every server each engine names."""

    def __init__(self, engines: list, urls: list[str] | None = None):
        self.engines = engines
        self.http = engines[0].http
        self.urls = list(urls) if urls is not None else [u for e in engines for u in e.weight_sync_urls()]
        self.membership = tuple(e.membership for e in engines)

    def gone(self) -> list[str]:
        """Targets their engine no longer counts as live (its health check found them dead or hung), or all of
        them once a server was restarted since (a new process at the same address is not in this group)."""
        if tuple(getattr(e, "membership", 0) for e in self.engines) != self.membership:
            return list(self.urls)
        live = {u for e in self.engines for u in e.weight_sync_urls()}
        return [u for u in self.urls if u not in live]


class _ServerTransport:
    """Rank 0 sends and checks; every trainer rank walks the stream (FSDP's export is collective)
    and learns from rank 0 how it went, so all ranks raise, or all record the new version."""

    def __init__(self, bucket_bytes: int, timeout_s: float, check_equal: bool):
        self.bucket_bytes, self.timeout_s, self.check_equal = bucket_bytes, timeout_s, check_equal
        self._lock = threading.Lock()  # a push and a re-sync of a restarted server never interleave
        self._last: tuple[list[tuple[str, torch.Tensor]], int] | None = None  # host copy of the last push (rank 0)

    def push(self, stream: Iterable[tuple[str, torch.Tensor]], engine, version: int) -> int:
        """Send the stream to every server of `engine`; returns the bytes of the stream (not times the servers)."""
        engines = [engine]
        rank, world = trainer_rank(), trainer_world()
        outcome: list = [None, None, False]  # error message, urls that got the weights, whether an engine died
        total = 0
        it = iter(stream)  # once: a WeightExport restarts its (collective) export at each iter()
        if rank == 0:
            with self._lock:
                try:
                    total, outcome[1] = self._push_rank0(it, engines, version)
                except Exception as e:
                    for _ in it:  # the other ranks' export is collective: they walk the whole stream
                        pass
                    if world == 1:
                        raise
                    outcome[0] = str(e) if isinstance(e, WeightSyncError) else f"{type(e).__name__}: {e}"
                    outcome[2] = _is_engine_dead(e)
        else:
            for _ in it:
                pass
        if world > 1:
            dist.broadcast_object_list(outcome, src=0)
            if outcome[0] is not None:
                if outcome[2]:
                    from polyrl.rollout.http_engine import EngineDeadError
                    raise EngineDeadError(outcome[0])
                raise WeightSyncError(outcome[0])
        for e in engines:
            e.weights_pushed(version, outcome[1])
        return total

    def _push_rank0(self, it: Iterator, engines: list, version: int) -> tuple[int, list[str]]:
        """Rank 0's part: send, and on a server lost mid-push (fault tolerance) finish on the others from the host copy."""
        keep = self.check_equal or any(e.fault_tolerant for e in engines)
        self._last = None  # never two host copies at once
        kept: list[tuple[str, torch.Tensor]] | None = [] if keep else None

        def tee():
            for name, x in it:
                if kept is not None:
                    kept.append((name, x.detach().to("cpu", copy=True)))
                yield name, x

        src = tee()
        t = _Targets(engines)
        if not t.urls and kept is None:
            raise WeightSyncError("no live engine server to send weights to")
        total = 0
        for attempt in range(len(t.urls) + 1):
            if not t.urls:  # every server is restarting: each gets these weights when it is back
                for _ in src:
                    pass
                break
            try:
                total = self._send(src, t, version)
                break
            except WeightSyncError as err:
                # raises without fault tolerance
                lost = [u for e, m in zip(engines, t.membership) for u in e.lost_during_sync(t.urls, str(err), m)]
                if not lost or kept is None:
                    raise
                for _ in src:  # the rest of the stream, into the host copy
                    pass
                log.warning("weight sync v%d: %s lost during the push; sending to the others", version, ", ".join(lost))
                src, t = iter(kept), _Targets(engines)
        else:
            raise WeightSyncError(f"weight sync v{version}: a server was lost at every attempt")
        if not t.urls:
            total = sum(x.numel() * x.element_size() for _, x in kept)
        if self.check_equal and t.urls:
            check_weights_equal(t.http, t.urls, kept, timeout_s=self.timeout_s)
        if kept is not None:
            self._last = (kept, version)
            for e in engines:
                if e.fault_tolerant:
                    e.set_weight_source(self.last_weights, self)
        return total, t.urls

    def last_weights(self) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
        """The last pushed (name, tensor) stream and its version: what a restarted server must hold."""
        if self._last is None:
            raise WeightSyncError("no weights pushed yet")
        return iter(self._last[0]), self._last[1]

    def push_to(self, source: Callable[[], tuple[Iterable[tuple[str, torch.Tensor]], int]], engine, urls: list[str]) -> int:
        """Rank 0 only, no collective: `source()`'s weights to these servers of `engine` (a restarted one), read
        under the push lock so that it is the newest stream; returns the version they now hold."""
        with self._lock:
            stream, version = source()
            self._send_to(iter(stream), _Targets([engine], urls), version)
        engine.weights_pushed(version, urls)
        return version

    def _send(self, stream, t: _Targets, version: int) -> int:
        raise NotImplementedError

    def _send_to(self, stream, t: _Targets, version: int) -> int:
        return self._send(stream, t, version)


def _is_engine_dead(e: Exception) -> bool:
    return type(e).__name__ == "EngineDeadError"


class DistributedTransport(_ServerTransport):
    """Trainer side of weight sync from distributed (`--weight-sync distributed`).
    master_address: where the servers reach this trainer (default: this machine's address on the
    route to the first server; 127.0.0.1 for loopback servers)."""

    def __init__(self, bucket_bytes: int, *, device: str, timeout_s: float = 600.0, check_equal: bool = False,
                 master_address: str | None = None, flatten: bool = True):
        super().__init__(bucket_bytes, timeout_s, check_equal)
        self.flatten = flatten  # SGLang's load_format "flattened_bucket" (polyrl serve and SGLang >= 0.5 take it)
        self.backend = "nccl" if device.startswith("cuda") else "gloo"
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device)
        self.master_address = master_address
        self.pg = None
        self._store = None
        self._key = None  # (urls, membership) the group was built for
        self._members: _Targets | None = None
        self._broken: list = []  # groups dropped mid-broadcast: kept alive, their threads may still be waiting
        self.builds = 0

    def _ensure_group(self, t: _Targets) -> None:
        key = (tuple(t.urls), t.membership)
        if self.pg is not None and key == self._key:
            return
        if self.pg is not None:  # a server was restarted or left: rebuild with the current set
            log.warning("weight sync: the engine servers changed; rebuilding the weight-update group")
            self.close()
        self.pg, self._store = self._form_group(t, GROUP_NAME)
        self._key, self._members = key, t
        self.builds += 1
        log.info("weight-update group formed with %d servers (%s)", len(t.urls), self.backend)

    def _form_group(self, t: _Targets, group_name: str) -> tuple:
        host = self.master_address or local_address_towards(urlparse(t.urls[0]).hostname or "127.0.0.1")
        world = 1 + len(t.urls)
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=self.timeout_s),
                              wait_for_workers=False)
        futs = {u: t.http.call_async(u, "/init_weights_update_group", {
            "master_address": host, "master_port": store.port, "rank_offset": 1 + k, "world_size": world,
            "group_name": group_name, "backend": self.backend}, timeout=self.timeout_s) for k, u in enumerate(t.urls)}
        try:
            pg, store = new_group(self.backend, host, store.port, 0, world, group_name, self.timeout_s, store)
        except Exception as e:
            raise WeightSyncError(f"forming the weight-update group ({self.backend}, master {host}:{store.port}) with "
                                  f"{', '.join(t.urls)} failed: {e}; servers: {_answers(futs, 5)}") from None
        _check_answers(futs, "/init_weights_update_group", self.timeout_s)
        return pg, store

    def _send(self, stream, t: _Targets, version: int) -> int:
        self._ensure_group(t)
        return self._broadcast_stream(self.pg, GROUP_NAME, stream, t, version, self._drop)

    def _send_to(self, stream, t: _Targets, version: int) -> int:
        """A group of its own for these servers (a restarted one), gone afterwards: the main group stays as it is."""
        pg, store = self._form_group(t, RESYNC_GROUP)
        broken = False
        def drop():
            nonlocal broken
            broken = True
            self._abandon(pg, store)
        try:
            return self._broadcast_stream(pg, RESYNC_GROUP, stream, t, version, drop)
        finally:
            if not broken:
                futs = {u: t.http.call_async(u, "/destroy_weights_update_group", {"group_name": RESYNC_GROUP}, timeout=30)
                        for u in t.urls}
                for f in futs.values():
                    try:
                        f.result(35)
                    except Exception:  # the server died meanwhile: nothing of the group is left there
                        pass
                _shutdown(pg)

    def _broadcast_stream(self, pg, group_name: str, stream, t: _Targets, version: int, drop: Callable[[], None]) -> int:
        total = 0
        for k, bucket in enumerate(buckets(stream, self.bucket_bytes)):
            xs = [x.detach().to(self.device).contiguous() for _, x in bucket]
            meta = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(x.dtype) for x in xs],
                    "shapes": [list(x.shape) for x in xs], "group_name": group_name, "flush_cache": True,
                    "weight_version": str(version)}
            # one dtype (the usual case): one broadcast of the concatenation instead of one per tensor, since a
            # bucket holds hundreds of small tensors and each broadcast costs a launch on both sides
            flat = len(set(meta["dtypes"])) == 1 and self.flatten
            if flat:
                meta["load_format"] = "flattened_bucket"
            futs = {u: t.http.call_async(u, "/update_weights_from_distributed", meta, timeout=self.timeout_s) for u in t.urls}
            sends = [torch.cat([_wire(x).reshape(-1) for x in xs])] if flat else [_wire(x) for x in xs]
            works = [pg.broadcast([x], _broadcast_opts()) for x in sends]
            self._wait(works, futs, t, f"bucket {k} ({len(xs)} tensors from {bucket[0][0]})", drop)
            _check_answers(futs, "/update_weights_from_distributed", self.timeout_s)
            total += sum(x.numel() * x.element_size() for x in xs)
        return total

    def _wait(self, works: list, futs: dict, t: _Targets, what: str, drop: Callable[[], None]) -> None:
        """Until every broadcast of a bucket completed. A server that answers with an error (it will
        never take its part) or that its engine found dead or hung ends the wait at once rather than
        at the timeout; either way the group is dropped (and rebuilt on the next push)."""
        deadline = time.monotonic() + self.timeout_s
        next_look = time.monotonic() + 0.5
        while not all(w.is_completed() for w in works):
            refused = [u for u, f in futs.items() if f.done() and _refused(f)]  # live, but will not take this bucket
            gave_up = refused or [u for u, f in futs.items() if f.done() and f.exception() is not None]
            if not gave_up and time.monotonic() > next_look:  # the engine's health checks see a hung server
                gave_up, next_look = t.gone(), time.monotonic() + 0.5
            if gave_up or time.monotonic() > deadline:
                drop()
                # the others leave the abandoned group first (each answers once it has destroyed it), so that a
                # rebuilt group of the same name is not destroyed by their late answer
                concurrent.futures.wait([f for u, f in futs.items() if u not in gave_up], timeout=10)
                why = (f"{', '.join(refused)} refused it; " if refused else f"{', '.join(gave_up)} gone; " if gave_up
                       else f"not finished within {self.timeout_s:.0f} s; ")
                raise WeightSyncError(f"broadcasting {what} failed: {why}servers: {_answers(futs, 0)}")
            time.sleep(0.0005)
        try:
            for w in works:
                w.wait()
        except Exception as e:
            drop()
            concurrent.futures.wait(list(futs.values()), timeout=10)  # as above: the servers leave the group first
            raise WeightSyncError(f"broadcasting {what} failed: {e}; servers: {_answers(futs, 0)}") from None

    def _drop(self) -> None:
        if self.pg is not None:
            self._abandon(self.pg, self._store)
        self.pg = self._store = self._key = self._members = None

    def _abandon(self, pg, store) -> None:
        """A group whose broadcast failed: the servers still waiting in it see ABANDONED in its store and give up
        at once (their weight-update thread is free for the next group) rather than at the timeout. Kept alive:
        destroying it now could wait for its stuck work."""
        try:
            store.set(ABANDONED, "1")
        except Exception:  # the store is ours and local: failing here leaves the servers their own timeout
            pass
        self._broken.append((pg, store))

    def close(self) -> None:
        """The servers the group was built with leave it (/destroy_weights_update_group), then we do."""
        if self.pg is None:
            return
        t = self._members
        futs = {u: t.http.call_async(u, "/destroy_weights_update_group", {"group_name": GROUP_NAME}, timeout=30)
                for u in t.urls}
        for f in futs.values():
            try:
                f.result(35)
            except Exception:  # a restarted server no longer has the group
                pass
        _shutdown(self.pg)
        self.pg = self._store = self._key = self._members = None


def check_weights_equal(http, urls: list[str], sent: list[tuple[str, torch.Tensor]], *, timeout_s: float = 120.0) -> None:
    """Read every weight back from every server and require bit equality with what was sent, in
    the engine's dtype. `polyrl serve` answers with a sha256 of the whole tensor; an SGLang server
    (which ignores return_format) with its rows as floats. FP8 weights (--rollout-quantization fp8) are compared
    as the engine holds them: dequantized."""
    from polyrl.weight_sync.quantize import dequantize_stream
    sent = list(dequantize_stream(sent))
    futs = [(url, name, x, http.call_async(url, "/get_weights_by_name", {
        "name": name, "return_format": "sha256", "truncate_size": max(1, x.shape[0] if x.dim() else 1)}, timeout=timeout_s))
        for url in urls for name, x in sent]
    for url, name, x, f in futs:
        try:
            got = f.result(timeout_s + 5)
        except Exception as e:
            raise WeightSyncError(f"--check-weight-update-equal: reading {name} back from {url} failed: {e}") from None
        why = _mismatch(x, got)
        if why:
            raise WeightSyncError(f"--check-weight-update-equal: {name} on {url} differs from the trainer's ({why})")


def _mismatch(x: torch.Tensor, got: Any) -> str | None:
    if isinstance(got, dict) and "sha256" in got:
        if list(got["shape"]) != list(x.shape):
            return f"shape {got['shape']} vs {list(x.shape)}"
        ref = digest(x.to(dtype_from_name(got["dtype"])))  # the engine holds the cast of what it was sent
        return None if ref == got["sha256"] else f"sha256 of its {got['dtype']} bytes differs"
    if got is None:
        return "missing"
    back = torch.tensor(got, dtype=torch.float64)
    if back.numel() != x.numel():
        return f"read back {back.numel()} values, sent {x.numel()}"
    back = back.reshape(x.shape)
    # the engine's dtype is not in SGLang's answer: equal to what was sent, or to its cast to a 16-bit type
    if any(torch.equal(back, x.to(dt).double()) for dt in (x.dtype, torch.bfloat16, torch.float16)):
        return None
    return f"max |diff| {(back - x.double()).abs().max().item():.3g}"


def private_weight_dir() -> str:
    """Where --weight-sync disk writes by default: this user's own directory (mode 0700) under the temp dir, the one
    directory the servers polyrl launches may load weights from (polyrl serve --allowed-weight-dirs)."""
    d = os.path.join(tempfile.gettempdir(), f"polyrl-weights-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{d} must be a directory owned by this user with mode 0700 (engine servers load weights "
                           "from it); remove it and start again")
    return d


class DiskTransport(_ServerTransport):
    """`--weight-sync disk`: rank 0 writes the stream as safetensors files (one per bucket) into a
    fresh directory that every server can read (same machine or shared filesystem), every server
    loads it (/update_weights_from_disk), and the directory is removed. hf_checkpoint: its *.json
    files (config, tokenizer) are copied in too, which SGLang needs to load a directory."""

    def __init__(self, bucket_bytes: int, *, check_equal: bool = False, timeout_s: float = 600.0, dir: str | None = None,
                 hf_checkpoint: str | None = None):
        super().__init__(bucket_bytes, timeout_s, check_equal)
        self.dir, self.hf_checkpoint = dir, hf_checkpoint

    def _send(self, stream, t: _Targets, version: int) -> int:
        from safetensors.torch import save_file
        d = tempfile.mkdtemp(prefix=f"polyrl_weights_v{version}_", dir=self.dir or private_weight_dir())
        try:
            total, index = 0, {}
            for k, bucket in enumerate(buckets(stream, self.bucket_bytes)):
                # clone: tied weights share storage, which safetensors refuses to write
                tensors = {n: x.detach().to("cpu").contiguous().clone() for n, x in bucket}
                fname = f"model-{k:05d}.safetensors"
                save_file(tensors, os.path.join(d, fname))
                index.update(dict.fromkeys(tensors, fname))
                total += sum(x.numel() * x.element_size() for x in tensors.values())
            with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
            if self.hf_checkpoint:
                for name in os.listdir(self.hf_checkpoint):
                    if name.endswith(".json") and not name.endswith(".index.json"):
                        shutil.copy(os.path.join(self.hf_checkpoint, name), d)
            futs = {u: t.http.call_async(u, "/update_weights_from_disk", {"model_path": d, "weight_version": str(version)},
                                         timeout=self.timeout_s) for u in t.urls}
            _check_answers(futs, "/update_weights_from_disk", self.timeout_s)
            return total
        finally:
            shutil.rmtree(d, ignore_errors=True)
