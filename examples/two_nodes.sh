#!/usr/bin/env bash
# The guide's LoRA run on two machines. Type on each machine, with the address of machine 0 and this
# machine's rank:
#   machine 0:  MAIN_IP=10.0.0.1 MACHINE_RANK=0 examples/two_nodes.sh
#   machine 1:  MAIN_IP=10.0.0.1 MACHINE_RANK=1 examples/two_nodes.sh
# NPROC_PER_NODE processes start on each machine (num_processes is the total, as in accelerate).
# To try it on one CPU box: CONFIG=configs/fsdp_config_cpu.yaml NPROC_PER_NODE=1 MAIN_IP=127.0.0.1, once with
# MACHINE_RANK=0 and once with MACHINE_RANK=1, plus --model_name_or_path/--dataset_name of a local model and data.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MAIN_IP:?set MAIN_IP to the address of machine 0}" "${MACHINE_RANK:?set MACHINE_RANK to 0 or 1}"
CONFIG=${CONFIG:-configs/fsdp_config.yaml}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
NUM_PROCESSES=$((2 * NPROC_PER_NODE))

shardtune launch --config_file "$CONFIG" --num_machines 2 --num_processes "$NUM_PROCESSES" \
--machine_rank "$MACHINE_RANK" --main_process_ip "$MAIN_IP" --main_process_port "${MAIN_PORT:-29500}" \
--rdzv_backend static \
--seed 100 \
--model_name_or_path "meta-llama/Llama-2-70b-hf" \
--dataset_name "smangrul/ultrachat-10k-chatml" \
--chat_template_format "chatml" \
--splits "train,test" \
--max_seq_len 2048 \
--num_train_epochs 1 \
--logging_steps 5 \
--eval_strategy "epoch" \
--save_strategy "epoch" \
--bf16 True \
--packing True \
--learning_rate 1e-4 \
--lr_scheduler_type "cosine" \
--output_dir "llama-sft-lora-fsdp-2nodes" \
--per_device_train_batch_size 8 \
--gradient_accumulation_steps 4 \
--gradient_checkpointing True \
--use_peft_lora True \
--lora_r 8 \
--lora_alpha 16 \
--lora_dropout 0.1 \
--lora_target_modules "all-linear" \
"$@"
