"""A finished run's outputs: the adapter (or model) gathered and written, the optional merge, the summary, the
model cards and the uploads."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from shardtune.config.arguments import RunConfig
from shardtune.config.dtypes import name_of
from shardtune.merge.fold import merge_adapter
from shardtune.objectives.loss import objective_settings
from shardtune.parallel.gather import gather_full, gather_trainable
from shardtune.parallel.mesh import all_gather_objects, barrier, broadcast_object
from shardtune.runtime import atomic, hub
from shardtune.runtime.atomic import DiskFullError
from shardtune.runtime.log import print0
from shardtune.training.export import save_adapter, save_full_model
from shardtune.training.modelcard import write_model_card
from shardtune.training.trainer import evaluate_split, peak_memory_gb


def write_weights(cfg: RunConfig, model, tokenizer, info, step: int = 0) -> Path:
    """Gather the adapter (or the whole model) and write it to output_dir in PEFT/transformers format.
    A full disk on rank 0 raises OSError(ENOSPC) on every rank (the others would wait at the next barrier)."""

    out = Path(cfg.train.output_dir)
    inner = model.model
    sd = gather_trainable(inner) if cfg.model.use_peft_lora else gather_full(inner)
    problem = None
    if info.is_main:
        try:
            if cfg.model.use_peft_lora:
                save_adapter(inner, sd, tokenizer, out, step=step)
            else:
                # In the precision the run trained in (--bf16/--fp16 or the YAML's mixed_precision).
                save_full_model(inner, sd, tokenizer, out, dtype=cfg.precision.export, step=step)
        except DiskFullError as e:
            problem = str(e)
    problem = broadcast_object(problem)
    if problem:
        raise OSError(errno.ENOSPC, problem)
    return out


def export(cfg: RunConfig, model, tokenizer, info, step: int) -> Path:
    out = write_weights(cfg, model, tokenizer, info, step)
    print0(f"{'Adapter' if cfg.model.use_peft_lora else 'Model'} written to {out}.")
    barrier()
    if cfg.train.merge_adapter and cfg.model.use_peft_lora and info.is_main:
        # A low-precision run merges in its compute dtype; an fp32 one keeps the base's own dtype.
        low = cfg.precision.param_dtype
        dtype = None if low is None else name_of(low)
        merged = merge_adapter(
            cfg.model.model_name_or_path,
            out,
            out / "merged",
            dtype=dtype,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        print0(f"Merged model written to {merged}.")
    barrier()
    return out


def finish(logger, cfg, model, eval_split, info, settings, state, runtime, out, objective) -> None:
    final_eval = {}
    if eval_split is not None and cfg.train.eval_strategy != "no":
        final_eval = evaluate_split(model, eval_split, objective, settings, info)
    mem = all_gather_objects(round(peak_memory_gb(info.device), 3))
    summary = {
        "runtime_s": runtime,
        "train_tokens": state.tokens,
        "tokens_per_s": state.tokens / max(runtime, 1e-9),
        "peak_memory_gb_per_rank": mem,
        "final_train_loss": state.losses[-1] if state.losses else None,
        "final_eval_loss": final_eval.get("eval_loss"),
        "final_eval_perplexity": final_eval.get("eval_perplexity"),
        "output_path": str(out),
        "interrupted": False,
        "steps": state.step,
        "nonfinite_steps": state.nonfinite_steps,
    }
    logger.finish(summary)
    if info.is_main:
        atomic.replace_text(Path(out) / "train_summary.json", json.dumps(summary, indent=2))
    return summary


def _method(cfg: RunConfig) -> str:
    m = cfg.model
    if not m.use_peft_lora:
        return "full"
    return "QLoRA" if m.use_4bit_quantization else "DoRA" if m.use_dora else "LoRA"


def write_cards(cfg: RunConfig, out: Path, summary: dict) -> None:
    m, d, t = cfg.model, cfg.data, cfg.train
    hp = {
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler_type,
        "num_train_epochs": t.num_train_epochs,
        "steps": summary.get("steps"),
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "max_length": d.max_length,
        "packing": d.packing,
        "bf16": cfg.precision.bf16,
        "seed": t.seed,
        "optim": t.optim,
        "fsdp_sharding_strategy": cfg.fsdp.sharding_strategy,
    }
    hp.update(objective_settings(t))
    if m.use_peft_lora:
        hp.update(
            lora_r=m.lora_r,
            lora_alpha=m.lora_alpha,
            lora_dropout=m.lora_dropout,
            lora_target_modules=m.lora_target_modules,
        )
    metrics = {
        "train_loss": summary.get("final_train_loss"),
        "eval_loss": summary.get("final_eval_loss"),
        "eval_perplexity": summary.get("final_eval_perplexity"),
    }
    kwargs = {
        "base_model": m.model_name_or_path,
        "method": _method(cfg),
        "datasets": d.dataset_name,
        "hyperparameters": hp,
        "metrics": metrics,
    }
    write_model_card(out, library_name="peft" if m.use_peft_lora else "transformers", **kwargs)
    if (out / "merged" / "config.json").exists():
        write_model_card(out / "merged", library_name="transformers", **kwargs)


def publish(cfg: RunConfig, info, logger, out: Path, summary: dict, repo_id: str | None, step: int) -> None:
    """Model cards, the hub upload (--push_to_hub) and the trackers' model artifact, from the main process."""
    if info.is_main:
        write_cards(cfg, out, summary)
        if repo_id:
            hub.upload(
                repo_id,
                out,
                hub_token=cfg.train.hub_token,
                message=f"shardtune: end of training (step {step})",
                ignore=hub.END_IGNORE,
            )
            print0(f"Uploaded {out} to https://huggingface.co/{repo_id}.")
        logger.log_model(out, is_adapter=cfg.model.use_peft_lora)
    logger.close(finished=True)
