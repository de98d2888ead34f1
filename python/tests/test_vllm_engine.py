"""End to end in vLLM's CPU build: tiny W4A8 MoE checkpoints written by compressed-tensors'
compressor, loaded by vllm.LLM in bfloat16 with w4a8moe's plugin installed (the `vllm.general_plugins`
entry point of the package), greedy generation, the first step's log-probabilities against
the same model in transformers (float32, the experts' int4 weights dequantized).

Tolerance (relative RMS of the centred log-probabilities, whose spread is ~1, at each of the
prompt's positions and the first generated token): the floor is the same model unquantized (the
dequantized experts in a float checkpoint) run by vLLM in bfloat16, measured in the same test
(~0.9%: bfloat16 attention, norms and activations); w4a8moe adds the int8 activations, two
per-token quantizations per expert (x and the gated intermediate, each ~0.7-1.3% relative on
these rows), so the bound is floor + 2.5%, on the median over positions. Single positions may
exceed it: where a token's second and third experts are nearly tied, the int8 noise can flip
the router's choice (seen: Mixtral, one position in 8, 28% off at that layer), so at most a
quarter of the positions may be above the bound. A reference with gate and up swapped in one
layer is far outside it (the test can fail).

Each vLLM run is its own process (python/tests/vllm_run.py), with W4A8MOE_VLLM_TRACE set so the
plugin records each layer it packs and each forward call it runs. Runs only where vLLM is
installed (scripts/vllm-env.sh, docs/vllm.md); skipped elsewhere.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")
pytest.importorskip("compressed_tensors", reason="compressed-tensors missing")

import vllm_models  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = [3, 17, 101, 7, 42, 250, 9, 64, 128, 5, 77, 200, 31, 16, 99, 180]
VOCAB = 256
INT8_ACTIVATIONS = 0.025


def run_vllm(folder, tmp_path, env=None, tp=1, ep=False, compiled=False):
    """(result, trace lines, log) of vllm_run.py on `folder`; tp > 1: vLLM's tensor parallelism
    over tp worker processes, one core each (ep: its expert parallelism over them); compiled:
    vLLM's default torch.compile mode, else enforce_eager."""
    label = f"{os.path.basename(folder)}-tp{tp}{'-ep' if ep else ''}{'-c' if compiled else ''}"
    trace = tmp_path / f"trace-{label}.txt"
    full_env = dict(os.environ, W4A8MOE_VLLM_TRACE=str(trace), **(env or {}))
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in (env or {}):
        # one core per rank, whatever cores the caller's environment gives its one-rank runs
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(i % (os.cpu_count() or 1)) for i in range(tp))
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "vllm_run.py"), str(folder), "--prompt",
         ",".join(map(str, PROMPT)), "--tokens", "4", "--vocab", str(VOCAB), "--tp", str(tp)]
        + (["--ep"] if ep else []) + (["--compiled"] if compiled else []),
        capture_output=True, text=True, env=full_env, timeout=600)
    assert proc.returncode == 0, \
        f"vllm_run.py exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    # the result's line; vLLM's workers may log after it (their shutdown)
    result = json.loads([line for line in proc.stdout.splitlines()
                         if line.startswith(('{"tokens"', '{"error"'))][-1])
    lines = trace.read_text().splitlines() if trace.exists() else []
    return result, lines, proc.stdout + proc.stderr  # vLLM logs to stdout


def check_forwards(forwards, log, compiled):
    """Eager, each MoE call leaves a trace line (prefill and decode steps of both layers).
    Compiled, none may: the plugin writes no line while torch.compile traces it, so a line would
    be its Python run per call (a graph break); the graph calls the op alone."""
    if compiled:
        assert "enforce_eager=False" in log
        assert not forwards, f"the plugin's Python ran per call in a compiled engine: {forwards}"
    else:
        assert len(forwards) >= 2 * 4, forwards


def ops_lines(trace):
    """The trace's lines of w4a8moe's own layers (not the vocabulary tables, which the plugin
    holds once in every model, unquantized ones included)."""
    return [line for line in trace if line.split()[1] != "vocab"]


def centred(logprobs):
    """[positions, V] log-probabilities less each position's mean."""
    t = torch.as_tensor(logprobs, dtype=torch.float64)
    return t - t.mean(-1, keepdim=True)


def relative_rms(a, b):
    """Per position: ||a - b|| / ||b||."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def swap_gate_up(model, layer):
    """The reference model with one layer's gate and up halves swapped (a layout error)."""
    import copy

    wrong = copy.deepcopy(model)
    with torch.no_grad():
        w, _ = vllm_models.experts_of(wrong, layer)
        half = w.shape[1] // 2
        w.copy_(torch.cat([w[:, half:], w[:, :half]], dim=1).clone())
    return wrong


CASES = [
    # (family, strategy, group size, format, vLLM's modes: eager, compiled (torch.compile, its
    # default)); Llama 4: top-1, the router weight on the input. Each family runs both ways.
    ("qwen3_moe", "group", 32, "int-quantized", (False,)),
    ("qwen3_moe", "channel", None, "int-quantized", (False,)),
    ("mixtral", "group", 64, "int-quantized", (False, True)),
    ("llama4", "group", 32, "int-quantized", (False, True)),
    ("qwen3_moe", "group", 128, "pack-quantized", (True,)),
]


@pytest.mark.parametrize("family,strategy,group_size,fmt,modes", CASES,
                         ids=[f"{f}-{s if g is None else f'g{g}'}-{m.split('-')[0]}"
                              for f, s, g, m, _ in CASES])
def test_engine_runs_w4a8_moe_through_w4a8moe(family, strategy, group_size, fmt, modes,
                                              tmp_path):
    folder, dense = tmp_path / "w4a8", tmp_path / "dense"
    model = vllm_models.make_checkpoint(str(folder), family, strategy=strategy,
                                        group_size=group_size, fmt=fmt, float_folder=str(dense))
    config = vllm_models.quantization_config(str(folder))
    assert config["format"] == fmt
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["strategy"]) == (4, strategy)

    floor_result, floor_trace, _ = run_vllm(dense, tmp_path)
    assert "error" not in floor_result, floor_result["error"]
    assert not ops_lines(floor_trace)  # the unquantized model never reaches w4a8moe

    def reference_of(m):
        # positions 1 .. n-1 of the prompt and the first generated token
        return centred(torch.log_softmax(vllm_models.reference_logits(m, PROMPT), -1))

    reference, swapped = reference_of(model), reference_of(swap_gate_up(model, 1))
    floor = relative_rms(centred(floor_result["logprobs"]), reference).median().item()
    bound = floor + INT8_ACTIVATIONS
    g = -1 if group_size is None else group_size
    for compiled in modes:
        result, trace, log = run_vllm(folder, tmp_path, compiled=compiled)
        assert "error" not in result, result["error"]
        packs = [line.split()[1:] for line in trace if line.split()[1] == "pack"]
        forwards = [line for line in trace if line.split()[1] == "forward"]
        assert len(packs) == 2, trace  # both MoE layers
        assert all(p[1:5] == ["256", "128", "8", str(g)] and p[5] == "silu"
                   for p in packs), packs
        check_forwards(forwards, log, compiled)
        # the vocabulary tables held once: the embedding's GEMM copy deferred to a first call
        # (none comes), the LM head's table dropped for its GEMM's copy (logits still right)
        vocab = [line.split()[2:] for line in trace if line.split()[1] == "vocab"]
        assert sorted(vocab) == [["embedding", str(VOCAB), "256", "lazy"],
                                 ["head", str(VOCAB), "256", "dropped"]], vocab
        on_input = "1" if family == "llama4" else "0"
        assert all(line.split()[3] == on_input for line in forwards), forwards
        assert "runs through w4a8moe" in log
        assert "No W4A8 Int8 MoE backend" not in log and "refused by w4a8moe" not in log

        ours = relative_rms(centred(result["logprobs"]), reference)
        wrong = relative_rms(centred(result["logprobs"]), swapped)
        print(f"{family} {strategy} g{g} {fmt} {'compiled' if compiled else 'eager'}: w4a8moe "
              f"median {ours.median().item():.4f} (max {ours.max().item():.4f}), bf16 floor "
              f"{floor:.4f}, bound {bound:.4f}, against the swapped reference "
              f"{wrong.median().item():.4f}")
        assert ours.shape[0] == len(PROMPT)
        assert ours.median().item() < bound, f"w4a8moe in vLLM, per position: {ours.tolist()}"
        above = int((ours > bound).sum())
        assert above <= len(PROMPT) // 4, f"{above} positions above {bound:.4f}: {ours.tolist()}"
        assert wrong.median().item() > 4 * bound
        assert len(result["tokens"]) == 4


def test_refused_configuration_falls_back_to_vllm_with_the_reason(tmp_path):
    """Group 16: w4a8moe refuses it (groups are multiples of 32), the log says why, and vLLM's
    own selection runs, which on x86 refuses the layer with its own error."""
    folder = tmp_path / "g16"
    vllm_models.make_checkpoint(str(folder), "qwen3_moe", strategy="group", group_size=16)
    result, trace, log = run_vllm(folder, tmp_path)
    assert "refused by w4a8moe" in log
    assert "group" in log.split("refused by w4a8moe", 1)[1].splitlines()[0]
    assert not [line for line in trace if " pack " in line]
    if os.uname().machine == "x86_64":
        assert "error" in result and "No W4A8 Int8 MoE backend" in result["error"], result


def test_plugin_off_gives_vllm_its_own_choice(tmp_path):
    folder = tmp_path / "off"
    vllm_models.make_checkpoint(str(folder), "qwen3_moe", strategy="group", group_size=32)
    result, trace, log = run_vllm(folder, tmp_path, env={"W4A8MOE_VLLM": "off"})
    assert not trace and "runs through w4a8moe" not in log
    if os.uname().machine == "x86_64":
        assert "error" in result and "No W4A8 Int8 MoE backend" in result["error"], result


@pytest.mark.parametrize("damage", ["group_size_not_dividing", "missing_scale"])
def test_malformed_checkpoint_gets_a_clear_error(damage, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / damage
    if damage == "group_size_not_dividing":  # 48 divides neither H 256 nor I 128
        vllm_models.make_checkpoint(str(folder), "qwen3_moe", strategy="group", group_size=32)
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 48
        path.write_text(json.dumps(config))
        expected = "Group size (48) must evenly divide"
    else:
        vllm_models.make_checkpoint(str(folder), "qwen3_moe", strategy="group", group_size=32)
        state = load_file(str(folder / "model.safetensors"))
        del state["model.layers.1.mlp.experts.3.up_proj.weight_scale"]
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        expected = "weight_scale"
    result, _, log = run_vllm(folder, tmp_path)
    assert "error" in result, f"{damage}: vLLM ran the damaged checkpoint"
    assert expected in result["error"], result["error"]
