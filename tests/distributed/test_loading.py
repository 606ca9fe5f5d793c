"""Low-memory loading of a 4-bit base on 2 ranks (gloo): only rank 0 reads the checkpoint, rank 1 builds on meta
and receives its shards; each rank holds half of the packed bytes; the quantization states are the same on both
ranks; gathering the packed shards gives back transformers' own 4-bit weights; the sharded model computes what the
unsharded 4-bit model computes, and still does after a DCP save and load of its shards. CPU offload on a CPU-only
machine runs FSDP2's offload policy unpinned.
"""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.tolerance import decoder_chain, tol

bnb = pytest.importorskip("bitsandbytes")

SEQ = 16


def _qconfig():
    from shardtune.models.loading import bnb_config

    return bnb_config(
        use_4bit=True,
        use_8bit=False,
        quant_type="nf4",
        compute_dtype_name="bfloat16",
        nested=True,
        storage_dtype_name="bfloat16",
    )


def _spec(model_dir: str):
    from shardtune.models.builder import ModelSpec

    return ModelSpec(
        model_name_or_path=model_dir,
        dtype=torch.bfloat16,
        n_tokens=256,
        param_dtype=torch.bfloat16,
        lora_r=4,
        lora_alpha=8,
        quantization_config=_qconfig(),
    )


def _key(module_name: str) -> str:
    """layers.<i>.<block>.<proj> in the sharded PEFT model and in the plain one."""
    return module_name[module_name.index("layers.") :].removesuffix(".base_layer")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.unshard()  # `logits` is not the root's forward, whose hook would gather the embeddings and the head
    with torch.no_grad():
        out = model.logits(ids, torch.arange(SEQ).repeat(2, 1))
    model.reshard()
    return out


def _worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from shardtune.models import quant, weights
    from shardtune.parallel.mesh import init_distributed, shutdown
    from shardtune.parallel.parallelize import ShardingSettings
    from shardtune.parallel.setup import build_sharded_model
    from shardtune.runtime.log import logger, setup_logging

    reads = []
    read = weights.iter_checkpoint

    def counted(path):
        for name, tensor in read(path):
            reads.append(name)
            yield name, tensor

    weights.iter_checkpoint = counted
    setup_logging("info")
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger.addHandler(handler)
    info = init_distributed("FULL_SHARD")
    torch.manual_seed(0)
    model = build_sharded_model(_spec(model_dir), info, ShardingSettings(offload=True, cpu_ram_efficient_loading=True))
    out = {"reads": reads, "log": records, "bytes": quant.quantized_bytes(model), "layers": {}}
    for name, layer in quant.linear4bit_modules(model):
        packed = layer.weight.full_tensor()  # all ranks take part in the all-gather
        state = [getattr(h, a).clone() for h, a in quant.quant_state_tensors(layer.quant_state)]
        out["layers"][_key(name)] = {
            "packed": packed.view(torch.uint8),
            "dequantized": bnb.functional.dequantize_4bit(packed, layer.quant_state),
            "state": state,
        }
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, SEQ), generator=gen)
    out["ids"], out["logits"] = ids, _logits(model, ids)
    # A sharded checkpoint of the whole model (frozen packed shards included) restores it exactly: the states
    # stay on the layers, the packed bytes go through DCP like any bf16 tensor.
    sd = get_model_state_dict(model)
    assert not any("absmax" in k or "quant_state" in k for k in sd), "quantization states leaked into the state dict"
    dcp.save(sd, checkpoint_id=os.path.join(out_dir, "dcp"))
    for _, layer in quant.linear4bit_modules(model):
        layer.weight.to_local().zero_()
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=os.path.join(out_dir, "dcp"))
    set_model_state_dict(model, sd)
    out["logits_restored"] = _logits(model, ids)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    shutdown()


@pytest.fixture(scope="module")
def qmodel(tmp_path_factory):
    from shardtune.commands.demo import build_model

    path = tmp_path_factory.mktemp("qmodel")
    build_model(path, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank0_reads_and_others_receive_4bit_shards(qmodel, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardtune.models import quant

    mp.spawn(_worker, args=(2, _free_port(), str(qmodel), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    # Only rank 0 read the checkpoint, every tensor of it once.
    assert len(r0["reads"]) == 2 * 9 + 3 and r1["reads"] == []
    # Each rank holds half of the packed 4-bit bytes; the states are replicated in full.
    assert (
        r0["bytes"]["packed_total"]
        == r1["bytes"]["packed_total"]
        == 2 * (3 * 64 * 128 + 2 * 64 * 64 + 2 * 32 * 64) // 2
    )
    assert r0["bytes"]["packed_local"] == r1["bytes"]["packed_local"] == r0["bytes"]["packed_total"] // 2
    assert r0["bytes"]["quant_state"] == r1["bytes"]["quant_state"] > 0
    assert any("4-bit base:" in m and "held per rank: [" in m for m in r0["log"])
    assert any("offload policy runs without pinned memory" in m for m in r0["log"])
    # Gathering the shards gives back transformers' own 4-bit weights, and both ranks have its states.
    ref = AutoModelForCausalLM.from_pretrained(str(qmodel), quantization_config=_qconfig(), dtype=torch.bfloat16)
    ref_layers = {_key(n): m for n, m in quant.linear4bit_modules(ref)}
    assert ref_layers.keys() == r0["layers"].keys() and len(ref_layers) == 14
    for name, layer in ref_layers.items():
        for got in (r0["layers"][name], r1["layers"][name]):
            assert torch.equal(got["packed"], layer.weight.data.view(torch.uint8)), name
            ref_state = [getattr(h, a) for h, a in quant.quant_state_tensors(layer.weight.quant_state)]
            assert all(torch.equal(a, b) for a, b in zip(got["state"], ref_state, strict=True)), name
            assert torch.equal(
                got["dequantized"], bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
            )
    # The sharded model (adapter initialised with lora_B = 0) computes what the unsharded 4-bit model computes.
    for m in ref.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        expected = ref(input_ids=r0["ids"], position_ids=torch.arange(SEQ).repeat(2, 1)).logits.float()
    assert torch.equal(r0["logits"], r1["logits"])
    assert torch.equal(r0["logits_restored"], r0["logits"]) and torch.equal(r1["logits_restored"], r1["logits"])
    # Same dequantized weights, sums in another order: the forward chain of this 2-layer model (hidden 64,
    # intermediate 128) over 16 positions, relative to the logits' size.
    chain = decoder_chain(hidden=64, intermediate=128, layers=2, seq=SEQ)
    torch.testing.assert_close(
        r0["logits"], expected, rtol=0, atol=tol(torch.float32, chain, float(expected.abs().max()))
    )


def test_rank0_hands_over_tied_weights_once(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardtune.commands.demo import build_model
    from shardtune.parallel.loading import take_full_tensors

    build_model(tmp_path, vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                intermediate_size=128, tie_word_embeddings=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    embed = model.model.embed_tokens.weight
    taken = take_full_tensors(model)
    # Every real weight left the model; the tied head still shares the (now meta) embedding parameter.
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert taken.keys() == {n for n, _ in model.named_parameters()} and taken["model.embed_tokens.weight"] is embed
