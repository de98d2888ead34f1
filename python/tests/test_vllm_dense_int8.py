"""End to end in vLLM's CPU build: W4A8MOE_VLLM_QUANTIZE_DENSE=int8, the bfloat16 dense layers (the
attention projections) and the LM head of a tiny W4A8 Qwen3-MoE checkpoint quantized at load to
int8 per output channel and run through w4a8moe's linear op (vllm_plugin/dense_int8.py), in
vLLM's compiled mode (torch.compile, its default) and eager.

The trace must show every attention projection and the LM head taken (and not the MoE routers,
which stay bfloat16), and eager calls through the op. Bound: as test_vllm_dense.py, the floor
(the decoded model in vLLM, bfloat16) plus 2.5%: the int8 activations at the attention's and the
LM head's inputs, with int8 weights (per-channel int8 weights add ~0.3% per layer, far below the
int4 attention test_vllm_dense.py bounds the same way).
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")
pytest.importorskip("compressed_tensors", reason="compressed-tensors missing")

import vllm_models  # noqa: E402
from test_vllm_engine import (INT8_ACTIVATIONS, PROMPT, VOCAB, centred,  # noqa: E402
                              check_forwards, relative_rms, run_vllm)

INT8 = {"W4A8MOE_VLLM_QUANTIZE_DENSE": "int8"}
_made = {}


def checkpoint(tmp_path_factory):
    """The W4A8 checkpoint (bfloat16 attention and LM head), its reference and floor."""
    if not _made:
        root = tmp_path_factory.mktemp("int8-dense")
        model = vllm_models.make_checkpoint(str(root / "w4a8"), "qwen3_moe", group_size=32,
                                            float_folder=str(root / "dense"))
        floor, _, _ = run_vllm(root / "dense", root)
        assert "error" not in floor, floor["error"]
        reference = centred(torch.log_softmax(vllm_models.reference_logits(model, PROMPT), -1))
        _made.update(root=root, reference=reference, floor=relative_rms(
            centred(floor["logprobs"]), reference).median().item())
    return _made


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_dense_layers_run_in_int8_through_w4a8moe(compiled, tmp_path, tmp_path_factory):
    made = checkpoint(tmp_path_factory)
    result, trace, log = run_vllm(made["root"] / "w4a8", tmp_path, env=INT8, compiled=compiled)
    assert "error" not in result, result["error"]
    words = [line.split()[1:] for line in trace]
    int8 = [w for w in words if w[0] == "int8"]
    # per layer qkv_proj (K 256, N (4 + 2 + 2) heads x 64) and o_proj (K 256, N 256); the LM
    # head (K 256, N the vocabulary); no router (mlp.gate)
    assert sorted(w[1:3] for w in int8) == sorted(
        [["256", "512"], ["256", "256"]] * 2 + [["256", str(VOCAB)]]), int8
    assert not [w for w in int8 if w[4].endswith("mlp.gate")], int8
    assert len([w for w in words if w[0] == "pack"]) == 2  # the MoE layers, as always
    # a compiled graph runs the ops without the plugin's Python around them; the LM head is
    # vLLM's logits step, outside the graph, so its calls leave lines either way
    int8_calls = [w for w in words if w[0] == "int8_forward"]
    assert len(int8_calls) >= (4 if compiled else 5 * 4), f"{len(int8_calls)} int8 calls"
    check_forwards([w for w in words if w[0] == "forward"], log, compiled)
    assert "LM head, K 256" in log and "quantized to int8 per output channel" in log
    assert "'gate' stays vLLM's (a MoE router" in log
    ours = relative_rms(centred(result["logprobs"]), made["reference"])
    bound = made["floor"] + INT8_ACTIVATIONS
    print(f"int8 dense ({'compiled' if compiled else 'eager'}): w4a8moe median "
          f"{ours.median().item():.4f} (max {ours.max().item():.4f}), bf16 floor "
          f"{made['floor']:.4f}, bound {bound:.4f}")
    assert ours.median().item() < bound, f"per position: {ours.tolist()}"
    assert int((ours > bound).sum()) <= len(PROMPT) // 4, ours.tolist()


def test_unknown_setting_is_refused_with_the_variable_named(monkeypatch):
    """Read when the plugin installs itself in a vLLM process (which logs a plugin's exception
    and goes on without it: the log then names the variable)."""
    from w4a8moe.vllm_plugin import dense_int8

    monkeypatch.setenv("W4A8MOE_VLLM_QUANTIZE_DENSE", "int4")
    with pytest.raises(ValueError, match="W4A8MOE_VLLM_QUANTIZE_DENSE: expected 'off' or "
                                         "'int8', got 'int4'"):
        dense_int8.mode()
    monkeypatch.setenv("W4A8MOE_VLLM_QUANTIZE_DENSE", " INT8 ")
    assert dense_int8.mode() == "int8"
