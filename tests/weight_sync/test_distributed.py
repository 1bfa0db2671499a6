"""Weight sync from distributed over gloo into `polyrl serve` subprocesses (CPU, loopback only):
bit-identical read-back after every push, one group across pushes, a rebuilt group after a server
restart, fast failure naming the server, and the disk transport. Each server is started by the
test and stopped by it; every wait is bounded."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from polyrl.rollout.embedded import EmbeddedEngine, make_embedded_engine
from polyrl.rollout.http_client import EngineHTTPError, HTTPClient
from polyrl.types import SamplingParams
from polyrl.weight_sync.distributed import (DiskTransport, DistributedTransport, WeightSyncError, check_weights_equal,
                                            decode_tensor)
from serve_procs import ServeProc, serving

pytestmark = pytest.mark.slow


class FakeEngine:
    """What a transport needs from an HTTP engine: where to send, how, whether the set changed, and which
    servers a failed push lost (none here: every failure is the push's own)."""

    fault_tolerant = False

    def __init__(self, urls: list[str]):
        self.urls = list(urls)
        self.http = HTTPClient()
        self.membership = 0
        self.pushed: list[tuple[int, list]] = []

    def lost_during_sync(self, urls: list[str], err: str, since: int) -> list[str]:
        return []

    def set_weight_source(self, source, transport) -> None:
        raise AssertionError("only a fault-tolerant engine is given a weight source")

    def weight_sync_urls(self) -> list[str]:
        return list(self.urls)

    def weights_pushed(self, version: int, urls: list[str] | None = None) -> None:
        self.pushed.append((version, urls))


def trainer_weights(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights, moved by a step-dependent amount (what training would do)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(step)
    return {n: p.detach() + 0.01 * step * torch.randn(p.shape, generator=g)
            for n, p in model.named_parameters()}  # tied lm_head: one tensor, under the embedding's name


@pytest.fixture(scope="module")
def pair(tiny_model, tmp_path_factory):
    """Two `polyrl serve` processes shared by this module's tests (the restart test, last, replaces one)."""
    weights = tmp_path_factory.mktemp("weights")  # the one directory /update_weights_from_disk may read
    with serving(tiny_model, tmp_path_factory.mktemp("serve"), 2, "--allowed-weight-dirs", str(weights)) as procs:
        for p in procs:
            p.weights_dir = weights
        yield procs


def read_back(http: HTTPClient, url: str, name: str) -> torch.Tensor:
    return decode_tensor(http.call(url, "/get_weights_by_name", {"name": name, "return_format": "base64"}, timeout=30))


def test_disk_transport(tiny_model, pair):
    eng = FakeEngine([p.url for p in pair])
    tmp_path = pair[0].weights_dir
    try:
        w = trainer_weights(tiny_model, 5)
        DiskTransport(1 << 16, check_equal=True, dir=str(tmp_path)).push(iter(w.items()), eng, 5)
        for p in pair:
            assert torch.equal(read_back(eng.http, p.url, "model.embed_tokens.weight"), w["model.embed_tokens.weight"])
        assert not list(tmp_path.glob("polyrl_weights_*"))  # the directory is gone
    finally:
        eng.http.close()


def test_a_refused_bucket_fails_fast_naming_the_server(tiny_model, pair):
    a = pair[0]
    eng = FakeEngine([a.url])
    tr = DistributedTransport(1 << 20, device="cpu", timeout_s=120)
    try:
        w = trainer_weights(tiny_model, 1)
        tr.push(iter(w.items()), eng, 1)
        bad = {"model.norm.weight": torch.zeros(3)}  # the server refuses the shape before the broadcast
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"{a.url}.*model.norm.weight: shape \[3\]"):
            tr.push(iter(bad.items()), eng, 2)
        assert time.monotonic() - t0 < 30  # not the 120 s timeout
        tr.push(iter(w.items()), eng, 3)  # the group is rebuilt and works again
        assert tr.builds == 2
        check_weights_equal(eng.http, [a.url], list(w.items()))
        with pytest.raises(WeightSyncError, match="model.norm.weight on .* differs"):
            check_weights_equal(eng.http, [a.url], [("model.norm.weight", w["model.norm.weight"] + 1)])
    finally:
        tr.close()
        eng.http.close()


@pytest.mark.parametrize("flatten", [True, False])
def test_flattened_and_per_tensor_buckets_arrive_bit_identical(tiny_model, pair, flatten):
    """One dtype per bucket goes as one broadcast of the concatenation (SGLang's load_format
    "flattened_bucket") unless turned off; a bucket of mixed dtypes always goes tensor by tensor."""
    a = pair[0]
    eng = FakeEngine([a.url])
    tr = DistributedTransport(1 << 30, device="cpu", timeout_s=60, flatten=flatten)  # one bucket
    try:
        w = trainer_weights(tiny_model, 7)
        tr.push(iter(w.items()), eng, 7)
        for name, t in w.items():
            assert torch.equal(read_back(eng.http, a.url, name), t)
        # a bf16 tensor among fp32 ones: per tensor; the server casts into its fp32 weights
        mixed = dict(w, **{"model.norm.weight": w["model.norm.weight"].to(torch.bfloat16)})
        tr.push(iter(mixed.items()), eng, 8)
        assert torch.equal(read_back(eng.http, a.url, "model.norm.weight"), mixed["model.norm.weight"].float())
        assert torch.equal(read_back(eng.http, a.url, "model.embed_tokens.weight"), w["model.embed_tokens.weight"])
        assert tr.builds == 1
    finally:
        tr.close()
        eng.http.close()
    # a flattened bucket announced with two dtypes is refused before any broadcast
    http = HTTPClient()
    try:
        with pytest.raises(EngineHTTPError, match="one dtype") as e:
            http.call(a.url, "/update_weights_from_distributed", {
                "names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["float32", "bfloat16"], "shapes": [[4], [4]],
                "group_name": "g", "load_format": "flattened_bucket"}, timeout=10)
        assert e.value.status == 400
    finally:
        http.close()


def test_three_pushes_bit_identical_then_rebuilt_after_a_restart(tiny_model, pair, tmp_path):
    a, b = pair
    eng = FakeEngine([a.url, b.url])
    tr = DistributedTransport(1 << 16, device="cpu", timeout_s=60)  # small buckets: several per push
    try:
        for step in (1, 2, 3):
            w = trainer_weights(tiny_model, step)
            nbytes = tr.push(iter(w.items()), eng, step)
            assert nbytes == sum(t.numel() * t.element_size() for t in w.values())
            for url in eng.urls:
                for name, t in w.items():
                    assert torch.equal(read_back(eng.http, url, name), t), (url, name, step)
                info = eng.http.call(url, "/get_model_info", timeout=10)
                assert info["weight_version"] == str(step)
            assert eng.pushed[-1] == (step, eng.urls)
        assert tr.builds == 1  # the group survived three pushes

        # generation on the server uses the pushed weights: same tokens as an engine given the same stream
        ref = EmbeddedEngine(tiny_model)
        ref.update_weights(iter(w.items()), 3)
        want = ref.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=6))[0].response_ids
        got = eng.http.call(a.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
            "temperature": 0, "max_new_tokens": 6}}, timeout=30)["output_ids"]
        assert got == want

        # server b restarts (a new process, new port): the engine's membership changes, the group is rebuilt
        b.stop()
        b2 = ServeProc(tiny_model, str(tmp_path / "serve_b2.log")).ready()
        try:
            eng.urls[1] = b2.url
            eng.membership += 1
            w = trainer_weights(tiny_model, 4)
            tr.check_equal = True  # and the read-back check passes through the sha256 extension
            tr.push(iter(w.items()), eng, 4)
            assert tr.builds == 2
            for name, t in w.items():
                assert torch.equal(read_back(eng.http, b2.url, name), t)
                assert torch.equal(read_back(eng.http, a.url, name), t)
        finally:
            b2.stop()
    finally:
        tr.close()
        eng.http.close()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_push_into_a_server_on_another_gpu(tmp_path):
    """Trainer on GPU 0, `polyrl serve` (its GPU path) on GPU 1: bf16 weights over NCCL, read back bit-identical;
    then generation on the server equals the same engine given the same weights in this process."""
    from conftest import make_model_dir
    model = make_model_dir(tmp_path / "m", hidden=128, layers=2)
    srv = ServeProc(model, str(tmp_path / "serve.log"), "--bf16", device="cuda", gpu=1).ready(300)
    eng = FakeEngine([srv.url])
    tr = DistributedTransport(1 << 16, device="cuda", timeout_s=120)
    try:
        torch.cuda.set_device(0)
        for step in (1, 2):
            w = {n: t.to("cuda", torch.bfloat16) for n, t in trainer_weights(model, step).items()}
            tr.push(iter(w.items()), eng, step)
            check_weights_equal(eng.http, [srv.url], [(n, t.cpu()) for n, t in w.items()])
            for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
                assert torch.equal(read_back(eng.http, srv.url, name), w[name].cpu())
        assert tr.builds == 1
        ref = make_embedded_engine(model, device="cuda", dtype=torch.bfloat16, mem_fraction=0.2)
        ref.update_weights(iter(w.items()), 2)
        sp = SamplingParams(temperature=1.0, max_new_tokens=16, n=2, prompt_seeds=[11, 12])
        want = [s.response_ids for s in ref.generate([[5, 6, 7], [8, 9]], sp)]
        got = eng.http.call(srv.url, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [
            {"max_new_tokens": 16, "n": 2, "sampling_seed": s} for s in (11, 12)]}, timeout=120)
        assert [o["output_ids"] for o in got] == want
    finally:
        tr.close()
        eng.http.close()
        srv.stop()
