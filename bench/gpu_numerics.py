"""The numerics checks of bench/gpu_check.py: two computations of the same logits compared element by element,
each with a planted error that the same comparison must report.

Both run on the numerics model: the check's model (its widths, heads and vocabulary) cut to NUMERICS_LAYERS
decoder layers, every weight drawn again at unit gain (a linear layer's std 1/sqrt(fan_in), embeddings std 1;
seeded). At shardtune.commands.demo's init (std 0.02) the decoder barely moves the logits: zeroing every decoder weight
changed the 1B model's loss by 2.9e-3 and a cross-document leak by 6.6e-4, both inside any bf16 tolerance. At unit
gain each layer changes its input by its own size, and the same changes move logits by about their RMS (measured
on the CPU at the 1B widths, 2 layers, 2 rows of 2048 tokens: a leak 3.9x, a zeroed decoder 4.4x the logits' RMS;
two attention paths 0.031x). The attention paths and the 4-bit matmul differ per layer, so more layers would add
rounding noise (the tolerance grows with the square root of the chain) without testing anything new.

Tolerance (tests/tolerance.py, tol_rounding): each compared logit is a sum over the hidden size of values that
went through ROUNDINGS roundings to bf16 on each side; their errors add in quadrature, so a logit's difference has
a standard deviation of u·sqrt(2·ROUNDINGS/3) times the logits' RMS, and the bound is 8 of those. For 2 layers:
ROUNDINGS = 26, tol = 0.13 x RMS; measured on the CPU, the attention paths reach 0.24 of it and a leak 30 times it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import speed

from shardtune.objectives.heads import token_loss

NUMERICS_LAYERS = 2
# Roundings to bf16 along the path of one value through a Llama layer: the input norm's output, the q (or k or v)
# projection, RoPE, the attention probabilities and output, o_proj, the residual add, the post-attention norm,
# gate (or up), SiLU, the product, down_proj and the residual add: 12 (taking the longest branch each time). Then
# the final norm and the head.
ROUNDINGS_PER_LAYER = 12
ROUNDINGS = NUMERICS_LAYERS * ROUNDINGS_PER_LAYER + 2


def build_numerics_model(model_dir: Path, out: Path) -> None:
    """The check's model cut to NUMERICS_LAYERS layers, weights drawn again at unit gain (seeded), saved in bf16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.num_hidden_layers = NUMERICS_LAYERS
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) / mod.in_features**0.5)
            elif isinstance(mod, torch.nn.Embedding):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen))
    model.to(torch.bfloat16).save_pretrained(out)


def compare(ref, got) -> dict:
    """Element by element: the largest |got - ref| against the bf16 tolerance over the reference's RMS."""
    import torch

    from tests.tolerance import tol_rounding  # imports torch: not before bench/gpu_check.py checked its version

    tol = tol_rounding(torch.bfloat16, ROUNDINGS)
    rms = float(ref.float().pow(2).mean().sqrt())
    diff = float((got.float() - ref.float()).abs().max())
    return {"max_abs_diff": diff, "tol": tol * rms, "over_tol": diff / (tol * rms), "equal": diff <= tol * rms}


def compare_rounded(ref, got) -> dict:
    """Two dequantizations of the same weight, element by element: equal up to one rounding of either to bf16 (half
    a bf16 ulp each, 2^-8 of the value together); a wrong code, block size or absmax is a whole step away."""
    diff = (got.float() - ref.float()).abs()
    bound = 2.0**-8 * torch_maximum(got.float().abs(), ref.float().abs()) + 1e-12
    over = float((diff / bound).max())
    return {"max_abs_diff": float(diff.max()), "tol": "2^-8 x |value|", "over_tol": over, "equal": over <= 1.0}


def torch_maximum(a, b):
    import torch

    return torch.maximum(a, b)


def _control(planted: str, result: dict) -> dict:
    """A planted error's comparison: it must fail (`failed`), else the check cannot see an error of its kind."""
    return {"planted": planted, "failed": not result["equal"], **result}


def target_logits(model, batch):
    """The logits at every target position, through the model's own forward (so that FSDP's hooks run): its loss
    chunks, recorded as they are computed."""
    import torch

    from shardtune.objectives.heads import token_loss

    chunks = []
    chunk_logits = model.chunk_logits

    def record(h):
        z = chunk_logits(h)
        chunks.append(z.float())
        return z

    model.chunk_logits = record  # an instance attribute: the class's method again after the del below
    try:
        with torch.no_grad():
            model(*batch, head=token_loss)
    finally:
        del model.chunk_logits
    return torch.cat(chunks)


@contextlib.contextmanager
def leaking_documents():
    """The planted error of the attention check: the per-document spans computed as if each row were one document
    (the RoPE positions still restart), and the family's own (block-diagonal) mask not consulted on the span, so
    every token also attends to the documents before it in its row."""
    import torch

    from shardtune.models import fastpath

    real, family_mask = fastpath.packed_documents, fastpath._family_mask
    fastpath.packed_documents = lambda pos, *a, **kw: real(torch.arange(pos.shape[1], device=pos.device).expand_as(pos))
    fastpath._family_mask = lambda *a, **kw: None
    try:
        yield
    finally:
        fastpath.packed_documents, fastpath._family_mask = real, family_mask


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def packed_batch(ctx: dict, device: str):
    """Rows of whole documents (lengths drawn from 16 to seq_len/4), position ids restarting per document, each
    document's last position without a target: what packing produces."""
    import torch

    size = ctx["size"]
    gen = torch.Generator().manual_seed(0)
    rows, seq = max(1, size["batch"] // 2), size["seq_len"]
    ids = torch.randint(3, ctx["base_vocab"], (rows, seq), generator=gen)
    pos = torch.empty_like(ids)
    labels = torch.full_like(ids, -100)
    for r in range(rows):
        i = 0
        while i < seq:
            n = min(int(torch.randint(16, max(17, seq // 4), (1,), generator=gen)), seq - i)
            pos[r, i : i + n] = torch.arange(n)
            labels[r, i : i + n - 1] = ids[r, i + 1 : i + n]
            i += n
    return ids.to(device), pos.to(device), labels.to(device)


def _time_step(model, batch, device: str, reps: int) -> float:
    """Median seconds of forward + backward of the loss (the first call picks kernels and is not counted)."""
    times = []
    for i in range(reps + 1):
        speed._sync(device)
        t0 = time.perf_counter()
        total, n = model(*batch, head=token_loss)
        (total / n).backward()
        speed._sync(device)
        if i:
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def check_attention(ctx: dict) -> dict:
    """Per-document SDPA (shardtune's fast path) and flash-attention 2 varlen (where installed) against
    transformers' SDPA with the packed (block-diagonal) mask: the logits at every target, element by element; the
    planted control, per-document SDPA with a cross-document leak, must fail the same comparison."""
    import torch

    from shardtune.models import fastpath, loading, training_module

    device = ctx["device"]
    batch = packed_batch(ctx, device)
    variants = {"sdpa_packed_mask": (fastpath.register_attention(), False),
                "per_document_sdpa": (fastpath.register_attention(), True)}  # fmt: skip
    not_run = {}
    if device == "cuda" and importlib.util.find_spec("flash_attn"):
        variants["flash_attn_varlen"] = ("flash_attention_2", False)
    else:
        not_run["flash_attn_varlen"] = "needs CUDA" if device != "cuda" else "flash_attn is not installed"
    logits, seconds, out = {}, {}, {}
    for name, (impl, per_doc) in variants.items():
        base = loading.load_base_model(ctx["numerics_model"], dtype=torch.bfloat16, attn_impl=impl,
                                        trust_remote_code=False)  # fmt: skip
        model = training_module.CausalLMForTraining(
            base.to(device).requires_grad_(True), per_document_attention=per_doc
        )
        logits[name] = target_logits(model, batch)
        seconds[name] = _time_step(model, batch, device, reps=3)
        if per_doc:
            with leaking_documents():
                control = compare(logits["sdpa_packed_mask"], target_logits(model, batch))
        del model, base
    ref = logits["sdpa_packed_mask"]
    for name in variants:
        out[name] = {"seconds": seconds[name], **(compare(ref, logits[name]) if name != "sdpa_packed_mask" else {})}
    return {
        "variants": out,
        "not_run": not_run,
        "logits_equal": all(v.get("equal", True) for v in out.values()),
        "control": _control("per_document_sdpa with a cross-document leak", control),
        "elements": ref.numel(),
    }


def check_context_parallel(ctx: dict) -> dict:
    """The context-parallel attention's math on the device (shardtune.parallel.split and fastpath): cp ranks
    simulated in one process (each rank's all-gather is the whole row's keys), on a packed row of 8192 positions
    whose documents cross chunk and rank edges, in bf16 with GQA; every rank's output against SDPA over the whole
    row with the per-document causal mask, element by element, with SDPA per part and, where flash_attn is
    installed on CUDA, as one flash-attention varlen call (the kernel `shardtune train` uses there); the planted
    control, a crossing document attending the row from its start, must fail the same comparison."""
    import torch
    import torch.nn.functional as F

    from shardtune.models.fastpath import _context_parallel_attention
    from shardtune.parallel import split
    from shardtune.parallel.context_parallel import local_shard

    device, length = ctx["device"], 8192
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(200, 3000, (16,), generator=g).tolist()
    pos = torch.cat([torch.arange(n) for n in sizes])[:length][None]
    q, k, v = (torch.randn(1, h, length, 64, generator=g).to(device, torch.bfloat16) for h in (16, 4, 4))
    docs = split.document_ids(pos)[0].to(device)
    allowed = (docs[:, None] == docs[None, :]) & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    batch = {"input_ids": torch.zeros_like(pos), "position_ids": pos.to(device), "labels": torch.zeros_like(pos)}
    kernels = {"sdpa": False}
    if device == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        kernels["flash_varlen"] = True

    def ranks(size: int, leak: bool, varlen: bool) -> list:
        outs = []
        for r in range(size):
            local, rows, _ = split.split(batch, size=size, rank=r, pad_id=0)
            if leak:
                rows = tuple(tuple(replace(p, key_start=0) if p.key_start else p for p in parts) for parts in rows)
            mine = split.zigzag(length, size, r).to(device)
            k_r, v_r = k[:, :, mine], v[:, :, mine]
            shard = local_shard(rows, local["position_ids"], lambda x, k_r=k_r: k if x is k_r else v, size=size,
                                varlen=varlen)  # fmt: skip
            outs.append((mine, _context_parallel_attention(q[:, :, mine], k_r, v_r, shard, 0.0, None)))
        return outs

    def assemble(outs):
        got = torch.empty_like(ref)
        for mine, out in outs:
            got[:, mine] = out
        return got

    out = {f"{name} cp{size}": compare(ref, assemble(ranks(size, False, varlen)))
           for name, varlen in kernels.items() for size in (2, 4)}  # fmt: skip
    flash = {} if "flash_varlen" in kernels else {"skipped": "flash_attn is not installed on CUDA here"}
    return {"sizes": out, "flash_varlen": flash, "equal": all(r["equal"] for r in out.values()),
            "control": _control("a crossing document attending the row from its start", compare(
                ref, assemble(ranks(2, True, False)))), "positions": length}  # fmt: skip


def bnb_or_skip():
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skip("bitsandbytes is not installed: carry its wheel (docs/gpu.md) or pip install 'shardtune[qlora]'")


def record(ctx: dict, key: str, value):
    """One measurement written at once as a JSON line, flushed and synced to the check's partial file
    (ctx["partial_path"]): a check killed at its budget, or failing later, keeps what it measured so far."""
    path = ctx.get("partial_path")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({key: value}) + "\n")
            f.flush()
            os.fsync(f.fileno())
    return value


def read_partial(path) -> dict:
    """The measurements a check recorded (record), merged in order; a torn last line is left out."""
    out = {}
    p = Path(path)
    for line in p.read_text().splitlines() if p.exists() else []:
        try:
            out.update(json.loads(line))
        except ValueError:
            break
    return out


class Skip(Exception):
    """A check that cannot run here; the message says why."""


# NF4's 16 values as bitsandbytes publishes them (bitsandbytes.functional.get_4bit_type("nf4"), the QLoRA paper's
# Appendix E), written out here so that the check's dequantization does not read the library it checks.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def absmax_of(state):
    """The float32 absmax of each block of a 4-bit weight: stored as is, or (double quantization) as 8-bit codes of
    the dynamic map (`state2.code`, stored with the weight) scaled per block of `state2.blocksize` by `state2.absmax`,
    plus `offset`, dequantized here without bitsandbytes' kernels."""
    import torch

    if getattr(state, "nested", False) or getattr(state, "state2", None) is not None:
        s2 = state.state2
        codes = s2.code.float().cpu()[state.absmax.cpu().long()]
        scale = s2.absmax.float().cpu().repeat_interleave(s2.blocksize)[: codes.numel()]
        return codes * scale + float(state.offset)
    return state.absmax.float().cpu().to(torch.float32)


def dequantize_nf4(packed, state, *, code=NF4_CODE, blocksize: int | None = None):
    """A 4-bit NF4 weight dequantized independently of bitsandbytes: the packed bytes (any storage dtype, viewed as
    uint8; each byte holds two values, the first in its high nibble), NF4's code table above, each block of
    `blocksize` values (the state's) scaled by its absmax (absmax_of). fp32, on the CPU, in the state's shape."""
    import torch

    data = packed.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    idx = torch.stack([data >> 4, data & 0xF], dim=1).reshape(-1).long()
    n = 1
    for d in state.shape:
        n *= d
    values = torch.tensor(code, dtype=torch.float32)[idx[:n]]
    scale = absmax_of(state).repeat_interleave(blocksize or state.blocksize)[:n]
    return (values * scale).reshape(tuple(state.shape))


def check_qlora(ctx: dict) -> dict:
    """One rank: the sharded 4-bit model (shardtune's loader, FSDP2) against a bf16 model holding its 4-bit weights
    dequantized by this check (dequantize_nf4: the packed bytes, the double-quantized absmax and NF4's table written
    out here, not bitsandbytes' kernels; the adapter starts at zero, so both compute the same function): the logits
    at every target, element by element. Each layer's independent dequantization is also compared with
    bitsandbytes' dequantize_4bit and with the layer's forward (bitsandbytes.matmul_4bit on its packed weight, as
    Linear4bit.forward calls it). The planted control, one layer dequantized with its scales (absmax) doubled,
    must fail."""
    bnb_or_skip()
    import torch

    from shardtune.models import loading, quant, training_module
    from shardtune.models.builder import ModelSpec
    from shardtune.parallel.mesh import init_distributed
    from shardtune.parallel.setup import build_sharded_model

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))  # fmt: skip
    info = init_distributed("FULL_SHARD")
    qcfg = loading.bnb_config(use_4bit=True, use_8bit=False, quant_type="nf4", compute_dtype_name="bfloat16",
                               nested=True, storage_dtype_name="bfloat16")  # fmt: skip
    attn = loading.attn_implementation(False, ctx["device"])
    # No new tokens: new embedding rows are initialised at random, differently here and in the reference.
    spec = ModelSpec(model_name_or_path=ctx["numerics_model"], dtype=torch.bfloat16, n_tokens=ctx["base_vocab"],
                     param_dtype=torch.bfloat16, attn_impl=attn, quantization_config=qcfg)  # fmt: skip
    model = build_sharded_model(spec, info)  # single_process "fsdp": FSDP2 at world size 1
    batch = packed_batch(ctx, ctx["device"])
    got = target_logits(model, batch)
    deq, layers = _dequantized(model)
    ref_model = loading.load_base_model(ctx["numerics_model"], dtype=torch.bfloat16, attn_impl=attn,
                                         trust_remote_code=False)  # fmt: skip
    ref_model = training_module.CausalLMForTraining(_with_weights(ref_model, deq).to(ctx["device"]))
    result = compare(target_logits(ref_model, batch), got)
    planted = next(iter(deq))
    wrong = {**deq, planted: deq[planted] * 2}  # every block of one layer with its absmax doubled
    _with_weights(ref_model.model, wrong)
    control = compare(target_logits(ref_model, batch), got)
    worst = lambda k: max(v[k]["over_tol"] for v in layers.values())
    return {
        **result,
        "equal": result["equal"]
        and all(v["bnb_dequantize"]["equal"] and v["forward"]["equal"] for v in layers.values()),
        "logits_equal": result["equal"],
        "dequantization": "independent (NF4 table, packed bytes, double-quantized absmax in bench/gpu_numerics.py)",
        "bnb_dequantize_over_tol": worst("bnb_dequantize"),
        "forward_over_tol": worst("forward"),
        "layers": layers,
        "control": _control(f"{planted} dequantized with doubled scales", control),
        "elements": got.numel(),
        "packed_mib_per_rank": quant.quantized_bytes(model)["packed_local"] / 2**20,
    }


def _dequantized(model) -> tuple[dict, dict]:
    """Each 4-bit layer's weight dequantized by dequantize_nf4 (bf16, by the name of its layer `layers.<i>....`),
    and per layer its comparison with bitsandbytes' dequantize_4bit and with the layer's forward on random rows."""
    import bitsandbytes as bnb
    import torch

    from shardtune.models import quant

    out, layers = {}, {}
    gen = torch.Generator().manual_seed(2)
    for name, layer in quant.linear4bit_modules(model):
        key = name[name.index("layers.") :].removesuffix(".base_layer")
        w = layer.weight  # a DTensor shard, or the whole (unsharded) weight after a forward of the root's
        w = w.full_tensor() if hasattr(w, "full_tensor") else w
        mine = dequantize_nf4(w, layer.quant_state)
        out[key] = mine.to(torch.bfloat16)
        theirs = bnb.functional.dequantize_4bit(w, layer.quant_state).float().cpu()
        x = torch.randn(16, mine.shape[1], generator=gen).to(w.device, torch.bfloat16)
        with torch.no_grad():
            fwd = bnb.matmul_4bit(x, w, bias=None, quant_state=layer.quant_state).float().cpu()
        layers[key] = {"bnb_dequantize": compare_rounded(theirs, mine),
                       "forward": compare(x.float().cpu() @ mine.to(torch.bfloat16).float().T, fwd)}  # fmt: skip
    return out, layers


def _with_weights(model, weights: dict):
    """Copy the dequantized weights into the bf16 model's layers of the same names."""
    left = dict(weights)
    for name, mod in model.named_modules():
        key = name[name.index("layers.") :] if "layers." in name else None
        if key in left:
            mod.weight.data.copy_(left.pop(key).reshape(mod.weight.shape))
    if left:
        raise RuntimeError(f"4-bit layers without a bf16 counterpart: {sorted(left)[:3]}")
    return model
