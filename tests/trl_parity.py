"""The first optimizer step of a preference objective, in shardtune and in TRL's trainer, on the same batch: the
two sides of the TRL parity tests (DPO in test_preference.py, KTO in test_kto.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardtune.models.training_module import CausalLMForTraining
from shardtune.objectives.heads import sequence_logps

# The settings both sides share: fp32 on the CPU, no update (the first step's numbers are compared), no outputs.
TRL_ARGS = {"max_length": 64, "report_to": "none", "use_cpu": True, "bf16": False, "learning_rate": 0.0}


def build_pairs(tok, data, **kw):
    """shardtune's preference (or, with kto_group, KTO) splits of `data` as the parity tests compare them with TRL:
    rows up to 64 tokens, tokenized with the tokenizer's special tokens as TRL does (BOS added), no cache."""
    from shardtune.data.preference import build_preference_datasets
    from tests.conftest import build_data

    args = {"tokenizer": tok, "dataset_name": str(data), "max_length": 64, "add_special_tokens": True}
    return build_data(build_preference_datasets, **{**args, **kw})


def shardtune_first_step(objective, policy, ref, split, *, batch_size: int, pad_id: int) -> dict:
    """objective's reported metrics for the first micro-batch of `split`, the reference log-probs from `ref`."""
    kw = {"rank": 0, "world_size": 1, "epoch": 0, "seed": 0, "shuffle": False, "pad_id": pad_id}
    batch = next(iter(split.iterate(batch_size=batch_size, **kw)))
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    with torch.no_grad():
        batch["ref_logps"] = CausalLMForTraining(ref, chunk_size=16)(**inputs, head=sequence_logps)[0]
    model = CausalLMForTraining(policy, chunk_size=16)  # several chunks per batch
    totals = objective.counts(batch)
    loss, sums = objective.step(model, batch, totals, grad_scale=1.0)
    loss.backward()  # the gradient path runs (checkpointed chunks)
    return objective.report({k: float(v) for k, v in sums.items()}, totals)


def trl_first_step(trainer_cls, config_cls, *, policy, ref, data: Path, tok, batch_size: int, out: Path, **config):
    """TRL's loss and logged metrics for the first batch of the jsonl file `data`."""
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(data), split="train")
    args = config_cls(output_dir=str(out), per_device_train_batch_size=batch_size, save_strategy="no",
                      **{**TRL_ARGS, **config})  # fmt: skip
    trainer = trainer_cls(model=policy, ref_model=ref, args=args, train_dataset=ds, processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(batch_size)])
    trainer.model.train()
    theirs = {"loss": float(trainer.compute_loss(trainer.model, batch))}
    theirs.update({k: v[-1] for k, v in trainer._metrics["train"].items()})
    return theirs
