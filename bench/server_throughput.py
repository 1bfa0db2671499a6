"""`polyrl serve` under load: R concurrent single-prompt /generate requests against one direct
`engine.generate` call of the same prompts (same engine, same settings, same per-prompt seeds,
so both sample the same tokens).

  direct   EmbeddedEngine in this process, one generate() of the R prompts
  server   `polyrl serve` in a subprocess; R single-prompt requests sent at once over HTTP
           (keep-alive connections); the server batches them into engine calls

Both stay up and run in turn (once to warm up: CUDA graphs, allocator; then --repeats times,
interleaved, so a busy moment of the machine hits both); the table shows medians. Temperature 1, no top-k / top-p, up to --new-tokens new tokens (random weights rarely
sample EOS on the big-vocabulary shapes; the tiny model's arithmetic tokenizer stops sooner:
the tokens column counts what was generated, the same in both modes).

  python bench/server_throughput.py --device cpu --model-shape tiny
  python bench/server_throughput.py --device cuda --model-shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import asyncio
import os
import selectors
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, build_model_dir, fmt, markdown_table, median, write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/server_throughput.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model-shape", choices=SHAPES, default="tiny")
    p.add_argument("--requests", type=int, default=256, help="concurrent single-prompt requests (= prompts of the direct call)")
    p.add_argument("--prompt-len", type=int, default=None, help="default: 16 for tiny (64 positions), else 128")
    p.add_argument("--new-tokens", type=int, default=None, help="default: 48 for tiny, else 256")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-wait-ms", type=float, default=2.0, help="polyrl serve --batch-wait-ms")
    p.add_argument("--mem-fraction", type=float, default=0.4, help="--rollout-mem-fraction (GPU)")
    p.add_argument("--model-dir", default=None, help="reuse a model directory (default: a fresh temporary one)")
    p.add_argument("--out", default="runs/bench/server_throughput.json")
    a = p.parse_args(argv)
    tiny = a.model_shape == "tiny"
    a.prompt_len = a.prompt_len or (16 if tiny else 128)
    a.new_tokens = a.new_tokens or (48 if tiny else 256)
    return a


def workload(model_dir: str, n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """n prompts of prompt_len random token ids (special tokens excluded)."""
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor(sorted(set(range(len(tok))) - set(tok.all_special_ids)))
    g = torch.Generator().manual_seed(seed)
    return ids[torch.randint(0, len(ids), (n, prompt_len), generator=g)].tolist()


class Direct:
    """The engine in this process: one generate() of every prompt."""

    def __init__(self, a, model_dir: str):
        import torch

        from polyrl.rollout.embedded import make_embedded_engine
        self.a = a
        dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
        self.eng = make_embedded_engine(model_dir, device=a.device, dtype=dtype, mem_fraction=a.mem_fraction)

    def run(self, prompts: list[list[int]], seeds: list[int]) -> tuple[float, int, int]:
        import torch

        from polyrl.types import SamplingParams
        sp = SamplingParams(temperature=1.0, max_new_tokens=self.a.new_tokens, prompt_seeds=seeds)
        cuda = self.a.device == "cuda"
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = self.eng.generate(prompts, sp)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, sum(len(s.response_ids) for s in out), 1

    def close(self) -> None:
        pass


class Server:
    """`polyrl serve` in a subprocess; one single-prompt request per prompt, all sent at once."""

    def __init__(self, a, model_dir: str, log_path: str):
        from polyrl.rollout.http_client import HTTPClient
        self.a = a
        cmd = [sys.executable, "-m", "polyrl", "serve", "--hf-checkpoint", model_dir, "--device", a.device, "--port", "0",
               "--batch-wait-ms", str(a.batch_wait_ms), "--rollout-mem-fraction", str(a.mem_fraction),
               "--max-running-requests", str(max(1024, 2 * a.requests))]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "wb"), stdin=subprocess.DEVNULL)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 600
        self.url = None
        while self.url is None and time.monotonic() < deadline and self.proc.poll() is None:
            if sel.select(timeout=1):
                line = self.proc.stdout.readline().decode()
                if line.startswith("polyrl serve: listening on "):
                    self.url = line.split()[-1]
        if self.url is None:
            self.proc.kill()
            raise RuntimeError(f"polyrl serve did not start; log {log_path}:\n{open(log_path).read()[-3000:]}")
        self.http = HTTPClient(max_connections=2 * a.requests)

    def run(self, prompts: list[list[int]], seeds: list[int]) -> tuple[float, int, int]:
        calls = lambda: self.http.call(self.url, "/get_server_info", timeout=30)["internal_states"][0]["engine_calls"]  # noqa: E731
        before = calls()
        t = time.perf_counter()
        async def burst():  # all requests from the client's event loop at once, as polyrl's HTTP engine sends a step's
            return await asyncio.gather(*(self.http.request(self.url, "/generate", {"input_ids": p, "sampling_params": {
                "temperature": 1.0, "max_new_tokens": self.a.new_tokens, "sampling_seed": s}}, timeout=1800)
                for p, s in zip(prompts, seeds)))
        outs = self.http.run(burst(), timeout=1900)
        wall = time.perf_counter() - t
        return wall, sum(o["meta_info"]["completion_tokens"] for o in outs), calls() - before

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(30)


def main(argv=None) -> int:
    a = parse_args(argv)
    work = a.model_dir or tempfile.mkdtemp(prefix="polyrl_bench_serve_")
    model_dir = a.model_dir or os.path.join(work, "model")
    if not a.model_dir:
        build_model_dir(model_dir, a.model_shape)
    prompts = workload(model_dir, a.requests, a.prompt_len)
    seeds = [1000 + i for i in range(a.requests)]
    modes = {"direct": Direct(a, model_dir), "server": Server(a, model_dir, os.path.join(work, "serve.log"))}
    runs: dict[str, list] = {m: [] for m in modes}
    try:
        for r in range(a.repeats + 1):  # interleaved, so a busy moment of the machine hits both; run 0 warms up
            for m, runner in modes.items():
                got = runner.run(prompts, seeds)
                if r:
                    runs[m].append(got)
    finally:
        for runner in modes.values():
            runner.close()
    rows = [{"mode": m, "wall_s": median([w for w, _, _ in rs]), "tokens": rs[-1][1],
             "engine_calls": median([c for _, _, c in rs]), "walls": [w for w, _, _ in rs]} for m, rs in runs.items()]
    base = rows[0]["tokens"] / rows[0]["wall_s"]
    table = []
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["wall_s"]
        r["requests_per_s"] = a.requests / r["wall_s"]
        r["ratio"] = r["tokens_per_s"] / base
        table.append([r["mode"], a.requests, fmt(r["engine_calls"]), fmt(r["wall_s"]), r["tokens"], fmt(r["tokens_per_s"]),
                      fmt(r["requests_per_s"]), fmt(r["ratio"], "{:.2f}")])
    print(f"{a.model_shape} on {a.device}: {a.requests} prompts x {a.prompt_len} tokens, up to {a.new_tokens} new tokens, "
          f"temperature 1; median of {a.repeats}")
    print(markdown_table(["mode", "requests", "engine calls", "wall s", "tokens", "tokens/s", "requests/s", "vs direct"], table))
    write_json(a.out, {"args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
