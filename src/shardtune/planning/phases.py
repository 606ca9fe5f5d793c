"""The moments of a training step at which per-GPU memory can peak, as FSDP2 and autograd hold it.

Each phase lists what is alive then; the estimate reports the largest. The phases and what each holds were read
from torch's FSDP2 code (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) and checked against the step
traced under fake tensors (shardtune.planning.trace, tests/unit/test_plan_trace.py):

- forward, at the first block's all-gather: FSDP2 keeps a forward all-gather's flat output alive until the next
  group's copy-out ("defer free to allow for overlap of this copy-out with next all-gather", wait_for_unshard),
  so the root's and the first block's gathered parameters exist twice (flat buffer + per-parameter copies)
  when a parameter is split over more than one rank; with one rank there is no flat buffer.
- forward, at a later block's all-gather: the previous block is resharded, but its flat all-gather output
  is freed only after this block's copy-out, so (sharded) two blocks' flat outputs and this block's copies exist
  beside the root's gathered parameters: more than the first block's phase when a block outweighs the root
  (mixture-of-experts blocks); only with two blocks or more.
- a block's forward (the last): the stored activations of every block, the block's forward intermediates (the
  MLP holds its gate and up outputs, act(gate) and their product at once: 4 I-wide tensors per token), the root,
  the block and (sharded) its flat all-gather output.
- the loss's forward: one chunk's fp32 logits and their log-softmax (the compute-dtype logits are freed by
  `.float()`), beside the stored activations and the root and last block still gathered (the last block's flat
  all-gather output too: the root's post-forward frees it, and the loss runs inside the root's forward).
- the loss's backward: the root and the last block are still gathered (neither is resharded after forward);
  no gradient exists yet in the first micro-batch (the previous step set them to None).
- a decoder block's backward: the root, the block and the prefetched next one gathered; the block's activations
  recomputed and its backward's working memory; gradients of the blocks done; the head's unsharded gradient
  when it trains.
- a block's reduce-scatter (post-backward): its activations are freed, its unsharded gradients and their fp32
  reduce-scatter input exist, beside the root and that block still gathered.
- the root's backward (when the root trains: full fine-tuning, saved modules, new token rows): every block's
  gradient shards (not yet the root's own) and the root's unsharded gradients with their fp32 reduce-scatter
  input; the root is already resharded (FSDP2 reshards before it reduces) and the activations are freed.
- online RL's rollout (GENERATION, between optimizer steps: planning.generation): the weights gathered for it,
  the KV cache, a forward's activations, the last position's logits and sampling's temporaries; no gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardtune.planning.allocator import CachingAllocator

FORWARD = "forward (first block's all-gather)"
LATER_FORWARD = "forward (a later block's all-gather)"
BLOCK_FORWARD = "a block's forward"
LOSS_FORWARD = "loss forward"
LOSS = "loss backward"
LAYER = "decoder-layer backward"
BLOCK_SCATTER = "a block's reduce-scatter"
ROOT = "root backward (root gradients' reduce-scatter)"
# Between optimizer steps, not in one: online RL's rollout on the training ranks (planning.generation).
GENERATION = "generation (the rollout between optimizer steps)"


@dataclass
class StepParts:
    """Bytes per rank of the pieces the phases combine."""

    state: dict[str, int]  # frozen, trainable, gradients, optimizer (sharded, on the GPU or offloaded)
    on_gpu: int  # 0 with CPU offload, else 1
    quant_constants: int
    root_gathered: int  # the root's unsharded parameters in the compute dtype
    root_casts: tuple[int, ...]  # bytes of each root shard stored in another dtype, cast for its all-gather
    block_casts: tuple[int, ...]  # a block's
    block_gathered: int  # one block's
    blocks_in_flight: int  # blocks gathered during backward (2 with prefetch; every block without resharding)
    kept_after_forward: int  # blocks still gathered after forward (1: the last; every block without resharding)
    flat_copy: bool  # parameters split over more than one rank: forward all-gathers keep their flat output
    offload_copies: int  # host-to-GPU copies of offloaded shards being gathered
    block_scatter: int  # one block's unsharded gradients + fp32 reduce-scatter input
    root_scatter: int  # the root's
    root_grad_shard: int  # the root's sharded gradients
    root_early_grads: int  # the root's unsharded gradients made before the blocks' backward (head, final norm)
    grad_accum: int
    forward_activations: int  # embeddings' output and masks at the first block
    stored: int  # activations kept for backward
    layer_stored: int  # those still kept when the blocks run backward (the final norm's and the head's are freed)
    working: int  # one block's recomputation and backward working memory
    logits_peak: int
    logits_kept: int
    logits_forward: int
    forward_working: int  # a block's forward intermediates
    num_blocks: int = 2
    block_stored: int = 0  # one block's part of layer_stored, freed once that block has run backward
    block_scatter_input: int = 0  # one block's fp32 reduce-scatter input, kept until the next block reduces
    batch_inputs: int = 0  # the micro-batch's tensors, alive through the whole step
    generation_gather_alive: int = 0  # flat all-gather outputs alive at the generation phase's peak


def temporaries(p: StepParts, phase: str) -> int:
    """Of a phase's activations and logits rows, the bytes its backward makes (FSDP2's tracker files them as
    temporaries, and what forward and the inputs made as activations): the loss's backward peak, and a block's
    recomputation and backward working memory."""
    return {LOSS: p.logits_peak, LAYER: p.working}.get(phase, 0)


def device_rows(p: StepParts, *, gradients: int, activations: int, logits: int, gather: int, scatter: int) -> dict:
    """A phase's rows: the resident state (on the GPU unless offloaded) and what the phase adds."""
    return {
        "frozen base weights": p.state["frozen"] * p.on_gpu,
        "quantization constants": p.quant_constants,
        "trainable weights": p.state["trainable"] * p.on_gpu,
        "gradients": gradients * p.on_gpu,
        "optimizer state": p.state["optimizer"] * p.on_gpu,
        "activations": activations,
        "logits and loss": logits,
        "FSDP all-gather buffers": gather,
        "FSDP reduce-scatter buffers": scatter,
    }


def step_phases(p: StepParts) -> dict[str, dict[str, int]]:
    """{phase: device rows}; gradients before the blocks' backward exist only from the second micro-batch on."""
    early_grads = p.state["gradients"] if p.grad_accum > 1 else 0
    # The root's gradient shards come after every block's, except from the second micro-batch on.
    block_grads = p.state["gradients"] - (p.root_grad_shard if p.grad_accum == 1 else 0)
    copies = 2 if p.flat_copy else 1
    phases = {
        FORWARD: device_rows(
            p,
            gradients=early_grads,
            activations=p.forward_activations,
            logits=0,
            gather=copies * (p.root_gathered + p.block_gathered) + p.offload_copies,
            scatter=0,
        ),
        BLOCK_FORWARD: device_rows(
            p,
            gradients=early_grads,
            activations=p.layer_stored + p.forward_working,
            logits=0,
            gather=p.root_gathered + copies * p.block_gathered + p.offload_copies,
            scatter=0,
        ),
        LOSS_FORWARD: device_rows(
            p,
            gradients=early_grads,
            activations=p.stored,
            logits=p.logits_forward,
            # the last block's flat all-gather output is freed only by the root's post-forward, after the loss
            gather=p.root_gathered + (p.kept_after_forward + copies - 1) * p.block_gathered + p.offload_copies,
            scatter=0,
        ),
        LOSS: device_rows(
            p,
            gradients=early_grads,
            activations=p.stored,
            logits=p.logits_peak,
            gather=p.root_gathered + p.kept_after_forward * p.block_gathered + p.offload_copies,
            scatter=0,
        ),
        LAYER: _layer_phase(p, block_grads),
        BLOCK_SCATTER: device_rows(
            p,
            gradients=block_grads,
            activations=p.forward_activations,
            logits=p.logits_kept,
            gather=p.root_gathered + p.block_gathered + p.offload_copies,
            scatter=p.root_early_grads + p.block_scatter,
        ),
    }
    if p.num_blocks > 1:
        # the last block's all-gather: every earlier block's stored activations exist
        phases[LATER_FORWARD] = device_rows(
            p,
            gradients=early_grads,
            activations=p.forward_activations + (p.num_blocks - 1) * p.block_stored,
            logits=0,
            gather=p.root_gathered + (2 * copies - 1) * p.block_gathered + p.offload_copies,
            scatter=0,
        )
    if p.root_scatter:
        phases[ROOT] = device_rows(
            p, gradients=block_grads, activations=p.batch_inputs, logits=0, gather=0, scatter=p.root_scatter
        )
    return phases


def _layer_phase(p: StepParts, block_grads: int) -> dict[str, int]:
    """A block's backward, at the block where it peaks. The j-th block to run backward (j = 0 the last block)
    still has the stored activations of the L − j blocks not yet done, the gradient shards of the j done (in the
    first micro-batch; later ones hold every gradient from their start), the previous block's reduce-scatter
    input (FSDP2 keeps it in `comm_ctx.reduce_scatter_state` until the next block's post-backward reduces), and
    the next block prefetched (none after block 0). Linear in j between the ends: the largest is at the last
    block, the next one, the next-to-last or the first."""
    n = p.num_blocks
    phases = []
    for j in sorted({0, min(1, n - 1), max(n - 2, 0), n - 1}):
        grads = block_grads if p.grad_accum > 1 else block_grads * j // n
        in_flight = p.blocks_in_flight if j < n - 1 or p.kept_after_forward > 1 else 1
        rows = device_rows(
            p,
            gradients=grads + (p.block_scatter_input if j else 0),
            activations=p.layer_stored - j * p.block_stored + p.working,
            logits=p.logits_kept,
            gather=p.root_gathered + in_flight * p.block_gathered + p.offload_copies,
            scatter=p.root_early_grads,
        )
        phases.append(rows)
    return max(phases, key=lambda r: sum(r.values()))


def peak_phase(phases: dict[str, dict[str, int]]) -> str:
    return max(phases, key=lambda k: sum(phases[k].values()))


def forward_gather_cache(p: StepParts) -> int:
    """Bytes the caching allocator reserves for FSDP2's forward all-gathers on their copy-in stream
    (foreach_all_gather runs under `device_handle.stream(all_gather_copy_in_stream)`; a cached block serves only
    its own stream, so at a backward peak this memory holds at most the prefetched block: forward_gather_alive).

    Derived by running the allocator's rules (planning.allocator) on FSDP2's forward sequence: each group's
    shards stored in another dtype are cast to the compute dtype, its flat output allocated and the casts freed;
    a flat output lives until the next group's copy-out (see the forward phases above), so the root's and the
    first block's exist together, and each later block's comes while the previous one's is alive. Three blocks
    reach the steady state (a block reuses the blocks of the one two before it). Without a flat output (one rank
    per shard group) FSDP2 copies no flat buffer there."""
    if not p.flat_copy:
        return 0
    a = CachingAllocator()

    def gather(group: object, casts: tuple[int, ...], flat: int) -> None:
        for i, n in enumerate(casts):
            a.malloc((group, i), n)
        a.malloc(group, flat)
        for i in range(len(casts)):
            a.free((group, i))

    gather("root", p.root_casts, p.root_gathered)
    previous: object = "root"
    for block in range(min(p.num_blocks, 3)):
        gather(block, p.block_casts, p.block_gathered)
        a.free(previous)
        previous = block
    return a.result().reserved


def forward_gather_alive(p: StepParts, phase: str) -> int:
    """Of `forward_gather_cache`, the flat all-gather outputs alive (allocated) at `phase`. Backward prefetches
    also gather on that stream (FSDPCommContext.get_all_gather_streams: separate streams in FORWARD and
    PRE_BACKWARD), and a prefetched block's flat output lives until its copy-out, when its backward starts."""
    if not p.flat_copy:
        return 0
    prefetched = p.block_gathered if p.blocks_in_flight > 1 else 0
    return {
        FORWARD: p.root_gathered + p.block_gathered,
        BLOCK_FORWARD: p.block_gathered,
        LOSS_FORWARD: p.block_gathered,
        LATER_FORWARD: 2 * p.block_gathered,
        LAYER: prefetched,
        BLOCK_SCATTER: prefetched,
        GENERATION: p.generation_gather_alive,
    }.get(phase, 0)
