"""GPTQ's and AWQ's word layouts, cross-checked against a maintained implementation: vLLM's own
packers (vllm.model_executor.layers.quantization.utils.quant_utils: gptq_pack, pack_cols,
awq_pack, which vLLM's tests and kernels use for these formats). The words they write equal
the ones test_vllm_quantized.py's packers (written from AutoGPTQ's and AutoAWQ's pack()) write,
the layout the C++ loaders' tests pin by hand, and w4a8moe.vllm packs vLLM's words into the
layer the file's integers mean."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")

import w4a8moe  # noqa: E402
from moe_data import assert_matches, make_inputs  # noqa: E402
from test_vllm_quantized import layer, pack_inputs, pack_outputs  # noqa: E402
from vllm.model_executor.layers.quantization.utils import quant_utils  # noqa: E402
from w4a8moe.vllm import pack_awq_moe, pack_gptq_moe  # noqa: E402


def per_expert(fn, t):
    """vLLM's packers take one [K, N] matrix: apply to each expert of [E, K, N]."""
    return torch.stack([fn(m.contiguous(), 4, m.shape[0], m.shape[1]) for m in t])


def test_word_layouts_equal_vllms_packers():
    gen = torch.Generator().manual_seed(41)
    q = torch.randint(0, 16, (3, 64, 128), generator=gen)  # [E, N, K]
    zeros = torch.randint(0, 16, (3, 64, 4), generator=gen)  # [E, N, G]
    # GPTQ qweight: inputs packed along K (rows of [K, N]); qzeros: outputs along N
    assert torch.equal(pack_inputs(q), per_expert(quant_utils.gptq_pack, q.transpose(1, 2)))
    assert torch.equal(pack_outputs(zeros.transpose(1, 2), False),
                       per_expert(quant_utils.pack_cols, zeros.transpose(1, 2)))
    # AWQ: outputs along N in its 0 2 4 6 1 3 5 7 order, for qweight and qzeros alike
    assert torch.equal(pack_outputs(q.transpose(1, 2), True),
                       per_expert(quant_utils.awq_pack, q.transpose(1, 2)))
    assert not torch.equal(pack_outputs(q.transpose(1, 2), False),
                           per_expert(quant_utils.awq_pack, q.transpose(1, 2)))


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_layers_packed_by_vllm_match_the_reference(fmt):
    gen = torch.Generator().manual_seed(42)
    E, I, H, g = 4, 64, 128, 32
    w = layer(E, I, H, g, gen)
    scales = {n: w[n]["s"].transpose(1, 2).contiguous() for n in w}
    if fmt == "gptq":
        p13, p2 = pack_gptq_moe(
            per_expert(quant_utils.gptq_pack, w["w13"]["q"].transpose(1, 2)),
            per_expert(quant_utils.gptq_pack, w["w2"]["q"].transpose(1, 2)),
            scales["w13"], scales["w2"], g,
            w13_qzeros=per_expert(quant_utils.pack_cols, w["w13"]["z"].transpose(1, 2) - 1),
            w2_qzeros=per_expert(quant_utils.pack_cols, w["w2"]["z"].transpose(1, 2) - 1),
            w13_g_idx=w["w13"]["g_idx"], w2_g_idx=w["w2"]["g_idx"], sym=False)
    else:
        p13, p2 = pack_awq_moe(
            per_expert(quant_utils.awq_pack, w["w13"]["q"].transpose(1, 2)),
            per_expert(quant_utils.awq_pack, w["w2"]["q"].transpose(1, 2)),
            scales["w13"], scales["w2"],
            per_expert(quant_utils.awq_pack, w["w13"]["z"].transpose(1, 2)),
            per_expert(quant_utils.awq_pack, w["w2"]["z"].transpose(1, 2)), g)
    x, ids, wts = make_inputs(12, H, E, 2, 11)
    out = w4a8moe.moe(x, ids, wts, p13, p2)
    meaning = {n: (w[n]["q"] - w[n]["z"].repeat_interleave(g, dim=2)).to(torch.int8) for n in w}
    ref = w4a8moe.reference_moe(x, ids, wts, meaning["w13"], meaning["w2"],
                                w["w13"]["s"].float(), w["w2"]["s"].float(), g)
    assert_matches(out, ref, f"{fmt} packed by vLLM, g{g}")
