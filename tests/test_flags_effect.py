"""Rollout, algorithm and engine flags checked for their effect through `polyrl train` on CPU (tiny model, in process):
--rollout-stop and --rollout-stop-token-ids (each response ends at the first stop), --rollout-seed (same seed same
samples, another seed other samples), --disable-grpo-std-normalization (the advantages the loss saw),
--update-weight-buffer-size (the buckets each weight push is cut into), --custom-generate-concurrency (calls in
flight), --rollout-engine-log-dir (where server logs go), --weight-sync disk (every step reaches the server),
--sglang-router-policy (the router's policy), --dist-backend (the backend the process group is made with) and
--[no-]rollout-gpu-engine / --[no-]rollout-cuda-graph (the engine path on CUDA, also of launched servers). The
samples of a step are read back from --save-debug-rollout-data; sampling draws each token from (seed, position) per
response, so a response does not depend on when the others in its batch stopped."""

from __future__ import annotations

import collections
import json

import pytest

from polyrl.cli import main

REWARD = '''
def digits(sample):
    """partial credit so advantages are non-zero on an untrained model"""
    return sum(c.isdigit() for c in sample.response) / 8.0
'''


@pytest.fixture
def base(tiny_model, arith_data, tmp_path):
    rm = tmp_path / "rm.py"
    rm.write_text(REWARD)
    return ["train", "--hf-checkpoint", tiny_model, "--prompt-data", arith_data["train"], "--custom-rm-path", f"{rm}:digits",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "12",
            "--device", "cpu", "--quiet", "--seed", "3"]


def rollout(base: list[str], tmp_path, name: str, *extra: str, steps: int = 1, train: bool = False) -> list[list[dict]]:
    """Each step's samples (as dicts) of a run; generation and scoring only unless `train`."""
    saved = str(tmp_path / name / "rollouts" / "{rollout_id}.jsonl")
    argv = [*base, "--num-rollout", str(steps), "--run-dir", str(tmp_path / name), "--save-debug-rollout-data", saved,
            *extra, *([] if train else ["--debug-rollout-only"])]
    assert main(argv) == 0
    return [[json.loads(line) for line in open(saved.format(rollout_id=k))][1:] for k in range(steps)]


def tokens(step: list[dict]) -> list[list[int]]:
    return [s["response_ids"] for s in step]


def test_rollout_stop_strings_and_token_ids_end_each_response_at_the_first_stop(base, tmp_path, tiny_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    (free,) = rollout(base, tmp_path, "free")
    # the token that most responses carry before their last position: the stop to test with
    counts = collections.Counter(t for ids in tokens(free) for t in set(ids[:-1]))
    stop_id, n = counts.most_common(1)[0]
    stop_text = tok.decode([stop_id])
    assert n >= 4 and stop_text.strip(), (stop_id, stop_text, n)  # the stop cuts several responses

    def cut(ids: list[int], hit) -> tuple[list[int], str | None]:
        for i in range(len(ids)):
            if hit(ids, i):
                return ids[:i + 1], "stop"  # the stop itself is kept, as SGLang does
        return ids, None

    by_id = cut_runs = 0
    (got,) = rollout(base, tmp_path, "stop_ids", "--rollout-stop-token-ids", str(stop_id))
    for a, b in zip(free, got):
        want, reason = cut(a["response_ids"], lambda ids, i: ids[i] == stop_id)
        assert b["response_ids"] == want, (a["response_ids"], b["response_ids"])
        assert b["finish_reason"] == (reason or a["finish_reason"])
        by_id += reason is not None
    # a stop string is matched in the decoded text (the tail of the response), wherever the tokens split it
    (got,) = rollout(base, tmp_path, "stop_text", "--rollout-stop", stop_text)
    for a, b in zip(free, got):
        want, reason = cut(a["response_ids"], lambda ids, i: stop_text in tok.decode(ids[max(0, i - 15):i + 1],
                                                                                      skip_special_tokens=True))
        assert b["response_ids"] == want and b["response"].endswith(stop_text) == (reason is not None), b
        cut_runs += reason is not None
    assert by_id >= 4 and cut_runs >= 4


def test_rollout_seed_same_seed_same_samples_other_seed_other_samples(base, tmp_path):
    (a,) = rollout(base, tmp_path, "a", "--rollout-seed", "7")
    (b,) = rollout(base, tmp_path, "b", "--rollout-seed", "7")
    (c,) = rollout(base, tmp_path, "c", "--rollout-seed", "8")
    assert tokens(a) == tokens(b)
    assert [s["rollout_logprobs"] for s in a] == [s["rollout_logprobs"] for s in b]
    assert [s["prompt_ids"] for s in a] == [s["prompt_ids"] for s in c]  # --seed draws the prompts, not --rollout-seed
    # 16 responses of 12 tokens sampled at temperature 1 from a near-uniform model: another seed changes nearly all
    assert sum(x != y for x, y in zip(tokens(a), tokens(c))) >= 12


def _token_mean_adv(samples: list[dict], normalize_std: bool) -> float:
    """Token mean of GRPO's per-sequence advantages (groups of 4): (r - mean) / (unbiased std + 1e-6), or r - mean."""
    total = 0.0
    for g in range(0, len(samples), 4):
        group = samples[g:g + 4]
        r = [s["reward"] for s in group]
        mean = sum(r) / 4
        std = (sum((x - mean) ** 2 for x in r) / 3) ** 0.5
        total += sum(((x - mean) / (std + 1e-6) if normalize_std else x - mean) * len(s["response_ids"])
                     for x, s in zip(r, group))
    return total / sum(len(s["response_ids"]) for s in samples)


def test_disable_grpo_std_normalization_reaches_the_advantages(base, tmp_path):
    """On a step's single optimizer step the ratio is exactly 1, so pg_loss = -(token mean of the advantages): with the
    flag the group's std no longer divides them (fp32 sums of 16 terms: 1e-5)."""
    for flag, normalize in (([], True), (["--disable-grpo-std-normalization"], False)):
        name = "off" if flag else "on"
        (samples,) = rollout(base, tmp_path, name, "--lr", "1e-3", *flag, train=True)
        row = json.loads(open(tmp_path / name / "metrics.jsonl").readline())
        assert len({s["reward"] for s in samples}) > 1
        other = -_token_mean_adv(samples, not normalize)
        assert row["pg_loss"] == pytest.approx(-_token_mean_adv(samples, normalize), abs=1e-5)
        assert abs(row["pg_loss"] - other) > 1e-3, (row["pg_loss"], other)  # the two settings are told apart


@pytest.mark.slow
def test_update_weight_buffer_size_sets_the_buckets_of_each_push(base, tmp_path, monkeypatch, tiny_model):
    """Through an engine server (the distributed transport cuts the HF-named stream into buckets): every push sends the
    whole model in buckets of at most the size, a tensor larger than it alone."""
    import os

    from safetensors.torch import load_file

    import polyrl.weight_sync.distributed as wsd
    seen: list[tuple[int, list[int]]] = []  # per push: (bucket bytes, bytes in each bucket)
    real = wsd.buckets

    def recording(stream, bucket_bytes):
        sizes: list[int] = []
        seen.append((bucket_bytes, sizes))
        for bucket in real(stream, bucket_bytes):
            sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
            yield bucket

    monkeypatch.setattr(wsd, "buckets", recording)
    weights = {}
    for f in os.listdir(tiny_model):
        if f.endswith(".safetensors"):
            weights.update(load_file(os.path.join(tiny_model, f)))
    weights.pop("lm_head.weight", None)  # tied to the embedding: sent once, under the embedding's name
    total = sum(t.numel() * t.element_size() for t in weights.values())
    largest = max(t.numel() * t.element_size() for t in weights.values())
    # one run: the flag reaches every push of a real sync (buckets of the largest tensor's size: several tensors share
    # one, none holds more than that size)
    rollout(base, tmp_path, "bucketed", "--update-weight-buffer-size", str(largest), "--rollout-engine", "server",
            train=True)
    assert seen and all(b == largest and sum(s) == total for b, s in seen), seen  # every push, whole model
    assert 1 < len(seen[-1][1]) < len(weights) and max(seen[-1][1]) <= largest
    # the extremes on the same stream, without a run each: the whole tiny model in one bucket; one tensor per bucket
    for size, count in ((1 << 30, 1), (1, len(weights))):
        seen.clear()
        assert sum(1 for _ in wsd.buckets(iter(weights.items()), size)) == count and sum(seen[0][1]) == total


BOUNDED = '''
import asyncio, os
state = {"in_flight": 0, "max": 0}
async def generate(record, sp, engine, tok):
    state["in_flight"] += 1
    state["max"] = max(state["max"], state["in_flight"])
    # hold each call until the bound is reached (at most ~2 s: the step's last calls may be fewer), so an unbounded
    # caller, which starts all 16 calls at once, shows more in flight than the bound
    for _ in range(200):
        if state["in_flight"] >= int(os.environ["POLYRL_TEST_BOUND"]):
            break
        await asyncio.sleep(0.01)
    (s,) = await engine.generate(record.prompt_ids, sp)
    state["in_flight"] -= 1
    with open(os.environ["POLYRL_TEST_MAX"], "w") as f:
        f.write(str(state["max"]))
    return s
'''


def test_custom_generate_concurrency_bounds_the_calls_in_flight(base, tmp_path, monkeypatch):
    fn = tmp_path / "bounded.py"
    fn.write_text(BOUNDED)
    monkeypatch.setenv("POLYRL_TEST_BOUND", "3")
    monkeypatch.setenv("POLYRL_TEST_MAX", str(tmp_path / "max.txt"))
    (samples,) = rollout(base, tmp_path, "bounded", "--custom-generate-function-path", f"{fn}:generate",
                         "--custom-generate-concurrency", "3")
    assert len(samples) == 16 and (tmp_path / "max.txt").read_text() == "3"


@pytest.mark.slow
def test_rollout_engine_log_dir_receives_the_engine_servers_logs(base, tmp_path):
    logs = tmp_path / "engine_logs"
    rollout(base, tmp_path, "logged", "--rollout-engine", "server", "--rollout-engine-log-dir", str(logs))
    written = [p for p in logs.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert written, f"nothing written under {logs}"
    assert not (tmp_path / "logged" / "engines").exists()  # the default place, RUN_DIR/engines, is not used


@pytest.mark.slow
def test_weight_sync_disk_delivers_every_step_to_the_engine_server(base, tmp_path):
    """--weight-sync disk over three steps with read-back (--check-weight-update-equal): each step's samples come from
    the weights pushed after the step before (the version the server reports), and the server's log-probs of them equal
    the trainer's (fp32 CPU on both sides: 1e-4, as for the in-process engine). lr 1e-2 moves the policy each step by
    far more than that, so weights that stayed behind would show."""
    steps = rollout(base, tmp_path, "disk", "--rollout-engine", "server", "--weight-sync", "disk",
                    "--check-weight-update-equal", "--lr", "1e-2", steps=3, train=True)
    assert [sorted({s["weight_version"] for s in step}) for step in steps] == [[0], [1], [2]]
    rows = [json.loads(line) for line in open(tmp_path / "disk" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), [r["train_rollout_logprob_abs_diff"] for r in rows]
    assert rows[-1]["loss"] != rows[0]["loss"]


@pytest.mark.slow
def test_sglang_router_policy_reaches_the_router(base, tmp_path, monkeypatch):
    """--sglang-router-policy is the router's --policy (--help: "sglang-router --policy"): the router process is started
    with it, and the step's samples come back through it."""
    import polyrl.rollout.router as router
    started: list[list[str]] = []
    real = router.spawn

    def recording(cmd, **kw):
        started.append(list(cmd))
        return real(cmd, **kw)

    monkeypatch.setattr(router, "spawn", recording)
    (samples,) = rollout(base, tmp_path, "routed", "--rollout-engine", "server", "--rollout-num-engines", "2",
                         "--use-sglang-router", "--sglang-router-policy", "round_robin")
    cmds = [c for c in started if "polyrl.rollout.router" in c]
    assert len(cmds) == 1 and cmds[0][cmds[0].index("--policy") + 1] == "round_robin", started
    assert len(samples) == 16


def test_dist_backend_is_the_backend_of_the_process_group(monkeypatch):
    """CUDA runs are checked through the call that makes the group (this machine has no NCCL); a CPU run makes it."""
    import torch
    import torch.distributed as dist

    from polyrl.assemble import setup_command
    from polyrl.config import Config
    real_init, asked = dist.init_process_group, []

    def init(backend=None, **kw):  # record what the group was asked for, then make a one-rank gloo group
        asked.append(backend)
        real_init(backend="gloo", **kw)

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    for device, flag, want in (("cuda", "gloo", "gloo"), ("cuda", "nccl", "cpu:gloo,cuda:nccl"),
                               ("cuda", "auto", "cpu:gloo,cuda:nccl"), ("cpu", "auto", "gloo"), ("cpu", "gloo", "gloo")):
        cfg = Config()
        cfg.cluster.device, cfg.cluster.dist_backend = device, flag
        monkeypatch.setattr(dist, "init_process_group", init)
        device_out, rank = setup_command(cfg)
        assert (device_out, rank.rank, rank.world) == (device, 0, 1)
        assert asked[-1] == want, (device, flag, asked)
        dist.destroy_process_group()
    monkeypatch.setattr(dist, "init_process_group", real_init)
    cfg = Config()
    cfg.cluster.device, cfg.cluster.dist_backend = "cpu", "gloo"
    setup_command(cfg)
    assert dist.get_backend() == "gloo"  # (2 ranks in a gloo group under Ray: tests/orchestration/test_ray_flags.py)


def test_rollout_gpu_engine_and_cuda_graph_choose_the_engine_path(tiny_model, arith_data, monkeypatch):
    """On CUDA the embedded engine runs the GPU path with CUDA graphs unless --no-rollout-gpu-engine (the transformers
    path) or --no-rollout-cuda-graph (eager decode); a launched `polyrl serve` gets both on its command line. The
    engine classes are recorded (no CUDA here); tests/rollout/test_gpu_engine.py runs graphs against eager on a GPU."""
    import polyrl.rollout.embedded as embedded
    import polyrl.rollout.gpu as gpu
    from polyrl.cli import build_parser
    from polyrl.config import config_from_args
    from polyrl.rollout.http_engine import server_command
    built = []

    def recorder(name):
        return lambda path, **kw: built.append((name, path, kw.get("cuda_graph")))

    monkeypatch.setattr(gpu, "GPUEngine", recorder("gpu"))
    monkeypatch.setattr(embedded, "EmbeddedEngine", recorder("transformers"))
    for flags, want in (((), ("gpu", True)), (("--no-rollout-cuda-graph",), ("gpu", False)),
                        (("--no-rollout-gpu-engine",), ("transformers", None)),
                        (("--rollout-gpu-engine", "--rollout-cuda-graph"), ("gpu", True))):
        cfg = config_from_args(build_parser().parse_args(["train", "--hf-checkpoint", tiny_model, "--prompt-data",
                                                          arith_data["train"], "--rm-type", "arithmetic", *flags]))
        argv = server_command(cfg, "server", 30000, "cuda")  # what a launched server runs
        assert argv[1:4] == ["-m", "polyrl", "serve"], argv
        served = config_from_args(build_parser().parse_args(argv[3:]))
        for c in (cfg, served):
            built.clear()
            embedded.engine_from_config(c, "cuda")
            assert [(name, graph) for name, _, graph in built] == [want], (flags, c is served, built)
            assert built[0][1] == tiny_model
