#!/usr/bin/env bash
# LoRA fine-tuning of the built-in demo model (a small Llama built locally, no download) on 2 CPU processes:
# FSDP2 over gloo, launched from configs/fsdp_config_cpu.yaml. Extra flags are passed to `shardtune train`.
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${ASSETS:-demo_assets}
OUTPUT_DIR=${OUTPUT_DIR:-demo-sft-lora-fsdp}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python -c "import sys; from shardtune.demo import build_demo_assets; build_demo_assets(sys.argv[1])" "$ASSETS"

shardtune launch --config_file configs/fsdp_config_cpu.yaml \
--seed 100 \
--model_name_or_path "$ASSETS/model" \
--dataset_name "$ASSETS/data" \
--chat_template_format "chatml" \
--add_special_tokens False \
--append_concat_token False \
--splits "train,test" \
--max_seq_len 256 \
--num_train_epochs 1 \
--logging_steps 10 \
--log_level "info" \
--logging_strategy "steps" \
--eval_strategy "epoch" \
--save_strategy "epoch" \
--packing True \
--learning_rate 1e-3 \
--lr_scheduler_type "cosine" \
--weight_decay 1e-4 \
--warmup_steps 0 \
--max_grad_norm 1.0 \
--output_dir "$OUTPUT_DIR" \
--per_device_train_batch_size 4 \
--per_device_eval_batch_size 4 \
--gradient_accumulation_steps 1 \
--gradient_checkpointing True \
--use_reentrant False \
--use_peft_lora True \
--lora_r 8 \
--lora_alpha 16 \
--lora_dropout 0.1 \
--lora_target_modules "all-linear" \
"$@"
