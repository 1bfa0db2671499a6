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
else  # 4 GPUs: single-GPU checks side by side, then 2-GPU layouts in pairs, then 4-GPU layouts
  D=$W/m/llama,$W/m/qwen2,$W/m/qwen3; DR=$W/r_llama.pt,$W/r_qwen2.pt,$W/r_qwen3.pt
  wait  # fsdp_ref ran before; the two 1-GPU checks share GPUs with the 2-GPU layout pairs
  CUDA_VISIBLE_DEVICES=0 run attention 60 python3 $H attention &
  CUDA_VISIBLE_DEVICES=1 run resume_tp1 120 $TR 1 $H resume --model $W/m/qwen3 --save-layout tp=1 --load-layout tp=1 &
  CUDA_VISIBLE_DEVICES=2 run layouts_tp1 200 $TR 1 $H layouts --models $M --refs $R --layouts "tp=1" &
  CUDA_VISIBLE_DEVICES=0,1 run layouts_2gpu_dense 200 $TR 2 $H layouts --models $D --refs $DR --layouts "tp=2;pp=2;cp=2;tp=2,sp=1" &
  CUDA_VISIBLE_DEVICES=2,3 run layouts_2gpu_moe 200 $TR 2 $H layouts --models $W/m/qwen3_moe --refs $W/r_qwen3_moe.pt --layouts "ep=2;tp=2;pp=2;cp=2" &
  wait
  run layouts_4gpu_dense 200 $TR 4 $H layouts --models $D --refs $DR --layouts "tp=2,pp=2;tp=2,cp=2;pp=2,vpp=1"
  run layouts_4gpu_moe 150 $TR 4 $H layouts --models $W/m/qwen3_moe --refs $W/r_qwen3_moe.pt --layouts "ep=4;tp=2,pp=2;ep=2,tp=2"
  run resume_tp2pp2_to_tp1pp2 150 $TR 4 $H resume --model $W/m/qwen3 --save-layout tp=2,pp=2 --load-layout tp=1,pp=2
  run sft_fsdp_dp4 150 $TR 4 $H sft-fsdp --model $W/m/qwen2
  GP="--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
  run grpo_tp2pp2 150 $TR 4 -m polyrl train $G --hf-checkpoint $W/ar $GP --rollout-batch-size 8 --num-rollout 2 --run-dir $W/run4 --save $W/ck4
  run grpo_resume_tp1pp2 150 $TR 4 -m polyrl train $G --hf-checkpoint $W/ar --pipeline-model-parallel-size 2 --rollout-batch-size 8 --num-rollout 3 --run-dir $W/run5 --load $W/ck4
  run layouts_4gpu_vpp_sp 120 $TR 4 $H layouts --models $W/m/llama --refs $W/r_llama.pt --layouts "tp=2,pp=2,vpp=1,sp=1"  # hung in train_step once
fi
for r in run1 run2 run4 run5; do cp $W/$r/metrics.jsonl "$L/grpo_$r.jsonl" 2>/dev/null; done
[ -n "${3:-}" ] && tar czf "$3/logs.tgz" -C "$L" .
