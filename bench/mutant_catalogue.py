"""The mutation bench's catalogue: planted bugs of each class shardtune's tests are meant to catch, each with the
test node ids that should catch it (run by bench/mutants.py, checked to plant by tests/unit/test_mutants_plant.py).

A mutant is one or more `tests.mutation.Edit`s of src/shardtune; a new one is one `_m(...)` entry in MUTANTS.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mutation import Edit


@dataclass(frozen=True)
class Mutant:
    name: str
    kind: str  # the class of bug: normalisation, gradient scale, sharding, masking, adapter, resume, merge, preference,
    # quantization
    bug: str  # what the planted code does wrong, in a sentence
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]  # the pytest node ids that should catch it

    def fingerprint(self) -> str:
        blob = json.dumps([[asdict(e) for e in self.edits], list(self.tests)])
        return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


def _m(name: str, kind: str, bug: str, edits: Edit | list[Edit], tests: list[str]) -> Mutant:
    return Mutant(name, kind, bug, tuple(edits if isinstance(edits, list) else [edits]), tuple(tests))


PARITY = "tests/distributed/test_parity.py"
PARITY_LORA = f"{PARITY}::test_lora_two_ranks_match_one_process[FULL_SHARD]"
PARITY_FULL = f"{PARITY}::test_full_finetune_two_ranks_match_one_process"
ZERO_TARGETS = "tests/unit/test_zero_targets.py::test_two_ranks_one_without_targets_equal_one_process"
ROUTER_AUX_RANKS = "tests/distributed/test_router_aux.py::test_two_ranks_with_the_router_loss_equal_one_process_on_the_same_micro_batches"
CKPT_UNIT = "tests/unit/test_checkpoint_unit.py"
QUANT_EXPERTS = "tests/unit/test_quant_experts.py::test_{}"
CP_TESTS = "tests/distributed/test_context_parallel.py::test_{}"
ROUTER_AUX_CP = "tests/distributed/test_router_aux.py::test_context_parallel_with_the_router_loss_equals_one_process"
CP_PREFERENCE = "tests/distributed/test_preference_cli.py::test_context_parallel_preference_runs_give_the_numbers_of_one_process[{}]"
EXPERTS_E2E = "tests/e2e/test_families.py::test_expert_lora_{}[qwen3-moe]"
RESUME_EXACT = (
    "tests/distributed/test_checkpoint.py::test_sigkill_mid_save_keeps_previous_checkpoint_and_resume_is_exact"
)
MERGE_CASE = "tests/unit/test_merge.py::test_merged_model_matches_peft_model_untied[{}]"
ORPO_FIRST_STEP = (
    "tests/unit/test_reference_free_trainers.py::"
    "test_orpo_first_step_equals_trls_orpo_trainer_but_for_the_prompt_in_the_nll"
)
RELOAD_LORA = "tests/e2e/test_reload.py::test_reload_in_fresh_process_gives_trained_eval_loss[lora]"

TRAIN_STEP = (
    "        loss, parts = objective.step(model, b, totals, info.dims.gradient_divisor)\n"
    "        if backward:\n            loss.backward()"
)
CLIP = "    grads = [p for p in params if p.grad is not None]\n    if not grads:"

MUTANTS: tuple[Mutant, ...] = (
    # ---------------------------------------------------------------- normalisation
    _m(
        "norm_per_rank_tokens",
        "normalisation",
        "each rank divides its loss by its own target count and FSDP's averaging is left to make the mean "
        "(the mean of per-rank means, not the global token mean)",
        Edit(
            "training/trainer.py",
            TRAIN_STEP,
            "        loss, parts = objective.step(model, b, {k: sum(c[k] for c in local) for k in keys}, 1)\n"
            "        if backward:\n            loss.backward()",
        ),
        [ZERO_TARGETS, PARITY_LORA],
    ),
    _m(
        "norm_micro_batches_twice",
        "normalisation",
        "the loss, already normalised over the global batch, is divided by the number of micro-batches again",
        Edit(
            "training/trainer.py", TRAIN_STEP, TRAIN_STEP.replace("loss.backward()", "(loss / len(batches)).backward()")
        ),
        ["tests/unit/test_grad_accumulation.py", PARITY_LORA],
    ),
    _m(
        "head_cp_rows_not_summed",
        "normalisation",
        "under context parallelism each rank's per-row log-probs (objectives.heads.sequence_logps) are its own "
        "positions' sums, not the whole rows' over the cp ranks",
        Edit(
            "objectives/heads.py",
            "    if shard is not None:\n        return shard.sum_rows(total), shard.sum_rows(n)",
            "    if False:\n        return shard.sum_rows(total), shard.sum_rows(n)",
        ),
        ["tests/distributed/test_kto_cli.py::test_context_parallel_gives_the_numbers_of_one_process"],
    ),
    _m(
        "head_no_targets_detached",
        "normalisation",
        "a micro-batch without targets (objectives.heads.token_loss) returns a constant zero that skips the head: "
        "its rank's backward reaches no parameter",
        Edit(
            "objectives/heads.py",
            "        return chunk_loss(h[:1], torch.zeros_like(y[:1])) * 0.0, keep.sum()",
            "        return h.new_zeros((), dtype=torch.float32, requires_grad=True), keep.sum()",
        ),
        ["tests/unit/test_zero_targets.py"],
    ),
    # ---------------------------------------------------------------- gradient scale
    _m(
        "grad_half_rank1",
        "gradient scale",
        "rank 1's contribution to every gradient is halved",
        Edit(
            "training/trainer.py",
            TRAIN_STEP,
            TRAIN_STEP.replace("loss.backward()", "(loss * (0.5 if info.rank == 1 else 1.0)).backward()"),
        ),
        [PARITY_LORA],
    ),
    _m(
        "grad_zero_but_rank0",
        "gradient scale",
        "after the reduce-scatter, every rank but 0 zeroes its shard of the gradients before clipping and the step",
        Edit(
            "training/trainer.py",
            CLIP,
            CLIP.replace(
                "    if not grads:",
                "    if os.environ.get('RANK', '0') != '0':\n"
                "        for p in grads:\n"
                "            (p.grad.to_local() if hasattr(p.grad, 'to_local') else p.grad).zero_()\n"
                "    if not grads:",
            ),
        ),
        [PARITY_LORA],
    ),
    _m(
        "grad_fsdp_average_kept",
        "gradient scale",
        "the loss is not multiplied by the data-parallel size, so FSDP's 1/N averaging of gradients stays",
        Edit(
            "training/trainer.py", TRAIN_STEP, TRAIN_STEP.replace("totals, info.dims.gradient_divisor)", "totals, 1)")
        ),
        [PARITY_LORA],
    ),
    # ---------------------------------------------------------------- sharding
    _m(
        "load_shard_unfilled",
        "sharding",
        "with cpu_ram_efficient_loading, the ranks that receive their shards from rank 0 leave them zero",
        Edit(
            "parallel/loading.py",
            "    dist.scatter(out, pieces, src=node.src, group=node.group)\n",
            "    dist.scatter(out, pieces, src=node.src, group=node.group)\n    if not sender:\n        out.zero_()\n",
        ),
        [PARITY_FULL],
    ),
    _m(
        "gather_full_rows_dropped",
        "sharding",
        "on 2 or more ranks, gathering the full model for saving keeps rank 0's shard of each matrix only (the "
        "other ranks' rows zero)",
        Edit(
            "parallel/gather.py",
            "    return {(k.removeprefix(prefix)): v for k, v in sd.items()}",
            "    for v in sd.values():\n"
            "        if v.ndim == 2 and dist.get_world_size() > 1:\n"
            "            v[-(-v.shape[0] // dist.get_world_size()) :] = 0\n"
            "    return {(k.removeprefix(prefix)): v for k, v in sd.items()}",
        ),
        [PARITY_FULL],
    ),
    # ---------------------------------------------------------------- masking
    _m(
        "pack_positions_not_restarted",
        "masking",
        "the packed rows of the data cache number positions across the whole row instead of restarting at each "
        "document (so per-document attention sees one document)",
        Edit(
            "data/cache.py",
            "            pos.append(np.arange(b - a, dtype=np.int32))",
            "            pos.append(np.arange(b - a, dtype=np.int32) + sum(len(x) for x in ids[:-1]))",
        ),
        [
            "tests/unit/test_data.py::test_packed_rows_hold_whole_documents_with_shifted_labels",
            "tests/unit/test_data.py::test_packed_batches_from_the_pipeline_match_documents_run_alone",
        ],
    ),
    _m(
        "build_rows_positions_not_restarted",
        "masking",
        "packing.build_rows (streamed and test rows) numbers positions across the row instead of per document",
        Edit(
            "data/packing.py",
            "            pos_parts.append(np.arange(len(doc.ids), dtype=np.int32))",
            "            pos_parts.append(np.arange(len(doc.ids), dtype=np.int32) + total)",
        ),
        [
            "tests/unit/test_packing.py::test_build_rows_pads_with_its_own_positions",
            "tests/unit/test_packing.py::test_packed_row_logits_equal_each_document_alone",
        ],
    ),
    _m(
        "doc_attention_no_breaks",
        "masking",
        "per-document attention (fastpath.packed_documents) finds no document boundary: one causal span per row",
        Edit(
            "models/fastpath.py",
            "    breaks[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1",
            "    breaks[:, 1:] = False",
        ),
        [
            "tests/unit/test_fastpath.py::test_packed_documents_groups_short_documents_into_spans",
            "tests/unit/test_fastpath.py::test_per_document_attention_matches_the_masked_attention",
            "tests/unit/test_data.py::test_packed_batches_from_the_pipeline_match_documents_run_alone",
        ],
    ),
    _m(
        "doc_attention_span_leak",
        "masking",
        "a span of several short documents gets a plain causal mask and the family's block-diagonal mask is not"
        " consulted on it (either alone keeps documents apart): each document attends to the ones before it",
        [
            Edit(
                "models/fastpath.py",
                "    mask = (doc[:, None] == doc[None, :]) & torch.ones(size, size, dtype=torch.bool).tril()",
                "    mask = (doc[:, None] >= doc[None, :]) & torch.ones(size, size, dtype=torch.bool).tril()",
            ),
            Edit(
                "models/fastpath.py",
                "    if attention_mask is None or attention_mask.ndim != 4:\n        return None\n    end = start",
                "    if True:\n        return None\n    end = start",
            ),
        ],
        [
            "tests/unit/test_fastpath.py::test_per_document_attention_matches_the_masked_attention",
            "tests/unit/test_data.py::test_packed_batches_from_the_pipeline_match_documents_run_alone",
            # the run-time conformance check sees the leak and trains on the own forward instead: caught there
            "tests/unit/test_conformance.py::test_conforming_families_take_the_fast_path",
        ],
    ),
    _m(
        "assistant_only_off",
        "masking",
        "--assistant_only_loss marks every token a target (prompts and system turns trained on)",
        Edit(
            "data/prepare.py",
            '                targets = token_target_mask(np.asarray(enc["offset_mapping"][j]).reshape(-1, 2), spans[j])',
            "                targets = np.ones(len(ids), dtype=bool)",
        ),
        [
            "tests/unit/test_data.py::test_assistant_only_loss_masks_exactly_the_non_assistant_targets",
            "tests/unit/test_data.py::test_assistant_only_loss_with_zephyr_unpacked",
        ],
    ),
    _m(
        "pref_prompt_in_labels",
        "masking",
        "preference pairs train on their prompt tokens too (the prompt is not masked out of the labels)",
        Edit(
            "data/preference.py",
            "            targets = np.arange(len(ids)) >= len(prompt_ids)\n            completion += int(targets.sum())\n",
            "            targets = np.ones(len(ids), dtype=bool)\n            completion += int(targets.sum())\n",
        ),
        ["tests/unit/test_preference.py::test_pairs_mask_the_prompt_and_keep_chosen_and_rejected_together"],
    ),
    _m(
        "collate_padding_targets",
        "masking",
        "a batch's padding positions get the pad token as their label (padding trained on) instead of -100",
        Edit(
            "data/collate.py",
            "    labels = np.full((batch_size, seq_len), IGNORE_INDEX, dtype=np.int64)",
            "    labels = np.full((batch_size, seq_len), pad_id, dtype=np.int64)",
        ),
        [
            "tests/unit/test_packing.py::test_unshuffled_batches_pad_to_the_longest_row",
            "tests/unit/test_packing.py::test_epoch_covers_every_row_once_and_fills_the_last_batch_without_targets",
        ],
    ),
    _m(
        "concat_eos_target_assistant_only",
        "masking",
        "with --assistant_only_loss and --append_concat_token, the separator EOS after each conversation is a target",
        Edit(
            "data/prepare.py", "targets = np.append(targets, not assistant_only)", "targets = np.append(targets, True)"
        ),
        ["tests/unit/test_data.py::test_assistant_only_loss_masks_exactly_the_non_assistant_targets"],
    ),
    # ---------------------------------------------------------------- adapter save/gather
    _m(
        "gather_adapter_one_rank",
        "adapter",
        "the saved adapter tensors hold rank 0's shard only (the other ranks' rows zero)",
        Edit(
            "parallel/gather.py",
            "        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()",
            "        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()\n"
            "        if isinstance(p, DTensor) and dist.get_world_size() > 1:\n"
            "            full = full.clone()\n"
            "            full[p.to_local().shape[0] :] = 0",
        ),
        [PARITY_LORA],
    ),
    _m(
        "adapter_alpha_saved_x2",
        "adapter",
        "the saved adapter_config.json has twice the trained lora_alpha (a reloaded adapter applies 2x its update)",
        Edit(
            "training/export.py",
            "        tokenizer.save_pretrained(str(tmp))\n    return Path(output_dir)\n\n\ndef save_full_model(",
            "        tokenizer.save_pretrained(str(tmp))\n"
            "        c = json.loads((tmp / 'adapter_config.json').read_text())\n"
            "        c['lora_alpha'] *= 2\n"
            "        (tmp / 'adapter_config.json').write_text(json.dumps(c))\n"
            "    return Path(output_dir)\n\n\ndef save_full_model(",
        ),
        [RELOAD_LORA],
    ),
    _m(
        "adapter_tokens_not_saved",
        "adapter",
        "the trained rows of the chat template's new tokens (trainable_token_indices) are left out of the saved "
        "adapter",
        # Left out of the written file: left out of the gathered state dict instead, the 2-rank run waited in a
        # collective until its timeout (a mutant that says nothing about the tests).
        Edit(
            "training/export.py",
            "        tokenizer.save_pretrained(str(tmp))\n    return Path(output_dir)\n\n\ndef save_full_model(",
            "        tokenizer.save_pretrained(str(tmp))\n"
            "        from safetensors.torch import load_file, save_file\n"
            "        f = tmp / 'adapter_model.safetensors'\n"
            "        kept = {k: v for k, v in load_file(f).items() if 'trainable_tokens' not in k}\n"
            "        save_file(kept, f, metadata={'format': 'pt'})\n"
            "    return Path(output_dir)\n\n\ndef save_full_model(",
        ),
        [RELOAD_LORA],
    ),
    _m(
        "adapter_dora_magnitude_not_saved",
        "adapter",
        "a DoRA adapter is written without its magnitude vectors (peft reloads them from the base weights' norms)",
        Edit(
            "training/export.py",
            "        tokenizer.save_pretrained(str(tmp))\n    return Path(output_dir)\n\n\ndef save_full_model(",
            "        tokenizer.save_pretrained(str(tmp))\n"
            "        from safetensors.torch import load_file, save_file\n"
            "        f = tmp / 'adapter_model.safetensors'\n"
            "        kept = {k: v for k, v in load_file(f).items() if 'lora_magnitude_vector' not in k}\n"
            "        save_file(kept, f, metadata={'format': 'pt'})\n"
            "    return Path(output_dir)\n\n\ndef save_full_model(",
        ),
        ["tests/distributed/test_adapters.py::test_dora_two_ranks_match_one_process_and_reload"],
    ),
    _m(
        "adapter_modules_to_save_not_saved",
        "adapter",
        "the fully trained --modules_to_save (embed_tokens, lm_head) are left out of the written adapter",
        Edit(
            "training/export.py",
            "        tokenizer.save_pretrained(str(tmp))\n    return Path(output_dir)\n\n\ndef save_full_model(",
            "        tokenizer.save_pretrained(str(tmp))\n"
            "        from safetensors.torch import load_file, save_file\n"
            "        f = tmp / 'adapter_model.safetensors'\n"
            "        kept = {k: v for k, v in load_file(f).items() if 'lora_' in k}\n"
            "        save_file(kept, f, metadata={'format': 'pt'})\n"
            "    return Path(output_dir)\n\n\ndef save_full_model(",
        ),
        ["tests/e2e/test_merge_after_training.py::test_modules_to_save_are_trained_in_full_saved_resized_and_reload"],
    ),
    # ---------------------------------------------------------------- resume state
    _m(
        "resume_optimizer_not_restored",
        "resume",
        "resuming a sharded checkpoint restores the weights but not the optimizer state (fresh Adam moments)",
        # Not just the set_state_dict call: DCP loads in place into the optimizer's own state tensors, so leaving
        # out only that call is an equivalent mutant. The optimizer is left out of what is loaded.
        Edit(
            "parallel/checkpoint.py",
            "    state = _template(model, optimizer)\n    try:\n        dcp.load(",
            "    state, optimizer = _template(model, None), None\n    try:\n        dcp.load(",
        ),
        [f"{CKPT_UNIT}::test_save_then_load_restores_everything_bit_for_bit"],
    ),
    _m(
        "resume_full_optimizer_not_restored",
        "resume",
        "resuming a FULL_STATE_DICT checkpoint restores the weights but not the optimizer state",
        Edit(
            "parallel/checkpoint.py",
            "    _apply(model, optimizer, _from_full(template, full))",
            "    _apply(model, None, {'model': _from_full(template, full)['model']})",
        ),
        [f"{CKPT_UNIT}::test_save_then_load_restores_everything_bit_for_bit[adamw_torch-FULL_STATE_DICT]"],
    ),
    _m(
        "resume_scheduler_not_restored",
        "resume",
        "resuming does not restore the learning-rate scheduler (the schedule restarts at step 0)",
        Edit(
            "parallel/checkpoint.py",
            '    scheduler.load_state_dict(_read(path / "scheduler.pt"))',
            '    _read(path / "scheduler.pt")',
        ),
        [f"{CKPT_UNIT}::test_save_then_load_restores_everything_bit_for_bit"],
    ),
    _m(
        "resume_data_position_reset",
        "resume",
        "the resumed loop state starts the epoch's data from its first micro-batch again",
        Edit(
            "parallel/checkpoint.py",
            '    loop["batch_in_epoch"] = samples // per_micro',
            '    loop["batch_in_epoch"] = 0',
        ),
        [f"{CKPT_UNIT}::test_resume_position_keeps_the_sample_across_world_sizes"],
    ),
    _m(
        "resume_loop_ignores_position",
        "resume",
        "the training loop ignores the restored data position (LoopState.batch_in_epoch) and replays the epoch "
        "from its start",
        Edit("training/trainer.py", "            start_batch=start,\n", "            start_batch=0,\n"),
        ["tests/unit/test_resume_loop.py", CKPT_UNIT],
    ),
    _m(
        "resume_rng_not_restored",
        "resume",
        "resuming does not restore the ranks' RNG states (dropout masks and shuffles differ from an uninterrupted run)",
        Edit(
            "parallel/checkpoint.py",
            '    _set_rng_state(_read(path / f"rng_rank{rank % saved_world}.pt"))',
            '    _read(path / f"rng_rank{rank % saved_world}.pt")',
        ),
        [f"{CKPT_UNIT}::test_save_then_load_restores_everything_bit_for_bit"],
    ),
    # ---------------------------------------------------------------- merge scaling
    _m(
        "merge_scale_x2",
        "merge",
        "the merge adds 2·alpha/r·BA instead of alpha/r·BA",
        Edit("merge/plan.py", "else alpha / rank\n", "else 2 * alpha / rank\n"),
        [MERGE_CASE.format("lora")],
    ),
    _m(
        "merge_no_scaling",
        "merge",
        "the merge adds BA without the alpha/r scaling",
        Edit("merge/plan.py", "else alpha / rank\n", "else 1.0\n"),
        [MERGE_CASE.format("lora")],
    ),
    _m(
        "merge_rslora_ignored",
        "merge",
        "an rsLoRA adapter is merged with alpha/r instead of alpha/sqrt(r)",
        Edit("merge/plan.py", "alpha / math.sqrt(rank) if cfg.use_rslora", "alpha / rank if cfg.use_rslora"),
        [MERGE_CASE.format("rslora")],
    ),
    _m(
        "merge_alpha_pattern_ignored",
        "merge",
        "the merge uses lora_alpha for every module, ignoring alpha_pattern",
        Edit(
            "merge/plan.py",
            "    alpha = cfg.alpha_pattern.get(get_pattern_key(cfg.alpha_pattern.keys(), module), cfg.lora_alpha)",
            "    alpha = cfg.lora_alpha",
        ),
        [MERGE_CASE.format("patterns")],
    ),
    _m(
        "merge_lora_bias_unscaled",
        "merge",
        "a LoRA bias (lora_bias=True) is merged without the alpha/r scaling",
        Edit("merge/plan.py", ".add = bias * scale", ".add = bias"),
        ["tests/unit/test_merge.py::test_gpt2_conv1d_fan_in_fan_out_and_lora_bias"],
    ),
    _m(
        "merge_dora_magnitude_ignored",
        "merge",
        "a DoRA adapter is merged as plain LoRA (its magnitude vector ignored)",
        Edit(
            "merge/plan.py",
            '    magnitude = parts["magnitude"][1] if "magnitude" in parts else None',
            "    magnitude = None",
        ),
        [MERGE_CASE.format("dora")],
    ),
    # ---------------------------------------------------------------- preference loss terms
    _m(
        "dpo_reference_dropped",
        "preference",
        "DPO's log-ratios omit the reference log-probs",
        Edit(
            "objectives/loss.py",
            "chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected",
            "chosen_ratio, rejected_ratio = chosen, rejected",
        ),
        ["tests/unit/test_preference.py::test_dpo_first_step_equals_trl[sigmoid]"],
    ),
    _m(
        "dpo_beta_ignored",
        "preference",
        "DPO's sigmoid loss ignores beta (the rewards still use it)",
        Edit(
            "objectives/loss.py",
            "loss = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))",
            "loss = -F.logsigmoid(chosen_ratio - rejected_ratio)",
        ),
        ["tests/unit/test_preference.py::test_dpo_first_step_equals_trl[sigmoid]"],
    ),
    _m(
        "kto_kl_dropped",
        "preference",
        "KTO's loss leaves out the KL estimate z (the logged kl metric is still right)",
        Edit(
            "objectives/loss.py",
            "loss, rewards = self.losses(logps, ref[:n], desirable.bool(), kl)",
            "loss, rewards = self.losses(logps, ref[:n], desirable.bool(), 0.0)",
        ),
        ["tests/unit/test_kto.py::test_kto_first_step_equals_trl"],
    ),
    _m(
        "kto_kl_rows_matched",
        "preference",
        "KTO's KL rows pair each prompt with its own completion instead of a mismatched one (the KL estimate is "
        "then the examples' own log-ratio)",
        Edit("data/preference.py", "mismatched = chunk[j - 1][1]", "mismatched = chunk[j][1]"),
        ["tests/unit/test_kto.py::test_kl_rows_pair_each_prompt_with_the_previous_completion_of_its_group"],
    ),
    _m(
        "orpo_nll_not_backpropagated",
        "preference",
        "ORPO's NLL term is logged in the loss but left out of the tensor that is backpropagated",
        Edit("objectives/loss.py", "            loss = loss + nll\n", "            loss = loss + 0 * nll\n"),
        [
            ORPO_FIRST_STEP,
            "tests/unit/test_objective_backward.py",
        ],
    ),
    _m(
        "simpo_gamma_ignored",
        "preference",
        "SimPO's target margin gamma is left out",
        Edit("objectives/loss.py", "chosen - rejected - self.simpo_gamma / beta", "chosen - rejected"),
        ["tests/unit/test_reference_free_trainers.py::test_simpo_first_step_equals_trls_cpo_trainer"],
    ),
    _m(
        "kto_weights_swapped",
        "preference",
        "KTO weighs desirable examples by undesirable_weight and undesirable ones by desirable_weight",
        Edit(
            "objectives/loss.py",
            "        chosen = self.desirable_weight * (1",
            "        chosen = self.undesirable_weight * (1",
        ),
        ["tests/unit/test_kto.py::test_kto_first_step_equals_trl"],
    ),
    _m(
        "kto_kl_per_rank",
        "normalisation",
        "KTO's KL estimate is each rank's own mean, not the mean over the micro-batch of every rank",
        Edit(
            "objectives/loss.py",
            "        kl_sum, kl_count = all_reduce_sum(\n",
            "        kl_sum, kl_count = (lambda v, d: v)(\n",
        ),
        ["tests/distributed/test_kto_cli.py"],
    ),
    _m(
        "replicated_base_not_sent",
        "sharding",
        "With the frozen base replicated, rank 0 keeps its weights and the other ranks' copies are never sent (zeros)",
        Edit(
            "parallel/loading.py",
            "        dist.broadcast(buf, src=node.src, group=node.group)\n        param.copy_(buf)\n",
            "        param.copy_(buf) if sender else param.zero_()\n",
        ),
        ["tests/distributed/test_frozen_base.py::test_qlora_bf16_replicated_trains_as_sharded"],
    ),
    _m(
        "replicated_base_uncast",
        "sharding",
        "With the frozen base replicated, weights stored in another dtype are left in it (FSDP would cast them)",
        Edit("parallel/fsdp.py", "                    p.data = p.data.to(param_dtype)\n", "                    pass\n"),
        ["tests/unit/test_frozen_base_choice.py::test_frozen_parameters_are_cast_once_to_the_compute_dtype"],
    ),
    _m(
        "router_aux_unscaled",
        "gradient scale",
        "The router load-balancing term's gradient is not scaled like the cross-entropy's (FSDP's 1/N averaging "
        "not undone for it on several ranks)",
        Edit(
            "objectives/loss.py",
            "return (ce + _aux_term(model, aux, totals, sums)) * grad_scale, sums",
            "return ce * grad_scale + _aux_term(model, aux, totals, sums), sums",
        ),
        [ROUTER_AUX_RANKS],
    ),
    _m(
        "expert_lora_dropped",
        "adapter",
        "--lora_target_experts resolves the expert tensors but PEFT is never given them: attention-only LoRA trains "
        "(2 ranks still equal 1 process)",
        Edit("models/adapter.py", "        target_parameters=params,\n", "        target_parameters=None,\n"),
        [EXPERTS_E2E.format("two_ranks_match_one_process")],
    ),
    _m(
        "expert_merge_rows_swapped",
        "merge",
        "The merge gives a per-expert tensor the delta of the other half of gate_up_proj (up's rows to gate_proj)",
        Edit(
            "merge/experts.py",
            "out.append(WrapperEdit(stored, a[e], b[e][rows], scale, transposed=False))",
            "out.append(WrapperEdit(stored, a[e], b[e][len(b[e]) - rows.stop : len(b[e]) - rows.start], scale, "
            "transposed=False))",
        ),
        [EXPERTS_E2E.format("reloads_in_peft_merges_and_chats")],
    ),
    _m(
        "cp_document_leak",
        "masking",
        "With context parallelism, the part of a document begun in an earlier chunk attends the row's keys from the "
        "row's start, earlier documents included",
        Edit(
            "parallel/split.py",
            "parts.append(Part(offset, offset + n, key_start=starts[d], key_end=s + n))",
            "parts.append(Part(offset, offset + n, key_start=0, key_end=s + n))",
        ),
        [
            CP_TESTS.format("the_split_covers_every_position_once_and_attends_as_one_row"),
            CP_TESTS.format("context_parallel_ranks_train_as_one_process[cp2-lora]"),
        ],
    ),
    _m(
        "cp_zigzag_overlap",
        "sharding",
        "The zigzag split gives rank i chunk i twice instead of chunks i and 2·cp-1-i (half of every row never "
        "trains, the other half twice)",
        Edit(
            "parallel/split.py",
            "first, second = rank * chunk, (2 * size - 1 - rank) * chunk",
            "first, second = rank * chunk, rank * chunk",
        ),
        [CP_TESTS.format("the_split_covers_every_position_once_and_attends_as_one_row")],
    ),
    _m(
        "cp_stale_shard",
        "masking",
        "With context parallelism and several micro-batches per step, every micro-batch's attention reads the last "
        "micro-batch's split (its documents and key ranges)",
        Edit(
            "training/trainer.py",
            "        model.cp_shard = shard  # this micro-batch's, for its forward and the recomputation in its backward",
            "        model.cp_shard = parts_of[-1][1]",
        ),
        [CP_TESTS.format("context_parallel_ranks_train_as_one_process[cp2-accum]")],
    ),
    _m(
        "cp_row_sum_backward_identity",
        "gradient scale",
        "With context parallelism, the per-row log-probs' sum over the cp ranks passes its gradient back unsummed "
        "(each rank's share of the loss then gives 1/cp of its gradient)",
        Edit(
            "parallel/context_parallel.py",
            "        grad = grad.contiguous().clone()\n        dist.all_reduce(grad, group=ctx.group)\n        return grad, None",
            "        return grad, None",
        ),
        [CP_PREFERENCE.format("orpo")],
    ),
    _m(
        "cp_varlen_key_offset",
        "masking",
        "With context parallelism on flash-attention varlen, a crossing part's keys start one position late (the "
        "document's first key never attended)",
        Edit(
            "parallel/split.py",
            "keys.append(torch.arange(start + p.key_start, start + p.key_end))",
            "keys.append(torch.arange(start + p.key_start + 1, start + p.key_end))",
        ),
        ["tests/unit/test_cp_varlen.py::test_every_rank_equals_the_whole_rows_and_the_sdpa_path[2]"],
    ),
    _m(
        "cp_prefix_query_grad_dropped",
        "masking",
        "On CPU, a document begun before its queries (a context-parallel crossing part) returns only the causal "
        "block's share of the query gradient (the keys before the queries contribute none)",
        Edit("models/fastpath.py", "return dq_a + dq_b, dk_a,", "return dq_b, dk_a,"),
        ["tests/unit/test_fastpath.py::test_queries_over_keys_from_the_document_start_equal_masked_attention"],
    ),
    _m(
        "cp_router_aux_per_rank",
        "normalisation",
        "With context parallelism, each rank's router load-balancing loss counts only its own part of the rows' "
        "tokens (the expert fractions of a part, not of the micro-batch)",
        Edit(
            "models/training_module.py",
            "        if self.cp_shard is not None and isinstance(logits, tuple) and logits:  # the whole rows' tokens",
            "        if False:",
        ),
        [ROUTER_AUX_CP],
    ),
    _m(
        "expert_4bit_scales_shared",
        "quantization",
        "Every 4-bit expert is dequantized with expert 0's block scales (the stacked quantization state indexed "
        "wrongly)",
        Edit("models/quant_experts.py", "absmax=s.absmax[e], shape=", "absmax=s.absmax[0], shape="),
        [QUANT_EXPERTS.format("4bit_experts_compute_what_transformers_computes_with_the_same_weights[mixtral]")],
    ),
    _m(
        "expert_lora_4bit_layout",
        "adapter",
        "Expert LoRA on 4-bit experts reads expert e's B from PEFT's (out, r·E) factor as r consecutive columns "
        "rather than every E-th (the layout plain PEFT saves and loads)",
        Edit(
            "models/quant_experts.py",
            "b_e = B.view(B.shape[0], r, wrapper.num_experts)[:, :, e]",
            "b_e = B.view(B.shape[0], wrapper.num_experts, r)[:, e, :]",
        ),
        [QUANT_EXPERTS.format("expert_lora_on_4bit_experts_equals_peft_on_the_same_weights[qwen3_moe]")],
    ),
)
