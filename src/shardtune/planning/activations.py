"""Activation and loss memory of a Llama-style decoder in training, per token, as autograd keeps it.

`layer_saved_bytes_per_token` lists what autograd saves for backward inside one decoder layer of transformers'
Llama code with peft LoRA layers. Every term is checked against the tensors torch's saved-tensor hooks see on a
small model (tests/unit/test_plan.py), so only the sizes, not the list, are extrapolated to large models.
"""

from __future__ import annotations

from shardtune.planning.model import ModelShape

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
LOSS_IMPLEMENTATIONS = ("chunked", "full", "full_fp32")
# CUDA's dropout keeps a bool mask (1 byte per element); its CPU kernel keeps the mask in the input's dtype.
CUDA_DROPOUT_MASK_BYTES = 1


def _linear_input_groups(shape: ModelShape, attn_implementation: str) -> list[tuple[tuple[str, ...], int, bool]]:
    """(linears that read the same input, input features, whether that input is already kept by attention)."""
    # flash and SDPA return their output as a transposed view of a [batch, seq, heads, dim] buffer they keep for
    # backward, so o_proj's input is that same storage; eager attention makes a contiguous copy.
    o_shared = attn_implementation != "eager"
    return [
        (("q_proj", "k_proj", "v_proj"), shape.hidden_size, False),
        (("o_proj",), shape.q_dim, o_shared),
        (("gate_proj", "up_proj"), shape.hidden_size, False),
        (("down_proj",), shape.intermediate_size, False),
    ]


def _attention_bytes(shape: ModelShape, seq_len: int, a: int, attn_implementation: str, masked: bool) -> int:
    qd, kvd, nh = shape.q_dim, shape.kv_dim, shape.num_heads
    if attn_implementation == "eager":
        # q and the repeated k, v are kept by the two matmuls; softmax keeps its fp32 output, the second matmul
        # its cast to the compute dtype: seq_len scores per head per token.
        probs = 4 * nh * seq_len + (a * nh * seq_len if a < 4 else 0)
        return 3 * a * qd + probs
    # SDPA repeats k and v to every head when it is given a mask (packed rows); flash handles GQA natively.
    kv = qd if (masked and attn_implementation == "sdpa") else kvd
    return a * qd + 2 * a * kv + a * qd + 4 * nh  # q, k, v, output, fp32 logsumexp per head


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
    dropout_mask_bytes: int = CUDA_DROPOUT_MASK_BYTES,
) -> int:
    """Bytes autograd keeps for backward per token in one decoder layer (frozen base + LoRA, or full FT).

    A frozen linear keeps nothing (its input is only needed for a weight gradient); LoRA's lora_A keeps its
    input (the dropout output, plus the dropout mask, one per wrapped module) and lora_B keeps lora_A's output.
    """
    a, h, i = compute_bytes, shape.hidden_size, shape.intermediate_size
    norm = 4 * h + 4 + (a * h if full_finetune else 0)  # fp32 copy of the input and rsqrt; normed output if trained
    total = 2 * norm + _attention_bytes(shape, seq_len, a, attn_implementation, masked) + 3 * a * i  # gate, silu, up
    for linears, fan_in, shared in _linear_input_groups(shape, attn_implementation):
        wrapped = [m for m in linears if m in lora_targets]
        if full_finetune or (wrapped and lora_dropout == 0):
            total += 0 if shared else a * fan_in
        if lora_dropout > 0:
            total += len(wrapped) * (dropout_mask_bytes + a) * fan_in
    dims = shape.linear_dims()
    for name in lora_targets:
        if name in dims:
            total += a * lora_r
            if use_dora:  # shardtune's DoRA forward keeps z = base + s·B·A·x to rescale it by g (adapters.py)
                total += a * dims[name][1]
    return total


def backward_working_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """Gradients alive at the peak of a block's backward, beyond what the block saved (`layer_saved_bytes_...`).

    The MLP runs backward first and peaks in the backward of `act(gate) * up`: the incoming gradient of the
    block's output (h wide) has produced the product's gradient (I wide), which produces the gradients of
    act(gate) and of up (I wide each) before it is freed; down_proj's input (the product, I wide, counted in the
    saved bytes) was freed when down_proj's backward ended. Net: 3 I-wide gradients - 1 freed saved tensor + the
    h-wide incoming gradient. Checked against the traced step (tests/unit/test_plan_trace.py)."""
    return compute_bytes * (2 * shape.intermediate_size + shape.hidden_size)


def dora_transient_bytes(shape: ModelShape, compute_bytes: int, lora_targets: tuple[str, ...]) -> int:
    """shardtune's DoRA forward (adapters.dora_weight_norm) takes the weight's row norms from an fp32 copy of the
    weight, which exists while that layer runs (also in the recomputation): 4·in·out bytes for the largest
    wrapped linear, none when the weight already is fp32."""
    dims = [d for name, d in shape.linear_dims().items() if name in lora_targets]
    if not dims or compute_bytes >= 4:
        return 0
    return 4 * max(i * o for i, o in dims)


def final_norm_bytes_per_token(shape: ModelShape, compute_bytes: int) -> int:
    """The final norm's fp32 copy and rsqrt, and the head's input kept for the loss."""
    return 4 * shape.hidden_size + 4 + compute_bytes * shape.hidden_size


def attention_mask_bytes(
    batch_size: int, seq_len: int, compute_bytes: int, attn_implementation: str, masked: bool
) -> int:
    """The 4-D mask transformers builds once per forward: eager always adds a float mask; SDPA takes a bool mask
    only for packed rows; flash-attention never needs one."""
    if attn_implementation == "eager":
        return batch_size * seq_len * seq_len * compute_bytes
    if attn_implementation == "sdpa" and masked:
        return batch_size * seq_len * seq_len
    return 0


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
