"""Another trainer's checkpoint save as a phase of the estimate (`PlanInputs.sharded_checkpoint`): the HF Trainer
saving an FSDP1 SHARDED_STATE_DICT checkpoint copies every parameter's shard on the GPU (docs/plan.md, "The
checkpoint save"). shardtune's own runs save the trainable tensors only and have no such phase.
"""

from __future__ import annotations

from shardtune.planning.model import Tensor, sharded_bytes

# Present only with sharded_checkpoint=True: the GPU copies a SHARDED_STATE_DICT save makes (see sharded_save).
SAVE_COPIES_ROW = "state dict copies (checkpoint save)"
SAVE_PHASE = "checkpoint save (FSDP1 SHARDED_STATE_DICT)"


def sharded_save(tensors: list[Tensor], num_layers: int, shard: int) -> tuple[int, int]:
    """(copies, gathered) bytes at the peak of an FSDP1 SHARDED_STATE_DICT `model.state_dict()`.

    torch's `_sharded_pre_state_dict_hook` unshards each FSDP unit on the GPU (offload_to_cpu=False whatever the
    config), and `_sharded_post_state_dict_hook` replaces every parameter by a ShardedTensor holding a GPU clone of
    its `torch.chunk` for this rank (`_create_chunk_sharded_tensor`); accelerate's default ShardedStateDictConfig
    does not move it to the CPU. The root unit stays unsharded until its own post-hook, which runs after every
    block's, so the peak is either the last block (all block copies, that block and the root unsharded) or the
    root (all copies, the root unsharded). Parameters are gathered in their stored dtype (summon_full_params
    forces full precision).
    """

    def per_rank(group: str) -> int:
        return sum(sharded_bytes(t, shard) for t in tensors if t.group == group)

    def full(group: str) -> int:
        return sum(t.numel * t.itemsize for t in tensors if t.group == group)

    block_copies = per_rank("block") * num_layers
    last_block = (block_copies, full("root") + full("block"))
    root = (block_copies + per_rank("root"), full("root"))
    return max(last_block, root, key=sum)


def with_checkpoint_save(
    step: dict[str, int],
    state: dict[str, int],
    tensors: list[Tensor],
    num_layers: int,
    shard: int,
    on_gpu: int,
    step_phase: str,
) -> tuple[dict[str, int], str]:
    """The step's rows, or the checkpoint save's if it needs more: the resident model state (gradients are
    freed by the Trainer's zero_grad before it saves), the quantization constants, the units gathered for the
    save and the copies of `_sharded_save`.

    The save runs after the step, with the step's blocks cached: the allocator takes new memory only for what
    exceeds them, so the reserved peak is the larger of the step's reserved bytes and the save's live bytes. The
    save gets no fragmentation term: replayed through the allocator's rules its own sequence reserves at most
    0.17 GiB beyond its live bytes (bench/allocator_replay.py --save), and the only measured saves (the guide's
    QLoRA rows) sit at their live bytes. A modelling choice made with those rows in view, so they do not check
    it; docs/plan.md ("The checkpoint save") says which rows depend on it and what GPU run would settle it.
    """
    copies, gathered = sharded_save(tensors, num_layers, shard)
    rows = [k for k in step if k != "allocator overhead"] + [SAVE_COPIES_ROW, "allocator overhead"]
    save = dict.fromkeys(rows, 0)  # "allocator overhead" stays 0: no fragmentation in the save
    save.update(
        {
            "frozen base weights": state["frozen"] * on_gpu,
            "quantization constants": step["quantization constants"],
            "trainable weights": state["trainable"] * on_gpu,
            "optimizer state": state["optimizer"] * on_gpu,
            "FSDP all-gather buffers": gathered,
            SAVE_COPIES_ROW: copies,
        }
    )
    if sum(save.values()) <= sum(step.values()):  # within what the step already reserved
        return {k: step.get(k, 0) for k in rows}, step_phase
    return save, SAVE_PHASE
