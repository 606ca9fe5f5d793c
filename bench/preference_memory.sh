#!/bin/bash
# Peak host memory per rank of SFT and DPO on the same rows (B pairs = 2B rows), LoRA and full fine-tuning, on
# 2 CPU FSDP2 ranks; prints each run's peak_memory_gb_per_rank and runtime. Usage: bench/preference_memory.sh [DIR]
set -e
dir=${1:-/tmp/shardtune-preference-memory}
mkdir -p "$dir" && cd "$dir"
export OMP_NUM_THREADS=1 ACCELERATE_USE_FSDP=true FSDP_SHARDING_STRATEGY=FULL_SHARD FSDP_CPU_RAM_EFFICIENT_LOADING=true
python - <<'PY'
import json
from pathlib import Path
from shardtune.demo import build_model, build_tokenizer, write_preference_dataset
if not Path("model/config.json").exists():
    tok = build_tokenizer("model", vocab_size=1024)
    build_model("model", vocab_size=len(tok), hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4)  # 24M
write_preference_dataset("pairs", n_train=256, n_test=8, seed=0)
with open("sft.jsonl", "w") as f:  # the same sequences as SFT rows: prompt+chosen and prompt+rejected
    for line in Path("pairs/train.jsonl").read_text().splitlines():
        r = json.loads(line)
        f.writelines(json.dumps({"text": r["prompt"] + r[c] + "</s>"}) + "\n" for c in ("chosen", "rejected"))
PY
common="--model_name_or_path model --max_length 64 --max_steps 8 --logging_steps 1 --save_strategy no --splits train --learning_rate 1e-4 --seed 1"
lora="--use_peft_lora True --lora_r 16 --lora_alpha 32 --lora_dropout 0 --lora_target_modules all-linear"
run() {
  name=$1; shift
  python -m torch.distributed.run --nproc_per_node 2 --master_port $((29600 + RANDOM % 1000)) -m shardtune train \
    $common --output_dir "out-$name" "$@" > "log-$name.txt" 2>&1
  python -c "import json; s=[json.loads(l) for l in open('out-$name/metrics.jsonl')][-1]; print('$name', s['peak_memory_gb_per_rank'], round(s['runtime_s'], 1))"
}
run sft-lora --dataset_name sft.jsonl --per_device_train_batch_size 16 $lora
run dpo-lora --dataset_name pairs/train.jsonl --objective dpo --per_device_train_batch_size 8 $lora
run dpo-lora-pre --dataset_name pairs/train.jsonl --objective dpo --per_device_train_batch_size 8 $lora \
  --precompute_ref_log_probs True
run sft-full --dataset_name sft.jsonl --per_device_train_batch_size 16
run dpo-full --dataset_name pairs/train.jsonl --objective dpo --per_device_train_batch_size 8
