import os, sys, time, tempfile, json
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch
from common import build_model_dir
from polyrl.rollout.gpu import GPUEngine
from polyrl.types import SamplingParams
mdir = sys.argv[1]
tag = sys.argv[2]
if not os.path.exists(os.path.join(mdir, "config.json")):
    build_model_dir(mdir, "qwen2.5-0.5b", seed=0)
eng = GPUEngine(mdir, dtype=torch.bfloat16, max_batch=256, mem_fraction=0.5, ignore_eos=True, profile=True)
acc = {"launch": 0.0, "process": 0.0}
for name in ("_launch_step", "_process"):
    f = getattr(eng, name)
    def w(*a, _f=f, _k=name.strip("_").split("_")[0], **k):
        t = time.perf_counter(); r = _f(*a, **k); acc[_k] += time.perf_counter() - t; return r
    setattr(eng, name, w)
g = torch.Generator().manual_seed(0)
prompts = torch.randint(20, 151936, (256, 128), generator=g).tolist()
out = {}
for label, sp in (("t1", dict(temperature=1.0)), ("top_p", dict(temperature=1.0, top_p=0.9))):
    eng.generate(prompts, SamplingParams(max_new_tokens=512, seed=9, **sp))
    for r in range(2):
        acc.update(launch=0.0, process=0.0)
        torch.cuda.synchronize(); t = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_new_tokens=512, seed=r, **sp))
        dt = time.perf_counter() - t
        st = eng.last_stats
        row = dict(wall=dt, tok_s=256 * 512 / dt, decode_s=st["decode_s"], gpu_decode_s=st["gpu_decode_s"],
                   steps=st["steps"], host_launch_ms=1e3 * acc["launch"] / st["steps"], host_process_ms=1e3 * acc["process"] / st["steps"],
                   gpu_step_ms=1e3 * st["gpu_decode_s"] / st["steps"], wall_step_ms=1e3 * st["decode_s"] / st["steps"])
        print(tag, label, {k: round(v, 4) for k, v in row.items()}, flush=True)
