"""--override-ddp-config: the keyword arguments polyrl builds for megatron's DistributedDataParallelConfig (CPU, no
megatron-core: the field table is passed in), and on GPU the DDP-wrapped model built with them (gradient buffer dtype,
buckets, the config the wrapper holds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from polyrl.backends.megatron.ddp import FSDP_DEFAULTS, ddp_kwargs, parse_overrides
from polyrl.cli import build_parser
from polyrl.config import config_from_args

# A subset of megatron-core 0.19's DistributedDataParallelConfig fields and defaults, one of each kind parse_overrides
# types (bool, Optional[int] defaulting to None, int, float, str, Optional[dtype]); model.py passes the real table.
FIELDS = {"grad_reduce_in_fp32": False, "overlap_grad_reduce": False, "overlap_param_gather": False,
          "use_distributed_optimizer": False, "check_for_nan_in_grad": False, "bucket_size": None,
          "num_distributed_optimizer_instances": 1, "use_megatron_fsdp": False,
          "data_parallel_sharding_strategy": "no_shard", "gradient_reduce_div_fusion": True,
          "fsdp_double_buffer": False, "suggested_communication_unit_size": None, "main_grads_dtype": None,
          "average_in_collective": False, "align_param_gather": False, "outer_dp_sharding_strategy": "no_shard",
          "grad_norm_clip_ratio": 1.0}


def megatron_cfg(tmp_path, *flags: str):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": 2}\n')
    return config_from_args(build_parser().parse_args(["train", "--train-backend", "megatron", "--hf-checkpoint",
                                                       str(tmp_path), "--prompt-data", str(data), "--rm-type",
                                                       "arithmetic", *flags])).megatron


def test_ddp_and_fsdp_defaults_and_the_overrides_on_top(tmp_path):
    assert ddp_kwargs(megatron_cfg(tmp_path), FIELDS) == dict(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                               overlap_grad_reduce=False)
    assert ddp_kwargs(megatron_cfg(tmp_path, "--no-use-distributed-optimizer"), FIELDS)["use_distributed_optimizer"] is False
    assert ddp_kwargs(megatron_cfg(tmp_path, "--use-megatron-fsdp"), FIELDS) == FSDP_DEFAULTS
    mg = megatron_cfg(tmp_path, "--override-ddp-config", "grad_reduce_in_fp32=false", "bucket-size=1000",
                      "overlap_grad_reduce=true",
                      "--override-ddp-config", "check_for_nan_in_grad=1", "num_distributed_optimizer_instances=2",
                      "grad_norm_clip_ratio=0.5", "data_parallel_sharding_strategy=optim", "main_grads_dtype=torch.bfloat16")
    assert ddp_kwargs(mg, FIELDS) == dict(
        use_distributed_optimizer=True, grad_reduce_in_fp32=False, overlap_grad_reduce=True, bucket_size=1000,
        check_for_nan_in_grad=True, num_distributed_optimizer_instances=2, grad_norm_clip_ratio=0.5,
        data_parallel_sharding_strategy="optim", main_grads_dtype=torch.bfloat16)
    fsdp = ddp_kwargs(megatron_cfg(tmp_path, "--use-megatron-fsdp", "--override-ddp-config", "overlap_param_gather=false",
                                   "bucket_size=none"), FIELDS)
    assert fsdp == {**FSDP_DEFAULTS, "overlap_param_gather": False, "bucket_size": None}  # an FSDP default overridden


def test_bucket_size_without_overlap_grad_reduce_is_refused(tmp_path):
    """megatron's DDP keeps one bucket unless overlap_grad_reduce is on: a bucket_size alone would be ignored."""
    with pytest.raises(ValueError, match="overlap_grad_reduce=true"):
        ddp_kwargs(megatron_cfg(tmp_path, "--override-ddp-config", "bucket_size=1000"), FIELDS)


@pytest.mark.parametrize("item,needle", [("no_such_field=1", "has no field 'no_such_field'"),
                                         ("grad_reduce_in_fp32=yes", "expected true/false"),
                                         ("bucket_size=big", "expected an integer"),
                                         ("grad_norm_clip_ratio=x", "expected a number"),
                                         ("main_grads_dtype=floaty", "expected a torch dtype")])
def test_bad_overrides_name_the_flag_and_the_item(item, needle):
    with pytest.raises(ValueError, match=f"--override-ddp-config '{item}': .*{needle}"):
        parse_overrides([item], FIELDS)


SCRIPT = r'''
import json, sys, torch
from polyrl.backends.megatron.backend import MegatronBackend
from polyrl.cli import build_parser
from polyrl.config import BatchConfig, ModelConfig, OptimizerConfig, config_from_args
from polyrl.dist import init_distributed
model, data, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
init_distributed("cuda")
args = build_parser().parse_args(["train", "--train-backend", "megatron", "--hf-checkpoint", model, "--prompt-data",
                                  data, "--rm-type", "arithmetic", *flags])
be = MegatronBackend(ModelConfig(hf_checkpoint=model), OptimizerConfig(lr=1e-3), BatchConfig(micro_batch_size=2),
                     device="cuda", total_steps=1, megatron_cfg=config_from_args(args).megatron)
chunk = be.model[0]
print("RESULT " + json.dumps({
    "held": {k: getattr(chunk.ddp_config, k) for k in ("grad_reduce_in_fp32", "bucket_size", "check_for_nan_in_grad")},
    "grad_dtypes": sorted({str(b.grad_dtype) for b in chunk.buffers}),
    "buckets": sum(len(b.buckets) for b in chunk.buffers),
    "params": sum(p.numel() for p in chunk.parameters())}), flush=True)
'''


@pytest.mark.gpu
def test_override_ddp_config_reaches_the_wrapped_model(tiny_model, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if sys.version_info < (3, 12):
        pytest.skip("megatron-core 0.19 needs Python >= 3.12")
    pytest.importorskip("megatron.core")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": 2}\n')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def built(*flags: str) -> dict:
        p = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model, str(data), *flags], capture_output=True, text=True,
                           timeout=300, env=env)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
        return json.loads(lines[-1][len("RESULT "):])

    default = built()
    assert default["held"] == {"grad_reduce_in_fp32": True, "bucket_size": None, "check_for_nan_in_grad": False}
    assert default["grad_dtypes"] == ["torch.float32"] and default["buckets"] == 1  # polyrl's defaults: one fp32 bucket
    bucket = 4096  # elements: the tiny model's ~75k parameters make several buckets
    over = built("--override-ddp-config", "grad_reduce_in_fp32=false", f"bucket_size={bucket}", "overlap_grad_reduce=true",
                 "--override-ddp-config", "check_for_nan_in_grad=true")
    assert over["held"] == {"grad_reduce_in_fp32": False, "bucket_size": bucket, "check_for_nan_in_grad": True}
    assert over["grad_dtypes"] == ["torch.bfloat16"]  # gradients reduced in the params' bf16
    assert 1 < over["buckets"] <= over["params"] // bucket + 1, over  # each bucket closes once past `bucket` elements
