"""MiMo's MTP layers on the Megatron backend against the FSDP backend (FP32, TP1, one GPU): the MTP loss, the policy
loss, per-token log-probs and the grad norm agree (with --mtp-detach-encoder, without it, and with the layers kept
frozen), export returns every checkpoint tensor exactly (MTP layers under their HF names), frozen MTP layers stay bit
for bit and trained ones move. Runs tests/backends/megatron/mtp_harness.py; tolerances and their reasons live there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import need_megatron_gpus

HARNESS = os.path.join(os.path.dirname(__file__), "mtp_harness.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run(args: list[str], torchrun: bool = False) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun else []
    p = subprocess.run([sys.executable, *launch, HARNESS, *args], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"mtp_harness {args[0]} exited {p.returncode}\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
    return [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.mark.gpu
def test_mimo_mtp_megatron_matches_fsdp(tmp_path):
    need_megatron_gpus(1)
    model, ref = str(tmp_path / "mimo"), str(tmp_path / "ref.pt")
    _run(["build", model])
    _run(["fsdp", model, ref])
    results = _run(["megatron", model, ref], torchrun=True)
    checked = [r for r in results if "ok" in r]
    # 4 cases x (log-probs, export, grad norm, policy loss, mtp loss / untrained, moved / frozen)
    assert len(checked) == 24 and results[-1]["check"] == "done", results
    assert all(r["ok"] for r in checked), [r for r in checked if not r["ok"]]
