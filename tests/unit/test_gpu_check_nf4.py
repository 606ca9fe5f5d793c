"""bench/gpu_numerics.py's own NF4 dequantization (the device check's `qlora` reference) against bitsandbytes on
the CPU: the same values as `dequantize_4bit` and as a Linear4bit's forward, with and without double quantization,
and a planted wrong code table or block size fails the same comparison."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("bitsandbytes")
sys.path.insert(0, str(ROOT / "bench"))
import gpu_numerics as gn


def _quantized(nested: bool, storage):
    import bitsandbytes.functional as F
    import torch

    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=nested,
                                    quant_storage=storage)  # fmt: skip
    return w, packed, state


@pytest.mark.parametrize("nested", [True, False])
def test_independent_nf4_equals_bitsandbytes(nested):
    import bitsandbytes.functional as F
    import torch

    w, packed, state = _quantized(nested, torch.bfloat16)
    mine = gn.dequantize_nf4(packed, state)
    theirs = F.dequantize_4bit(packed, state).float()
    assert mine.shape == w.shape and gn.compare_rounded(theirs, mine)["equal"]
    assert float((mine - w.float()).abs().max()) < 0.5 * float(w.float().abs().max())  # near the weight it stores
    if nested:
        assert state.absmax.dtype == torch.uint8  # the double-quantized absmax was dequantized by the check


def test_independent_nf4_matches_the_layers_forward():
    import bitsandbytes as bnb
    import torch

    layer = bnb.nn.Linear4bit(256, 96, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True, quant_storage=torch.bfloat16)  # fmt: skip
    layer.weight = bnb.nn.Params4bit(torch.randn(96, 256).to(torch.bfloat16), requires_grad=False,
                                     quant_type="nf4", compress_statistics=True, quant_storage=torch.bfloat16)  # fmt: skip
    layer = layer.to("cpu")  # Params4bit quantizes when moved to a device
    assert layer.weight.quant_state is not None and layer.weight.quant_state.nested
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    mine = gn.dequantize_nf4(layer.weight, layer.weight.quant_state).to(torch.bfloat16)
    with torch.no_grad():
        fwd = layer(x).float()
    assert gn.compare(x.float() @ mine.float().T, fwd)["equal"]


@pytest.mark.parametrize("planted", ["code table", "block size"])
def test_planted_wrong_code_table_or_block_size_fails(planted):
    import bitsandbytes.functional as F
    import torch

    _, packed, state = _quantized(True, torch.uint8)
    theirs = F.dequantize_4bit(packed, state).float()
    if planted == "code table":  # FP4's layout read as NF4's: the two middle entries swapped
        code = list(gn.NF4_CODE)
        code[6], code[8] = code[8], code[6]
        mine = gn.dequantize_nf4(packed, state, code=tuple(code))
    else:
        mine = gn.dequantize_nf4(packed, state, blocksize=128)
    r = gn.compare_rounded(theirs, mine)
    assert not r["equal"] and r["over_tol"] > 10, r
