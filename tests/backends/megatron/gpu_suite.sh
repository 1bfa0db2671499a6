#!/usr/bin/env bash
# Megatron backend GPU proofs. Usage: bash tests/backends/megatron/gpu_suite.sh LOG_DIR {1gpu|4gpu} [PACK_DIR]
# Each stage has its own time limit; RESULT lines are collected into LOG_DIR/results.txt.
set -u
L=${1:?log dir}; KIND=${2:-1gpu}
mkdir -p "$L"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
H=tests/backends/megatron/harness.py
W=/tmp/mgsuite; mkdir -p $W
P=${3:-$L}  # where results / error tails are appended as each stage ends (survives a kill)
run() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$L/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - t0))s" | tee -a "$P/stages.txt"
  grep -h "^RESULT" "$L/$name.log" | sed "s/^/$name /" >> "$P/results.txt"
  if [ $rc != 0 ]; then { echo "=== $name rc=$rc"; grep -v "Warning\|warnings.warn" "$L/$name.log" | grep -B2 -A3 "Error\|error" | tail -40; } >> "$P/errors.txt"; fi; }
TR="python3 -m torch.distributed.run --standalone --nproc-per-node"
python3 -c "import torch, megatron.core, inspect; from torch.nn.attention import varlen; print(torch.__version__, megatron.core.__version__, inspect.signature(varlen.varlen_attn)); print(torch.cuda.device_count(), torch.cuda.get_device_name())" > "$L/env.txt" 2>&1
[ "$KIND" != 1gpu-final ] && run models 60 python3 $H models $W/m
M=$W/m/llama,$W/m/qwen2,$W/m/qwen3,$W/m/qwen3_moe
R=$W/r_llama.pt,$W/r_qwen2.pt,$W/r_qwen3.pt,$W/r_qwen3_moe.pt
[ "$KIND" != 1gpu-final ] && run fsdp_ref 150 python3 $H fsdp-ref $M $R
G="--train-backend megatron --prompt-data $W/ard/train.jsonl --rm-type arithmetic --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 6 --lr 1e-4 --entropy-coef 0.01 --quiet"
python3 -c "from polyrl.tasks.arithmetic import build_model, write_datasets; build_model('$W/ar', hidden=64, layers=2, heads=4, kv_heads=2); write_datasets('$W/ard', digits=2, n_train=64, n_eval=16)" > "$L/ar.log" 2>&1
if [ "$KIND" = 1gpu ]; then
  run attention 60 python3 $H attention
  run layouts_tp1 240 $TR 1 $H layouts --models $M --refs $R --layouts "tp=1"
  run resume_tp1 120 $TR 1 $H resume --model $W/m/qwen3 --save-layout tp=1 --load-layout tp=1
  run sft_fsdp_dp1 150 $TR 1 $H sft-fsdp --model $W/m/qwen2
  run grpo_cli 150 $TR 1 -m polyrl train $G --hf-checkpoint $W/ar --num-rollout 3 --run-dir $W/run1 --save $W/ck1
  run grpo_cli_resume 120 $TR 1 -m polyrl train $G --hf-checkpoint $W/ar --num-rollout 4 --run-dir $W/run2 --load $W/ck1
elif [ "$KIND" = 1gpu-final ]; then  # checkpoint / Megatron-FSDP export fixes, two jobs per GPU
  run attention 60 python3 $H attention &
  run resume_tp1 120 $TR 1 $H resume --model $W/ar --save-layout tp=1 --load-layout tp=1
  wait
  run sft_fsdp_dp1 150 $TR 1 $H sft-fsdp --model $W/ar &
  run grpo_cli 150 $TR 1 -m polyrl train $G --hf-checkpoint $W/ar --num-rollout 2 --run-dir $W/run1 --save $W/ck1
  wait
  run grpo_cli_resume 120 $TR 1 -m polyrl train $G --hf-checkpoint $W/ar --num-rollout 3 --run-dir $W/run2 --load $W/ck1
else  # 4 GPUs: `make test-gpu` on GPUs 2,3 (its 1- and 2-GPU checks) beside two chains of 4-GPU jobs
  D=$W/m/llama,$W/m/qwen2,$W/m/qwen3; DR=$W/r_llama.pt,$W/r_qwen2.pt,$W/r_qwen3.pt
  D32=$W/r32_llama.pt,$W/r32_qwen2.pt,$W/r32_qwen3.pt
  ( CUDA_VISIBLE_DEVICES=2,3 POLYRL_RESULTS_LOG=$P/results_test_gpu_2gpu.jsonl PYTEST_ADDOPTS="-v -n 3 --durations=30" \
      timeout 540 make test-gpu > "$P/test_gpu_2gpu.log" 2>&1; echo "make test-gpu (2 GPUs) rc=$?" >> "$P/stages.txt" ) &
  GP="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
  (  # chain 3, GPU 0: GRPO through the CLI on one GPU, then its resume from the dist-checkpoint;
    CUDA_VISIBLE_DEVICES=0 run grpo_cli 150 $TR 1 -m polyrl train $G --hf-checkpoint $W/ar --num-rollout 2 --run-dir $W/run1 --save $W/ck1
    CUDA_VISIBLE_DEVICES=0 run grpo_cli_resume 120 $TR 1 -m polyrl train $G --hf-checkpoint $W/ar --num-rollout 3 --run-dir $W/run2 --load $W/ck1
    # then the virtual-pipeline + TP layouts, one launch each (a stuck rank dumps its stack after 60 s and exits):
    # Megatron-LM's overlapped p2p (polyrl's default with VPP), without SP, and the batched p2p that hung before
    export POLYRL_HANG_DUMP=60
    run vpp_tp2pp2_sp 100 $TR 4 $H layouts --models $W/m/llama --refs $W/r_llama.pt --layouts "tp=2,pp=2,vpp=1,sp=1"
    run vpp_tp2pp2 100 $TR 4 $H layouts --models $W/m/llama --refs $W/r_llama.pt --layouts "tp=2,pp=2,vpp=1"
    run vpp_tp2pp2_sp_batchp2p 100 $TR 4 $H layouts --models $W/m/llama --refs $W/r_llama.pt --layouts "tp=2,pp=2,vpp=1,sp=1,p2p=batch"
  ) &
  (  # chain 1: bf16 dense layouts, re-sharding resume, GRPO at TP2xPP2 resumed at TP1xPP2
    run layouts_4gpu_dense 240 $TR 4 $H layouts --models $D --refs $DR --layouts "tp=2,pp=2;tp=2,cp=2;pp=2,vpp=1"
    run resume_tp2pp2_to_tp1pp2 150 $TR 4 $H resume --model $W/m/qwen3 --save-layout tp=2,pp=2 --load-layout tp=1,pp=2
    run grpo_tp2pp2 150 $TR 4 -m polyrl train $G --hf-checkpoint $W/ar $GP --rollout-batch-size 8 --num-rollout 2 --run-dir $W/run4 --save $W/ck4
    run grpo_resume_tp1pp2 150 $TR 4 -m polyrl train $G --hf-checkpoint $W/ar --pipeline-model-parallel-size 2 --rollout-batch-size 8 --num-rollout 3 --run-dir $W/run5 --load $W/ck4
  ) &
  run fsdp_ref32 150 python3 $H fsdp-ref $M $W/r32_llama.pt,$W/r32_qwen2.pt,$W/r32_qwen3.pt,$W/r32_qwen3_moe.pt --fp32
  (  # chain 2: MoE layouts, FP32 parity, Megatron-FSDP DP=4
    run layouts_4gpu_moe 180 $TR 4 $H layouts --models $W/m/qwen3_moe --refs $W/r_qwen3_moe.pt --layouts "ep=4;tp=2,pp=2;ep=2,tp=2"
    run layouts_4gpu_fp32 200 $TR 4 $H layouts --fp32 --checks logprobs,grad --models $D,$W/m/qwen3_moe --refs $D32,$W/r32_qwen3_moe.pt --layouts "tp=2,pp=2;tp=2,cp=2;pp=2,vpp=1"
    run sft_fsdp_dp4 150 $TR 4 $H sft-fsdp --model $W/m/qwen2
  ) &
  wait
fi
for r in run1 run2 run4 run5; do cp $W/$r/metrics.jsonl "$L/grpo_$r.jsonl" 2>/dev/null; done
[ -n "${3:-}" ] && tar czf "$3/logs.tgz" -C "$L" .
