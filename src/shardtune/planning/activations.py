"""Activation and loss memory of a Llama-style decoder in training, per token, as autograd keeps it.

`layer_saved_bytes_per_token` lists what autograd saves for backward inside one decoder layer of transformers'
Llama code with peft LoRA layers. Every term is checked against the tensors torch's saved-tensor hooks see on a
small model (tests/unit/test_plan.py), so only the sizes, not the list, are extrapolated to large models.
"""

from __future__ import annotations

import math

from shardtune.models.fastpath import SPAN_TOKENS
from shardtune.planning.shape import ModelShape

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
LOSS_IMPLEMENTATIONS = ("chunked", "full", "full_fp32")
# CUDA's dropout keeps a bool mask (1 byte per element); its CPU kernel keeps the mask in the input's dtype.
CUDA_DROPOUT_MASK_BYTES = 1
# SDPA's math kernel computes in fp32 whatever its inputs' dtype, and keeps fp32 tensors for backward: torch
# allows fp16/bf16 reductions there only on request (torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp, off
# by default; the kernel is the same composite on every device). Seen on bf16 inputs in
# tests/unit/test_plan_packed_attention.py.
MATH_SDPA_BYTES = 4


def _linear_input_groups(
    shape: ModelShape, attn_implementation: str, per_document: bool = False
) -> list[tuple[tuple[str, ...], int, bool]]:
    """(linears that read the same input, input features, whether that input is already kept by attention)."""
    # flash and SDPA return their output as a transposed view of a [batch, seq, heads, dim] buffer they keep for
    # backward, so o_proj's input is that same storage; eager attention makes a contiguous copy, and so does
    # shardtune's per-document attention (the spans' outputs are concatenated into a new tensor).
    o_shared = attn_implementation != "eager" and not per_document and not shape.latent_attention
    attention = [(("q_proj", "k_proj", "v_proj"), shape.hidden_size, False), (("o_proj",), shape.o_dim, o_shared)]
    if shape.latent_attention:
        attention = _latent_attention_groups(shape, o_shared)
    if shape.num_experts:  # the routed experts are not linears (see _mlp_saved_bytes); a shared expert's are
        return attention + _shared_expert_groups(shape)
    return [
        *attention,
        (("gate_proj", "up_proj"), shape.hidden_size, False),
        (("down_proj",), shape.intermediate_size, False),
    ]


def _latent_attention_groups(shape: ModelShape, o_shared: bool) -> list[tuple[tuple[str, ...], int, bool]]:
    """Multi-latent attention's linears: the hidden state read by the query's and the key-value latent's first
    factor, each latent's normed output read by its second factor (a new tensor), and o_proj's input, which the
    attention does not keep: transformers copies the output of a latent attention (measured on CPU: a separate
    storage from the kernel's output, unlike Llama's)."""
    groups = [(("q_proj", "q_a_proj", "kv_a_proj_with_mqa"), shape.hidden_size, False)]
    if shape.q_lora_rank:
        groups.append((("q_b_proj",), shape.q_lora_rank, False))
    return [*groups, (("kv_b_proj",), shape.kv_lora_rank, False), (("o_proj",), shape.o_dim, o_shared)]


def _extra_norm_bytes(shape: ModelShape, a: int, full_finetune: bool) -> int:
    """Per token, the RMSNorms beyond the two of hidden width: multi-latent attention's (of the query and the
    key-value latents) and ModelShape.extra_norms (query and key norms, Gemma's further norms). Each keeps an fp32
    copy of its input and an rsqrt per row it normalises, and its normed output when its weight is trained."""
    norms = [(w, 1) for w in (shape.q_lora_rank, shape.kv_lora_rank) if w] + list(shape.extra_norms)
    return sum(4 * w + 4 * rows + (a * w if full_finetune else 0) for w, rows in norms)


def _shared_expert_groups(shape: ModelShape) -> list[tuple[tuple[str, ...], int, bool]]:
    s = shape.shared_expert_intermediate_size
    if not s:
        return []
    return [(("shared_gate_proj", "shared_up_proj"), shape.hidden_size, False), (("shared_down_proj",), s, False)]


def _mlp_saved_bytes(shape: ModelShape, a: int, full_finetune: bool) -> int:
    """Per token: a dense MLP keeps its gate and up outputs and act(gate) (its inputs are _linear_input_groups').

    A mixture of experts as transformers runs it (integrations/moe.py, grouped_mm, its default) keeps, per token:
    the router's fp32 softmax (E), its top-k indices (int64) and weights (the in-place renormalisation keeps the
    weights and their fp32 sum); per routed copy (k of them), the sort permutation and the gather index (int64
    each), the inverse permutation (int64), the gathered fp32 routing weight, the gate_up output (2·I_e) and
    act(gate) (I_e) for the gate's backward, and the down output (h) that the routing weight multiplies. A frozen
    expert's grouped_mm keeps no input; with trained experts (full fine-tuning) the gathered tokens (h) and the
    product (I_e) are kept for the weight gradients, and the router's input (h) for its own."""
    if not shape.num_experts:
        return 3 * a * shape.intermediate_size
    k, ie, h, e = shape.experts_per_token or 1, shape.expert_intermediate_size, shape.hidden_size, shape.num_experts
    router = 4 * e + 8 * k + 4 * k + 4
    routed = k * (8 + 8 + 8 + 4 + a * (3 * ie + h))
    trained = a * h + k * a * (h + ie) if full_finetune else 0
    shared = 3 * a * shape.shared_expert_intermediate_size  # a dense MLP's (its linears' inputs: the groups')
    return router + routed + trained + shared


def kernel_attention_bytes(shape: ModelShape, a: int) -> int:
    """Per token, SDPA's fused kernels (flash, memory-efficient; also flash-attention 2) without a mask tensor:
    q, k and v as given (GQA's fewer key heads taken as they are; what a latent attention's values keep alive), the
    output and an fp32 logsumexp per head."""
    return a * (shape.q_dim + shape.kv_dim + shape.v_kept + shape.o_dim) + 4 * shape.num_heads


def math_span_bytes(shape: ModelShape, a: int, span: int) -> int:
    """Per token of a span of `span` positions on SDPA's math kernel (shardtune's short spans): the composite keeps,
    in fp32 (MATH_SDPA_BYTES), the scaled queries, the keys repeated to every query head (enable_gqa repeats them
    on this kernel) and scaled, the values repeated, and the softmax's output (heads x span per token), which both
    the softmax and the product with the values keep. Not its own output: the spans' outputs are concatenated
    into a new tensor, o_proj's input."""
    w = max(a, MATH_SDPA_BYTES)
    return w * (2 * shape.q_dim + shape.o_dim) + w * shape.num_heads * span


def per_document_attention_bytes(shape: ModelShape, seq_len: int, a: int, packed: bool) -> int:
    """Per token, shardtune's SDPA per span of whole documents (shardtune.models.fastpath.packed_sdpa_attention), at the
    most a row of seq_len positions can keep. Rows of at most SPAN_TOKENS positions run every span on the math
    kernel. An unpacked row is one document: longer, it runs on a fused kernel. A packed row's short documents share
    spans of up to SPAN_TOKENS positions (math kernel); a longer document runs on a fused kernel, which keeps its q,
    k and v as views of the row's whole tensors, so one such document keeps the whole row's q, k and v: the bound
    is a row of full short spans beside one long document (its own tokens keep less: output and logsumexp)."""
    if seq_len <= SPAN_TOKENS:
        return math_span_bytes(shape, a, seq_len)
    if not packed:
        return kernel_attention_bytes(shape, a)
    row_qkv = a * (shape.q_dim + shape.kv_dim + shape.v_kept)
    return math_span_bytes(shape, a, SPAN_TOKENS) + row_qkv


def _attention_bytes(
    shape: ModelShape, seq_len: int, a: int, attn_implementation: str, masked: bool, per_document: bool
) -> int:
    qd, nh = shape.q_dim, shape.num_heads
    if attn_implementation == "eager":
        # q and the repeated k, v are kept by the two matmuls (a latent attention's value view is copied into the
        # matmul's layout: o_dim); softmax keeps its fp32 output, the second matmul its cast to the compute dtype:
        # seq_len scores per head per token.
        probs = 4 * nh * seq_len + (a * nh * seq_len if a < 4 else 0)
        return a * (2 * qd + shape.o_dim) + probs
    if attn_implementation == "sdpa" and per_document:
        return per_document_attention_bytes(shape, seq_len, a, packed=masked)
    if not (masked and attn_implementation == "sdpa"):
        return kernel_attention_bytes(shape, a)
    # transformers' SDPA over a packed row with its 4-D bool mask: SDPA repeats k and v to every head when it is
    # given a mask, and turns a bool mask into an additive one in q's dtype (convert_boolean_attn_mask,
    # [batch, 1, seq, seq]), which it keeps for backward: seq·a bytes per token in every block. The values repeated
    # to every head are copies under GQA; a latent attention's heads are the values' own, a view of kv_b_proj's output.
    v_rep = shape.v_kept if shape.latent_attention else shape.o_dim
    return a * (2 * qd + v_rep + shape.o_dim) + 4 * nh + a * seq_len  # q, k, v, output, logsumexp, the mask


def layer_saved_bytes_per_token(
    shape: ModelShape,
    *,
    seq_len: int,
    compute_bytes: int,
    attn_implementation: str,
    lora_targets: tuple[str, ...] = (),
    lora_r: int = 8,
    lora_dropout: float = 0.0,
    full_finetune: bool = False,
    use_dora: bool = False,
    masked: bool = False,
    per_document: bool = False,
    dropout_mask_bytes: int = CUDA_DROPOUT_MASK_BYTES,
) -> int:
    """Bytes autograd keeps for backward per token in one decoder layer (frozen base + LoRA, or full FT).

    A frozen linear keeps nothing (its input is only needed for a weight gradient); LoRA's lora_A keeps its
    input (the dropout output, plus the dropout mask, one per wrapped module) and lora_B keeps lora_A's output.
    masked: rows are packed; per_document: SDPA runs per document (per_document_attention_bytes), not over
    whole rows with transformers' mask.
    """
    a, h = compute_bytes, shape.hidden_size
    per_document = per_document and attn_implementation == "sdpa"
    norm = 4 * h + 4 + (a * h if full_finetune else 0)  # fp32 copy of the input and rsqrt; normed output if trained
    total = 2 * norm + _attention_bytes(shape, seq_len, a, attn_implementation, masked, per_document)
    total += _extra_norm_bytes(shape, a, full_finetune)
    total += _mlp_saved_bytes(shape, a, full_finetune)
    for linears, fan_in, shared in _linear_input_groups(shape, attn_implementation, per_document):
        wrapped = [m for m in linears if m in lora_targets]
        if full_finetune or (wrapped and lora_dropout == 0):
            total += 0 if shared else a * fan_in
        if lora_dropout > 0:
            total += len(wrapped) * (dropout_mask_bytes + a) * fan_in
    dims = shape.linear_dims()
    for name in lora_targets:
        if name in dims:
            total += a * lora_r
            if use_dora:  # shardtune's DoRA forward keeps z = base + s·B·A·x to rescale it by g (models/dora.py)
                total += a * dims[name][1]
    return total


# The micro-batch's tensors on the device, alive through the step: input_ids, position_ids and labels (int64).
BATCH_TENSORS = 3


def step_input_bytes(shape: ModelShape, tokens: int, compute_bytes: int) -> int:
    """What every phase of a step holds besides the blocks' own tensors: the micro-batch (BATCH_TENSORS int64
    tensors) and the rotary embedding's cos and sin ([batch, seq, head_dim] in the compute dtype), made once per
    forward by the model and passed to every block, whose checkpoints keep them as inputs until backward ends."""
    return BATCH_TENSORS * 8 * tokens + 2 * tokens * shape.head_dim * compute_bytes


def loss_input_grad_bytes(
    tokens: int, hidden_size: int, compute_bytes: int, loss_impl: str = "chunked", chunk_tokens: int = 1024
) -> int:
    """The gradient of the head's input, [tokens, h] in the compute dtype: shardtune's chunked loss runs backward
    one chunk at a time, each adding its slice into it, so from the second chunk on it exists beside that chunk's
    logits gradients (none with a single chunk; the full losses make it after their logits are freed)."""
    return tokens * hidden_size * compute_bytes if loss_impl == "chunked" and tokens > chunk_tokens else 0


def backward_working_bytes_per_token(shape: ModelShape, compute_bytes: int, looped: bool = False) -> int:
    """Gradients alive at the peak of a block's backward, beyond what the block saved (`layer_saved_bytes_...`).

    The MLP runs backward first and peaks in the backward of `act(gate) * up`: the incoming gradient of the
    block's output (h wide) has produced the product's gradient (I wide), which produces the gradients of
    act(gate) and of up (I wide each) before it is freed; down_proj's input (the product, I wide, counted in the
    saved bytes) was freed when down_proj's backward ended. Net: 3 I-wide gradients - 1 freed saved tensor + the
    h-wide incoming gradient. Checked against the traced step (tests/unit/test_plan_trace.py).

    A mixture of experts (frozen experts, see _mlp_saved_bytes) peaks the same way per routed copy, in the
    backward of `act(gate) * up`: the gradients of the product (down's grouped_mm input gradient), of act(gate)
    and of up (3 I_e wide each), beside the incoming h-wide gradient; no grouped_mm input was kept, but the down
    output (h wide per copy) that the routing weights' multiply kept was freed when that backward ran.

    4-bit experts (`looped`: shardtune.models.quant_experts' loop, one expert at a time) hold those gradients for one
    expert's copies, k/E per token at an even routing. A shared expert's backward, a dense MLP's, runs before or
    after the routed experts' (the family's order): the larger of the two."""
    a, h, shared = compute_bytes, shape.hidden_size, shape.shared_expert_intermediate_size
    if shape.num_experts:
        k = (shape.experts_per_token or 1) / (shape.num_experts if looped else 1)
        routed = int(a * (h + 3 * k * shape.expert_intermediate_size - k * h))
        combine = 0 if looped else routed_combine_bytes(shape, a)[1]
        return max(routed, combine, a * (2 * shared + h) if shared else 0)
    return a * (2 * shape.intermediate_size + h)


def routed_combine_bytes(shape: ModelShape, compute_bytes: int) -> tuple[int, int]:
    """(forward, backward) per token of grouped_mm's combine (transformers' integrations/moe.py): each routed copy's
    down output times its routing weight, in the weights' dtype (fp32 where the family's router keeps them so:
    Mixtral, DeepSeek; ModelShape.routing_weight_bytes), put back in token order (a copy) and summed over the
    copies. Forward, at the reordering: the gathered tokens and the down output (still referenced by the
    function) beside the product and its copy. Backward: the reordering's gradient (a zero-filled tensor the
    copies' gradients are put into) beside the summed gradient made contiguous, then the product's backward with
    the gradients of the down output and of the weights: three k·h-wide tensors in the weights' dtype, and the
    h-wide incoming gradient. These outweigh the experts' own (3·I_e wide per copy) where the experts are narrow
    beside the hidden size: DeepSeek, Qwen3-MoE and the other fine-grained mixtures (seen in the trace)."""
    a, h, k = compute_bytes, shape.hidden_size, shape.experts_per_token or 1
    w = shape.routing_weight_bytes or a
    return k * h * (2 * a + 2 * w), 3 * w * k * h + a * h


def forward_working_bytes_per_token(shape: ModelShape, compute_bytes: int, looped: bool = False) -> int:
    """A block's MLP forward at its largest: dense, the gate and up outputs, act(gate) and their product (4 I
    wide); a mixture of experts, per routed copy, the gathered tokens, the gate_up output, act(gate), the product
    and the down output (h + 4·I_e + h): all copies at once in grouped_mm, one expert's (k/E per token at an even
    routing) in the loop of 4-bit experts (`looped`); a shared expert's, the dense MLP's, runs apart from them;
    grouped_mm's combine (routed_combine_bytes) after them."""
    if shape.num_experts:
        k = (shape.experts_per_token or 1) / (shape.num_experts if looped else 1)
        routed = int(compute_bytes * k * (4 * shape.expert_intermediate_size + 2 * shape.hidden_size))
        combine = 0 if looped else routed_combine_bytes(shape, compute_bytes)[0]
        return max(routed, combine, 4 * compute_bytes * shape.shared_expert_intermediate_size)
    return 4 * compute_bytes * shape.intermediate_size


def dora_transient_bytes(shape: ModelShape, compute_bytes: int, lora_targets: tuple[str, ...], lora_r: int = 0) -> int:
    """shardtune's DoRA forward (dora.dora_weight_norm) takes the weight's row norms from an fp32 copy of the
    weight, which exists while that layer runs (also in the recomputation): 4·in·out bytes for the largest
    wrapped linear, none when the weight already is fp32. In a block's recomputation this is the peak when it
    outweighs the backward's working memory: at down_proj (the largest, and the last linear of the block) every
    other recomputed tensor exists, and down_proj's base output (h wide) stands in for the rescaled output it
    keeps (`z`, counted in the saved bytes)."""
    dims = [d for name, d in shape.linear_dims().items() if name in lora_targets]
    if not dims or compute_bytes >= 4:
        return 0
    fan_in, fan_out = max(dims, key=lambda d: d[0] * d[1])
    # beside it, the norm's fp32 scratch: A and B upcast (r·in, out·r), W·Aᵀ (out·r) and the squared norms (out)
    return 4 * fan_in * fan_out + 4 * (lora_r * fan_in + 2 * lora_r * fan_out + fan_out)


def recompute_peak_bytes(
    shape: ModelShape,
    *,
    tokens: int,
    compute_bytes: int,
    layer: int,
    lora_targets: tuple[str, ...],
    lora_r: int,
    lora_dropout: float,
    full_finetune: bool,
    dropout_mask_bytes: int,
    dropout_scratch_bytes: int,
    dora: int,
    dequant: int,
) -> int:
    """A checkpointed block's recomputation at its peak, down_proj (the block's last linear, and its widest input):
    `layer` (the block's saved tensors) less what down_proj's own LoRA keeps, plus what is alive there without
    being kept for backward (the incoming h-wide gradient, the attention's residual sum, down_proj's base output;
    the MLP's input and the product act(gate)·up when no LoRA input keeps them), plus the largest transient of
    down_proj's forward: its DoRA norm (`dora`, dora_transient_bytes), its LoRA dropout drawing the mask (CPU:
    shardtune's FastDropout makes int64 random bits and an int32 copy, `dropout_scratch_bytes` per element, beside
    the new mask), or its dequantized 4-bit weight (before the base output exists); at least everything down_proj
    keeps, once its forward ends. Zero for a mixture of experts (no down_proj linear: the backward peaks)."""
    if shape.num_experts:
        return 0
    a, h, i = compute_bytes, shape.hidden_size, shape.intermediate_size
    down = "down_proj" in lora_targets
    dropped = down and lora_dropout > 0
    kept = tokens * ((a * lora_r if down else 0) + ((dropout_mask_bytes + a) * i if dropped else 0))
    kept += tokens * a * h if dora and down else 0  # DoRA's z, the rescaled output
    live = 3 * a * h
    if not (full_finetune or (lora_dropout == 0 and {"gate_proj", "up_proj"} & set(lora_targets))):
        live += a * h  # the MLP's input
    if not (full_finetune or (down and lora_dropout == 0)):
        live += a * i  # down_proj's input
    scratch = tokens * (dropout_scratch_bytes + dropout_mask_bytes) * i if dropped else 0
    transient = max(kept, dora, scratch, dequant - tokens * a * h)
    return layer - kept + tokens * live + transient


def dora_saved_bytes(shape: ModelShape, compute_bytes: int, lora_targets: tuple[str, ...]) -> int:
    """Per block, not per token: each DoRA module keeps its fp32 row norms (m / norm keeps the divisor) and the
    scale g = m / norm in the compute dtype (g·z keeps both factors) for backward."""
    dims = shape.linear_dims()
    return sum((4 + compute_bytes) * dims[name][1] for name in lora_targets if name in dims)


def expert_lora_saved_bytes(shape: ModelShape, compute_bytes: int, lora_targets: tuple[str, ...]) -> int:
    """Per block, not per token: PEFT's LoRA on a fused expert tensor (target_parameters) adds its delta to the
    whole tensor in the forward (W + s·B·A for every expert, one baddbmm), and the experts' matmul keeps that
    merged copy in the compute dtype for backward; a router's LoRA likewise keeps an (E, hidden) copy."""
    if not shape.num_experts:
        return 0
    per = {name: math.prod(shp) for name, shp in shape.expert_tensors().items()}
    n = sum(per.get(f"mlp.{t}", 0) for t in lora_targets)
    if "router" in lora_targets:
        n += shape.num_experts * shape.hidden_size
    return compute_bytes * n


def expert_lora_backward_bytes(shape: ModelShape, compute_bytes: int, lora_targets: tuple[str, ...]) -> int:
    """The transient of expert LoRA's backward in one block: the gradient of a merged expert tensor (its size), from
    which the LoRA factors' gradients are taken. down_proj's backward runs first, while every merged copy is still
    kept; gate_up_proj's after down_proj's copy is freed: max(down, gate_up - down)."""
    if not shape.num_experts:
        return 0
    sizes = {name: math.prod(shp) for name, shp in shape.expert_tensors().items()}
    down = sizes["mlp.experts.down_proj"] if "experts.down_proj" in lora_targets else 0
    gate_up = sizes["mlp.experts.gate_up_proj"] if "experts.gate_up_proj" in lora_targets else 0
    return compute_bytes * max(down, gate_up - down)


def expert_lora_4bit_saved_bytes_per_token(
    shape: ModelShape, compute_bytes: int, lora_targets: tuple[str, ...], lora_r: int
) -> int:
    """Per token: expert LoRA on 4-bit experts (models.quant_experts) is x·A_eᵀ·B_eᵀ beside each expert's 4-bit
    matmul (FSDP2 gathers the factors in the compute dtype): per routed copy, the input (h for gate_up_proj, I_e for
    down_proj, which the 4-bit matmul alone does not keep) and the r-wide product are kept for the factors'
    gradients. No merged copy."""
    if not shape.num_experts:
        return 0
    k = shape.experts_per_token or 1
    widths = {"experts.gate_up_proj": shape.hidden_size, "experts.down_proj": shape.expert_intermediate_size}
    return k * sum(compute_bytes * (w + lora_r) for t, w in widths.items() if t in lora_targets)


def context_parallel_bytes(shape: ModelShape, batch_size: int, local_len: int, row_len: int, compute_bytes: int) -> int:
    """Per block, with context parallelism (shardtune.parallel.split) when a rank holds local_len of each row's
    row_len positions: the row's all-gathered keys and values beyond the rank's own, which the attention of a
    document begun in an earlier chunk keeps for backward (slices of them). Zero without it. The attention itself
    runs per document, as without context parallelism: no row-wide mask."""
    if row_len <= local_len:
        return 0
    return batch_size * (row_len - local_len) * compute_bytes * (shape.kv_dim + shape.v_dim)


# Tensor parallelism's all-reduces of a block's activations in flight at once: the row-parallel layers' summed
# outputs in forward (o_proj's, then down_proj's) and the column-parallel layers' input gradients in backward.
TP_REDUCES_IN_FLIGHT = 2


def tensor_parallel_buffer_bytes(shape: ModelShape, tokens: int, compute_bytes: int, tp: int) -> int:
    """The buffers of tensor parallelism's all-reduces beside a block's own tensors (shardtune.parallel.tensor): each
    sums a [tokens, hidden] tensor in the compute dtype over the tp ranks into a new one (torch's functional
    all-reduce behind RowwiseParallel's output and ColwiseParallel's input gradient), TP_REDUCES_IN_FLIGHT of them
    at once. An approximation, not traced: NCCL's own buffers are counted in the CUDA context. Zero without tp."""
    return TP_REDUCES_IN_FLIGHT * tokens * shape.hidden_size * compute_bytes if tp > 1 else 0


def router_aux_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """Per token, with the router load-balancing loss on (models.router_aux): every MoE block's router logits
    (E wide) are returned to the loss, whose softmax of each keeps its output for backward until the loss's
    backward runs (transformers' load_balancing_loss_func): both at the loss's forward, the softmaxes at its
    backward (counted there twice and once); freed before the blocks run backward."""
    if not (shape.num_experts and shape.router_aux_loss_coef > 0):
        return 0
    return shape.num_layers * shape.num_experts * compute_bytes


def final_norm_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """The final norm's fp32 copy and rsqrt, and the head's input kept for the loss."""
    return 4 * shape.hidden_size + 4 + compute_bytes * shape.hidden_size


def attention_mask_bytes(
    batch_size: int, seq_len: int, compute_bytes: int, attn_implementation: str, masked: bool
) -> int:
    """The 4-D mask transformers builds once per forward: eager always adds a float mask; SDPA takes a bool mask
    only for packed rows (shardtune's per-document SDPA too: its mask is SDPA's, fastpath.register_attention, and
    it reads the spans' diagonal blocks from it); flash-attention never needs one."""
    if attn_implementation == "eager":
        return batch_size * seq_len * seq_len * compute_bytes
    if attn_implementation == "sdpa" and masked:
        return batch_size * seq_len * seq_len
    return 0


def mask_build_bytes(batch_size: int, seq_len: int, compute_bytes: int, attn_implementation: str, masked: bool) -> int:
    """The peak while transformers builds that mask (masking_utils.sdpa_mask, by broadcasting, before the first
    block runs), the mask included. A packed row's mask function is and_masks(causal, same document): the first
    comparison, their running AND and the second comparison exist at once, three [batch, 1, seq, seq] bool tensors,
    the last of them the mask (a 3x peak measured on CPU, tests/unit/test_plan_packed_attention.py). Eager's float
    mask is then made from the bool one, both alive (an unpacked row's bool mask is one comparison)."""
    square = batch_size * seq_len * seq_len
    bools = 3 * square if masked else square
    if attn_implementation == "eager":
        return max(bools, square + compute_bytes * square)
    return bools if attn_implementation == "sdpa" and masked else 0


def span_mask_bytes(batch_size: int, seq_len: int, packed: bool, per_document: bool) -> int:
    """The bool masks of shardtune's per-document SDPA, made once per forward and kept with its documents
    (fastpath.PackedDocuments) through the step: a span of several short documents has a span x span mask, at
    most SPAN_TOKENS bytes per token; a span of one document has none (causal)."""
    if not (packed and per_document):
        return 0
    return batch_size * seq_len * min(seq_len, SPAN_TOKENS)


def logits_bytes(
    tokens: int, vocab_size: int, compute_bytes: int, loss_impl: str = "chunked", chunk_tokens: int = 1024
) -> tuple[int, int]:
    """(peak during the loss's backward, bytes still held while the decoder layers run backward).

    chunked: shardtune computes lm_head + cross-entropy on `chunk_tokens` positions at a time and recomputes each
    chunk in backward, so one chunk's logits exist at once. full: transformers' loss (>= 4.45) keeps the logits in
    the compute dtype and upcasts them to fp32 inside the loss. full_fp32: transformers < 4.45 upcast the logits
    in the model and copied the shifted logits.
    """
    if loss_impl not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"loss_impl {loss_impl!r}: use one of {', '.join(LOSS_IMPLEMENTATIONS)}")
    # logits (compute dtype), log-softmax output, its gradient and the logits' fp32 gradient; the fp32 upcast
    # (not kept for backward) is freed before the backward allocations.
    per_elem = compute_bytes + 12 if compute_bytes < 4 else 12
    if loss_impl == "chunked":
        # Recomputed inside backward, a chunk keeps no compute-dtype logits: `.float()` does not save its input
        # and cross-entropy saves only its fp32 log-softmax, so the chunk's lm_head output is freed at once;
        # then log-softmax's output, its gradient and the logits' fp32 gradient: 12 bytes (as traced).
        return min(chunk_tokens, tokens) * vocab_size * 12, 0
    if loss_impl == "full":
        return tokens * vocab_size * per_elem, tokens * vocab_size * compute_bytes
    return tokens * vocab_size * 16, tokens * vocab_size * 4


def loss_forward_bytes(
    tokens: int, vocab_size: int, compute_bytes: int, loss_impl: str = "chunked", chunk_tokens: int = 1024
) -> int:
    """Peak of the loss's forward. chunked: a chunk's fp32 logits and their log-softmax (its compute-dtype
    logits are freed by `.float()`, which keeps no input). full: the kept logits, their fp32 upcast and its
    log-softmax. full_fp32: fp32 logits, the shifted copy and its log-softmax."""
    if loss_impl == "chunked":
        return min(chunk_tokens, tokens) * vocab_size * 8
    if loss_impl == "full":
        return tokens * vocab_size * (compute_bytes + 8)
    return tokens * vocab_size * 12


def offloaded_tensor_bytes(shape: ModelShape, tokens: int, compute_bytes: int, chunk_tokens: int) -> list[int]:
    """The bytes of each copy `--enable_activation_offloading` makes in host memory, as torch's save_on_cpu packs
    what a checkpointed step's forward saves for backward (one copy per save, a tensor saved twice twice): each
    block's input, [tokens, h], saved once by its checkpoint (nothing inside a checkpointed block: its own hooks
    take those); the final norm's fp32 input and rsqrt, saved by its square and again by its product, and its
    weight, the frozen factor of the last product; the loss's target mask (bool), and for each chunk of the loss
    its slice of the head's input and its labels (int64), saved by the chunk's checkpoint. Every position is taken
    as a target (a packed row's are). Equal to the tensors the pack hook receives on a tiny Llama
    (tests/unit/test_activation_offloading.py)."""
    h, a = shape.hidden_size, compute_bytes
    chunks = [min(chunk_tokens, tokens - start) for start in range(0, tokens, chunk_tokens)]
    blocks = [tokens * a * h] * shape.num_layers
    final_norm = [4 * tokens * h, 4 * tokens] * 2 + [a * h]
    return blocks + final_norm + [tokens] + [n * a * h for n in chunks] + [8 * n for n in chunks]


def pinned_host_bytes(nbytes: int) -> int:
    """What torch's caching host allocator takes for a pinned tensor of `nbytes`: every request rounded up to a
    power of two (ATen/core/CachingHostAllocator.h, `c10::llvm::PowerOf2Ceil`, below its default threshold of no
    limit), and the blocks are cached and reused for the next step's copies, not returned to the system."""
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0
