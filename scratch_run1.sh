#!/bin/bash
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
S=$OUT/stages.txt
st() { local n=$1 lim=$2; shift 2; local t0=$SECONDS; timeout $lim "$@" > $OUT/$n.log 2>&1; echo "$n rc=$? took=$((SECONDS-t0))s" >> $S; }
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/env.txt
python3 -c "import torch,transformers;print(torch.__version__, transformers.__version__)" >> $OUT/env.txt 2>&1
pip list 2>/dev/null | grep -i "trl\|datasets\|pyarrow\|accelerate\|peft\|liger\|aiohttp\|megatron" >> $OUT/env.txt
st ws 110 python3 bench/weight_sync.py --device cuda --model-shapes qwen2.5-0.5b,qwen2.5-1.5b --repeats 5 --warmup 1 --out $OUT/ws.json
st ct05 170 python3 bench/compare_trl.py --device cuda --model-shape qwen2.5-0.5b --prompts-per-step 16 --samples-per-prompt 8 --max-new-tokens 256 --micro-batch-size 16 --polyrl-default-batching --warmup 2 --steps 4 --frameworks polyrl --workdir /tmp/ct05 --out $OUT/ct05.json

st ct15 170 python3 bench/compare_trl.py --device cuda --model-shape qwen2.5-1.5b --prompts-per-step 16 --samples-per-prompt 8 --max-new-tokens 256 --micro-batch-size 16 --polyrl-default-batching --warmup 2 --steps 4 --frameworks polyrl --workdir /tmp/ct15 --out $OUT/ct15.json
cp /tmp/ct05/polyrl*/metrics.jsonl $OUT/ct05_metrics.jsonl 2>/dev/null; cp /tmp/ct15/polyrl*/metrics.jsonl $OUT/ct15_metrics.jsonl 2>/dev/null
true
