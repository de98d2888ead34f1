"""End to end in vLLM's CPU build: GPTQ, AWQ and compressed-tensors W4A16 checkpoints whose
attention projections are int4 too (dense int4 layers, as the checkpoints of MoE models on the
hubs have them), run whole through w4a8moe: the experts by the MoE families, the dense layers by
the plugin's linear kernel (vllm_plugin/dense.py).

vLLM's own CPU kernel for the dense layers (cpu_gemm_wna16) exists in its AVX-512 extension
only; the default (auto) leaves the layers to it on CPUs with AMX only. W4A8MOE_VLLM_DENSE=on
gives the dense layers to w4a8moe on any CPU; W4A8MOE_TEST_VLLM_AVX2=1
(vllm_run.py) runs vLLM as on an x86 CPU without AVX-512, where the default (auto) takes them
and, with the plugin's dense path off, vLLM stops at its first int4 layer. The GPTQ model is
also served over vLLM's OpenAI API with the engine compiled (torch.compile), as a user's server
runs it.

Bound: as test_vllm_formats.py, the floor (the decoded model in vLLM, bfloat16) plus 2.5% for
the int8 activations, which here are quantized at the attention's inputs too (two more per-token
quantizations per layer: the rows entering q/k/v and o; seen 1.9-2.0% against a floor of 0.8%,
where the experts alone give 1.7%).
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")
pytest.importorskip("compressed_tensors", reason="compressed-tensors missing")

import vllm_int4_models  # noqa: E402
import vllm_models  # noqa: E402
from test_vllm_engine import (INT8_ACTIVATIONS, PROMPT, centred, check_forwards,  # noqa: E402
                              ops_lines, relative_rms, run_vllm)
from test_vllm_formats import serve  # noqa: E402
_made = {}


def checkpoint(tmp_path_factory, symmetric):
    """A W4A16 checkpoint with int4 attention (group 32, symmetric or with zero points), its
    float folder, reference and floor (made once per module)."""
    key = "sym" if symmetric else "asym"
    if key not in _made:
        root = tmp_path_factory.mktemp(f"dense-{key}")
        model = vllm_models.make_checkpoint(
            str(root / "ct"), "qwen3_moe", strategy="group", group_size=32,
            fmt="pack-quantized", symmetric=symmetric, activations=False, int4_attention=True,
            float_folder=str(root / "dense"))
        floor, floor_trace, _ = run_vllm(root / "dense", root)
        assert "error" not in floor, floor["error"]
        assert not ops_lines(floor_trace)
        reference = centred(torch.log_softmax(vllm_models.reference_logits(model, PROMPT), -1))
        _made[key] = dict(root=root, reference=reference, floor=relative_rms(
            centred(floor["logprobs"]), reference).median().item())
    return _made[key]


def folder_of(made, fmt, symmetric):
    if fmt == "compressed-tensors":
        return made["root"] / "ct"
    folder = made["root"] / fmt
    if not folder.exists():
        vllm_int4_models.reencode(str(made["root"] / "ct"), str(folder), fmt, group_size=32,
                                  symmetric=symmetric, int4_attention=True)
    return folder


def check_runs_whole(result, trace, log, made, fmt_word, compiled=False):
    assert "error" not in result, result["error"]
    words = [line.split()[1:] for line in trace]
    packs = [w for w in words if w[0] == "pack"]
    linears = [w for w in words if w[0] == "linear"]
    assert len(packs) == 2 and all(p[7] == fmt_word for p in packs), packs
    # per layer: qkv_proj (K 256, N (4 + 2 + 2) heads x 64) and o_proj (K 256, N 256)
    assert sorted(w[1:4] for w in linears) == sorted([["256", "512", "32"],
                                                      ["256", "256", "32"]] * 2), linears
    assert all(w[5] == fmt_word for w in linears), linears
    # Eager, each call leaves a line; a compiled graph runs the ops without the Python around
    # them (no trace), and vLLM's own tensors of those layers are freed once packed, so only
    # w4a8moe's ops can have computed them.
    linear_calls = sum(1 for w in words if w[0] == "linear_forward")
    assert linear_calls == 0 if compiled else linear_calls >= 4 * 4, f"{linear_calls} linear calls"
    check_forwards([w for w in words if w[0] == "forward"], log, compiled)
    assert "W4A16 int4 linear" in log and "runs through w4a8moe" in log
    ours = relative_rms(centred(result["logprobs"]), made["reference"])
    bound = made["floor"] + INT8_ACTIVATIONS
    print(f"{fmt_word} with int4 attention: w4a8moe median {ours.median().item():.4f} (max "
          f"{ours.max().item():.4f}), bf16 floor {made['floor']:.4f}, bound {bound:.4f}")
    assert ours.median().item() < bound, f"per position: {ours.tolist()}"
    assert int((ours > bound).sum()) <= len(PROMPT) // 4, ours.tolist()


@pytest.mark.parametrize("fmt,symmetric", [("gptq", True), ("awq", False),
                                           ("compressed-tensors", False)])
def test_int4_attention_runs_through_w4a8moe(fmt, symmetric, tmp_path, tmp_path_factory):
    """GPTQ is served by docs/vllm.md's command as it stands, the engine compiled by
    torch.compile (vllm_serve.py); the others run eager in vllm.LLM."""
    made = checkpoint(tmp_path_factory, symmetric)
    folder, env = folder_of(made, fmt, symmetric), {"W4A8MOE_VLLM_DENSE": "on"}
    compiled = fmt == "gptq"
    if compiled:
        result, trace, log = serve(folder, tmp_path, env=env, eager=False)
        assert "enforce_eager=False" in log
    else:
        result, trace, log = run_vllm(folder, tmp_path, env=env)
    check_runs_whole(result, trace, log, made, "int4_symmetric" if symmetric
                     else "int4_zero_point", compiled)


def test_cpu_without_avx512_runs_gptq_whole_by_default(tmp_path, tmp_path_factory):
    """vLLM's AVX2 extension: without the plugin's dense path vLLM cannot run the model's int4
    attention; with the default (auto) the plugin takes those layers."""
    made = checkpoint(tmp_path_factory, True)
    folder = folder_of(made, "gptq", True)
    avx2 = {"W4A8MOE_TEST_VLLM_AVX2": "1"}
    result, trace, log = run_vllm(folder, tmp_path, env=avx2)
    check_runs_whole(result, trace, log, made, "int4_symmetric")
    (tmp_path / "off").mkdir()  # a trace file of its own
    refused, trace, _ = run_vllm(folder, tmp_path / "off",
                                 env={**avx2, "W4A8MOE_VLLM_DENSE": "off"})
    assert not [line for line in trace if " linear " in line]
    assert "cpu_gemm_wna16" in refused.get("error", ""), refused


def test_default_takes_dense_layers_unless_vllm_has_an_amx_kernel(tmp_path, tmp_path_factory):
    """auto: w4a8moe's dense int4 layers everywhere but on CPUs with AMX where vLLM has its own
    kernel (on AVX-512 without AMX w4a8moe's was the faster at 1 to 2048 tokens)."""
    import vllm._custom_ops  # noqa: F401

    import w4a8moe

    made = checkpoint(tmp_path_factory, True)
    result, trace, log = run_vllm(folder_of(made, "gptq", True), tmp_path)
    assert "error" not in result, result["error"]
    assert len([line for line in trace if " pack " in line]) == 2
    linears = [line for line in trace if " linear " in line]
    if hasattr(torch.ops._C, "cpu_gemm_wna16") and "amx" in w4a8moe.available_kernel_sets():
        assert not linears
        assert "is left to vLLM (vLLM's own CPU kernel cpu_gemm_wna16 is present and the " \
               "CPU has AMX" in log
    else:
        check_runs_whole(result, trace, log, made, "int4_symmetric")


def test_missing_dense_scale_gets_a_clear_error(tmp_path, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    made = checkpoint(tmp_path_factory, True)
    folder = tmp_path / "gptq-damaged"
    vllm_int4_models.reencode(str(made["root"] / "ct"), str(folder), "gptq", group_size=32,
                              symmetric=True, int4_attention=True)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.scales"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    result, _, _ = run_vllm(folder, tmp_path, env={"W4A8MOE_VLLM_DENSE": "on"})
    assert "error" in result, "vLLM ran a checkpoint without an attention layer's scales"
    assert "o_proj" in result["error"] and "scales" in result["error"], result["error"]
