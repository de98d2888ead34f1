"""Hugging Face folders written by the ecosystem's own libraries, run by `w4a8moe layer` and
compared with transformers' own MoE block.

transformers builds a tiny random model of each architecture (made here, nothing downloaded)
and saves it with safetensors; compressed-tensors quantizes its experts and compresses them
with its own compressor to pack-quantized int4 (group or channel strategy); its scales and
int4 grid come from compressed-tensors' calculate_qparams and fake_quantize. The reference is
transformers' MoE block of the same model with its expert weights replaced by the dequantized
ones, routing included: it differs from the layer only by the int8 activations (SPEC section 8:
1-2% relative RMS on such data).

gpt-oss and Llama-4 keep their routed experts in fused parameters (not nn.Linear modules), which
compressed-tensors does not quantize; those folders hold the experts unquantized, as their
transformers classes save them, with values placed on an int4 grid (each group of 32 inputs
q * d, q in [-8, 7] with one -8) so that the loader's conversion to int4 is lossless and the
comparison is as tight as for the others. Llama-4's shared expert (nn.Linear) is quantized by
compressed-tensors.
"""

import copy
import json
import math
import zlib

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (PyTorch 2 venv) missing")
ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors (PyTorch 2 venv) missing")
pytest.importorskip("safetensors")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)

from ecosystem import quantize_with_qparams, relative_rms, run_layer  # noqa: E402

H, I, E, T = 128, 64, 8, 24
TOLERANCE = 3e-2  # relative RMS: the int8 activations' cost is 1-2% on these data


def tiny(config_cls, **extra):
    common = dict(vocab_size=64, hidden_size=H, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=64)
    common.update(extra)
    return config_cls(**common)


def models():
    from transformers import (GptOssConfig, GptOssForCausalLM, Llama4ForCausalLM,
                              Llama4TextConfig, MixtralConfig, MixtralForCausalLM, OlmoeConfig,
                              OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    return {
        "qwen3_moe": lambda: Qwen3MoeForCausalLM(tiny(
            Qwen3MoeConfig, intermediate_size=256, moe_intermediate_size=I, num_experts=E,
            num_experts_per_tok=2, norm_topk_prob=True)),
        "mixtral": lambda: MixtralForCausalLM(tiny(
            MixtralConfig, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)),
        "olmoe": lambda: OlmoeForCausalLM(tiny(
            OlmoeConfig, intermediate_size=I, num_experts=E, num_experts_per_tok=4)),
        "gpt_oss": lambda: GptOssForCausalLM(tiny(
            GptOssConfig, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2,
            sliding_window=16, layer_types=["full_attention"])),
        "llama4": lambda: Llama4ForCausalLM(tiny(
            Llama4TextConfig, intermediate_size=I, intermediate_size_mlp=256,
            num_local_experts=E, num_experts_per_tok=1, interleave_moe_layer_step=1)),
    }


def moe_block(model):
    layer = model.model.layers[0]
    for name in ("feed_forward", "block_sparse_moe", "mlp"):  # Llama-4, Mixtral, the others
        if hasattr(layer, name):
            return getattr(layer, name)
    raise AssertionError(f"no MoE block in {type(layer).__name__}")


def on_int4_grid(rows, cols, gain, gen):
    """[rows, cols] weights q * d: q in [-8, 7] with a -8 in each group of 32 inputs, d with 4
    significant bits (exact in bfloat16, so q * d is too)."""
    q = torch.randint(-8, 8, (rows, cols), generator=gen)
    q[:, ::32] = -8
    groups = cols // 32
    mant = torch.randint(8, 16, (rows, groups), generator=gen).double() / 8.0
    target = gain / (4.6 * math.sqrt(cols))
    d = mant * 2.0 ** torch.round(torch.log2(torch.full((rows, groups), target)))
    return (q.double() * d.repeat_interleave(32, dim=1)).float()


def init_moe(block, gen):
    """Weights that give outputs of order one (the random init gives ~1e-3)."""
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("experts.") and p.dim() == 3:  # fused: [E, in, out] for x @ W
                fused = torch.stack([on_int4_grid(p.shape[2], p.shape[1], 1.5, gen).T
                                     for _ in range(p.shape[0])])
                p.copy_(fused)
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:  # nn.Linear [out, in]: routers, experts, shared expert
                gain = 1.0 if ("gate." in name or "router" in name) else 1.5
                p.copy_(torch.randn(p.shape, generator=gen) * gain / math.sqrt(p.shape[1]))


def quantize_with_compressed_tensors(model, plain, folder, strategy, group_size, targets,
                                     symmetric=True):
    """compressed-tensors' own path: attach the scheme, set scales (and, asymmetric, zero points)
    from its calculate_qparams, put the weights on its int4 grid with fake_quantize (copied into
    `plain`, the reference), compress with ModelCompressor to pack-quantized (zero points packed
    along the rows) and save with safetensors."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    config = QuantizationConfig(
        config_groups={"int4": QuantizationScheme(targets=targets, weights=args)},
        format="pack-quantized")
    apply_quantization_config(model, config)
    quantized = 0
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        plain.get_submodule(name).weight.data.copy_(
            quantize_with_qparams(module, args, strategy, group_size))
        quantized += 1
    assert quantized > 0, f"no module matched {targets}"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    state = compressor.compress(model)
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    compressor.update_config(folder)
    return quantized


# (architecture, strategy, group size, dtype, compressed-tensors targets, extra layer flags
# [, "asymmetric": symmetric: false, zero points])
CASES = [
    ("qwen3_moe", "group", 32, torch.float32, [r"re:.*experts\.\d+\.(gate|up|down)_proj$"], ()),
    ("qwen3_moe", "channel", None, torch.bfloat16, [r"re:.*experts\.\d+\.(gate|up|down)_proj$"],
     ()),
    ("qwen3_moe", "group", 32, torch.float32, [r"re:.*experts\.\d+\.(gate|up|down)_proj$"], (),
     "asymmetric"),
    ("olmoe", "channel", None, torch.bfloat16, [r"re:.*experts\.\d+\.(gate|up|down)_proj$"], (),
     "asymmetric"),
    ("mixtral", "group", 64, torch.bfloat16, [r"re:.*experts\.\d+\.w[123]$"], ()),
    ("olmoe", "channel", None, torch.float32, [r"re:.*experts\.\d+\.(gate|up|down)_proj$"], ()),
    ("gpt_oss", None, None, torch.float32, None, ()),
    ("llama4", "group", 32, torch.bfloat16, [r"re:.*shared_expert\.(gate|up|down)_proj$"],
     ("--shared-experts",)),
]


def case_id(case):
    arch, strategy, g, dtype, *_ = case
    what = "unquantized" if strategy is None else (f"g{g}" if strategy == "group" else strategy)
    asym = "-asymmetric" if len(case) > 6 else ""
    return f"{arch}-{what}{asym}-{str(dtype).split('.')[-1]}"


def assert_near_transformers(out, ref, label):
    """out within TOLERANCE (relative RMS) of transformers' block output ref, of order one."""
    size = ref.double().pow(2).mean().sqrt().item()
    assert 0.1 < size < 10, f"reference RMS {size:.3g} is not of order one"
    err = relative_rms(out.float(), ref)
    print(f"{label}: relative RMS error {err:.4f} against transformers' block")
    assert err < TOLERANCE, f"{label}: relative RMS error {err:.3g} against transformers' block"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_layer_matches_transformers_block(case, tmp_path):
    arch, strategy, group_size, dtype, targets, flags = case[:6]
    symmetric = len(case) == 6
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(zlib.crc32(case_id(case).encode()))
    model = models()[arch]().eval()
    init_moe(moe_block(model), gen)
    model = model.to(dtype)
    plain = copy.deepcopy(model)
    folder = tmp_path / arch
    if strategy is None:
        model.save_pretrained(folder, safe_serialization=True)
    else:
        quantize_with_compressed_tensors(model, plain, folder, strategy, group_size, targets,
                                         symmetric)
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert qc["format"] == "pack-quantized" and qc["quant_method"] == "compressed-tensors"
        assert all(g["weights"]["symmetric"] == symmetric for g in qc["config_groups"].values())

    x = torch.randn(T, H, generator=gen)
    out, ids, wts, stdout = run_layer(folder, x, tmp_path, *flags)
    if strategy is not None and symmetric:
        assert "pack-quantized int4" in stdout and "-> int4 exactly" in stdout, stdout
    elif strategy is not None:
        assert "zero points -> int4 with zero points exactly" in stdout, stdout
    else:
        assert "relative RMS error 0.000e+00" in stdout, stdout  # the int4 grid: lossless

    block = moe_block(plain).float()
    with torch.no_grad():
        ref, router = block(x.reshape(1, T, H))
    ref = ref.reshape(T, H)

    # The routing is the model's own: the same experts for every token.
    if arch == "gpt_oss":  # router scores [T, E], zero where not chosen
        want = [sorted(torch.nonzero(router[t]).flatten().tolist()) for t in range(T)]
    elif arch == "llama4":  # top-1 of the logits
        want = [sorted(torch.topk(router.reshape(T, E)[t], 1).indices.tolist()) for t in range(T)]
    else:  # router logits; softmax then top-k
        k = ids.shape[1]
        want = [sorted(torch.topk(router.reshape(T, E)[t], k).indices.tolist()) for t in range(T)]
    assert [sorted(r.tolist()) for r in ids] == want, "routing differs from transformers'"

    assert_near_transformers(out, ref, case_id(case))
    assert relative_rms(torch.zeros_like(out.float()), ref) > 0.5


def test_comparison_sees_a_wrong_layout(tmp_path):
    """The comparison above can fail: gpt-oss with gate and up swapped in its fused tensor
    (a misread layout) is far outside the tolerance."""
    gen = torch.Generator().manual_seed(3)
    model = models()["gpt_oss"]().eval()
    init_moe(moe_block(model), gen)
    plain = copy.deepcopy(model)
    with torch.no_grad():
        p = moe_block(model).experts.gate_up_proj
        p.copy_(torch.stack([p[..., 1::2], p[..., ::2]], dim=-1).reshape(p.shape))
    model.save_pretrained(tmp_path / "swapped", safe_serialization=True)
    x = torch.randn(T, H, generator=gen)
    out, *_ = run_layer(tmp_path / "swapped", x, tmp_path)
    with torch.no_grad():
        ref, _ = moe_block(plain)(x.reshape(1, T, H))
    assert relative_rms(out, ref.reshape(T, H)) > 10 * TOLERANCE


def test_mxfp4_folder_matches_transformers_dequantize(tmp_path):
    """gpt-oss's MXFP4 experts (`*_blocks` U8 [E, out, in/32, 16], `*_scales` U8 [E, out, in/32],
    as its checkpoints ship them) taken exactly by `layer --exact`, against transformers' block
    whose experts hold transformers' own decoding of the same bytes (convert_moe_packed_tensors,
    what Mxfp4Config(dequantize=True) loads): only the int8 activations differ."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(11)
    model = models()["gpt_oss"]().eval()
    init_moe(moe_block(model), gen)
    folder = tmp_path / "oss"
    model.save_pretrained(folder, safe_serialization=True)
    tensors = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts."
    plain = moe_block(model)
    for name, rows, cols in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
        # every code, exponents 2^-7 .. 2^-4 (outputs of order one)
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 124, (E, rows, cols // 32), generator=gen, dtype=torch.uint8)
        del tensors[prefix + name]
        tensors[prefix + name + "_blocks"] = blocks
        tensors[prefix + name + "_scales"] = scales
        with torch.no_grad():
            getattr(plain.experts, name).copy_(
                convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))

    x = torch.randn(T, H, generator=gen)
    out, ids, _, stdout = run_layer(folder, x, tmp_path, "--exact", "--compare")
    assert "gate_up_proj_blocks (gate, interleaved): MXFP4 -> mxfp4 exactly" in stdout, stdout
    with torch.no_grad():
        ref, router = plain(x.reshape(1, T, H))
    ref = ref.reshape(T, H)
    want = [sorted(torch.nonzero(router[t]).flatten().tolist()) for t in range(T)]
    assert [sorted(r.tolist()) for r in ids] == want, "routing differs from transformers'"
    assert_near_transformers(out, ref, "gpt-oss MXFP4")
