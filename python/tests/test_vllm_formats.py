"""End to end in vLLM's CPU build: the MoE checkpoints people download, through w4a8moe's plugin.
compressed-tensors W4A16 (written by compressed-tensors' own compressor: symmetric groups,
zero points, channel-wise, `actorder: weight`), GPTQ (sym with checkpoint_format gptq, asym with
gptq_v2) and AWQ (gemm, zero points) re-encoded from those by vLLM's own packers, and a tiny
gpt-oss in OpenAI's MXFP4 layout. vLLM 0.32 refuses every one of them on a CPU without AMX.

Each checkpoint runs in vllm.LLM (bfloat16) and its log-probabilities are compared with the same
model in transformers (float32, the experts' weights decoded from the file): the bound is the
measured floor (the decoded model unquantized in vLLM, bfloat16) plus 2.5% for the int8
activations w4a8moe adds (this is a W4A8 computation of a W4A16 checkpoint), as in
test_vllm_engine.py, whose helpers this file uses. The trace shows w4a8moe packed both MoE layers
in the file's format and ran them at every step. One checkpoint of each format is served over
vLLM's OpenAI API instead, by the command docs/vllm.md gives (vllm_serve.py), in vLLM's default
compiled mode as that command runs it (torch.compile), and checked the same way from the server's
answers; the others run eager, so each format runs both ways.
"""

import json

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")
pytest.importorskip("compressed_tensors", reason="compressed-tensors missing")

import vllm_int4_models  # noqa: E402
import vllm_models  # noqa: E402
import vllm_serve  # noqa: E402
from test_vllm_engine import (INT8_ACTIVATIONS, PROMPT, centred, check_forwards,  # noqa: E402
                              ops_lines, relative_rms, run_vllm)

# (compressed-tensors strategy, group, symmetric, actorder) -> re-encodings of the same experts
CT = {
    "sym-g32": ("group", 32, True, None, ["gptq", "gptq_v2"]),
    "asym-g64": ("group", 64, False, None, ["awq"]),
    "channel": ("channel", None, True, None, []),
    "g128-actorder-weight": ("group", 128, True, "weight", []),
}
CASES = [(name, "compressed-tensors") for name in CT] + [
    (name, fmt) for name, spec in CT.items() for fmt in spec[4]]
# one checkpoint of each format is served over vLLM's OpenAI API by the command docs/vllm.md
# gives (python/tests/vllm_serve.py), the others run in vllm.LLM: the same engine, one start each
SERVED = {("g128-actorder-weight", "compressed-tensors"), ("sym-g32", "gptq"),
          ("asym-g64", "awq"), ("gpt-oss", "mxfp4")}
_made = {}


def checkpoint(name, tmp_path_factory):
    """The compressed-tensors W4A16 checkpoint `name`, its float folder, its reference and the
    measured bfloat16 floor (made once per module)."""
    if name not in _made:
        strategy, group, symmetric, actorder, _ = CT[name]
        root = tmp_path_factory.mktemp(name)
        model = vllm_models.make_checkpoint(
            str(root / "ct"), "qwen3_moe", strategy=strategy, group_size=group,
            fmt="pack-quantized", symmetric=symmetric, activations=False, actorder=actorder,
            float_folder=str(root / "dense"))
        _made[name] = dict(root=root, model=model, floor=None)
    return _made[name]


def run(folder, tmp_path, served, env=None):
    """(result, trace, log) of vllm.LLM (eager) or of the server (compiled) on `folder`."""
    if not served:
        return run_vllm(folder, tmp_path, env=env)
    return serve(folder, tmp_path, env=env, eager=False)


def serve(folder, tmp_path, env=None, eager=True):
    """(result, trace, log) of the server on `folder` (vllm_serve.py), its answers checked."""
    trace = tmp_path / f"trace-served-{folder.name}.txt"
    result, log = vllm_serve.serve_and_ask(
        folder, PROMPT, tokens=4, vocab=256, log_path=tmp_path / f"server-{folder.name}.log",
        env={"W4A8MOE_VLLM_TRACE": str(trace), **(env or {})}, eager=eager)
    assert "error" not in result, result["error"]
    assert result["streamed_text"] == result["text"], result
    assert result["hostile_status"] == 400, result
    assert result["text_after_hostile"] == result["text"], result
    assert result["text"] == " " + " ".join(
        "<unk>" if t == 0 else f"w{t}" for t in result["tokens"]), result
    return result, trace.read_text().splitlines() if trace.exists() else [], log


def reference_of(model):
    return centred(torch.log_softmax(vllm_models.reference_logits(model, PROMPT), -1))


def check_against_reference(result, trace, log, reference, floor_result, fmt_word, group,
                            compiled=False):
    assert "error" not in result, result["error"]
    packs = [line.split()[1:] for line in trace if line.split()[1] == "pack"]
    forwards = [line for line in trace if line.split()[1] == "forward"]
    assert len(packs) == 2, trace
    assert all(p[1:5] == ["256", "128", "8", str(group)] and p[7] == fmt_word
               for p in packs), packs
    check_forwards(forwards, log, compiled)
    assert "runs through w4a8moe" in log and "as W4A8" in log
    assert "No WNA16 MoE backend" not in log and "No MXFP4 MoE backend" not in log
    floor = relative_rms(centred(floor_result["logprobs"]), reference).median().item()
    ours = relative_rms(centred(result["logprobs"]), reference)
    bound = floor + INT8_ACTIVATIONS
    print(f"{fmt_word} g{group}: w4a8moe median {ours.median().item():.4f} (max "
          f"{ours.max().item():.4f}), bf16 floor {floor:.4f}, bound {bound:.4f}")
    assert ours.median().item() < bound, f"per position: {ours.tolist()}"
    assert int((ours > bound).sum()) <= len(PROMPT) // 4, ours.tolist()
    assert len(result["tokens"]) == 4


@pytest.mark.parametrize("name,fmt", CASES, ids=[f"{f}-{n}" for n, f in CASES])
def test_int4_checkpoint_runs_through_w4a8moe(name, fmt, tmp_path, tmp_path_factory):
    made = checkpoint(name, tmp_path_factory)
    strategy, group, symmetric, _, _ = CT[name]
    g = -1 if group is None else group
    folder = made["root"] / "ct"
    if fmt != "compressed-tensors":
        folder = made["root"] / fmt
        # gptq_v2 as GPTQModel writes it: `dynamic` rules that leave the attention and the
        # router unquantized (vLLM applies them per layer; the experts keep the base config)
        dynamic = ({r"-:.*self_attn.*": {}, r"-:.*mlp\.gate$": {}} if fmt == "gptq_v2"
                   else None)
        vllm_int4_models.reencode(str(made["root"] / "ct"), str(folder), fmt, group_size=g,
                                  symmetric=symmetric, dynamic=dynamic)
    if made["floor"] is None:
        made["floor"], floor_trace, _ = run_vllm(made["root"] / "dense", tmp_path)
        assert "error" not in made["floor"], made["floor"]["error"]
        assert not ops_lines(floor_trace)
    served = (name, fmt) in SERVED
    result, trace, log = run(folder, tmp_path, served)
    word = "int4_symmetric" if symmetric else "int4_zero_point"
    check_against_reference(result, trace, log, reference_of(made["model"]), made["floor"],
                            word, g, compiled=served)
    made[fmt] = result  # the one-rank run the parallel cases compare with


# vLLM's parallelism over two worker processes (test_vllm_parallel.py has the W4A8 cases):
# (checkpoint, format, expert parallel); tensor parallel cases pack an I/2 = 64 slice
PARALLEL = [("sym-g32", "gptq", False), ("asym-g64", "compressed-tensors", False),
            ("asym-g64", "awq", True), ("gpt-oss", "mxfp4", False), ("gpt-oss", "mxfp4", True)]


@pytest.mark.parametrize("name,fmt,ep", PARALLEL,
                         ids=[f"{f}-{n}-{'ep2' if e else 'tp2'}" for n, f, e in PARALLEL])
def test_int4_checkpoint_under_vllm_parallelism(name, fmt, ep, tmp_path, tmp_path_factory):
    if name == "gpt-oss":
        made = _made.setdefault("gpt-oss", {})
        if "model" not in made:
            root = tmp_path_factory.mktemp("gpt-oss-parallel")
            made.update(root=root, model=vllm_int4_models.make_gpt_oss(
                str(root / fmt), float_folder=str(root / "dense")), floor=None)
        group, word = 32, "mxfp4"
    else:
        made = checkpoint(name, tmp_path_factory)
        strategy, group, symmetric, _, _ = CT[name]
        word = "int4_symmetric" if symmetric else "int4_zero_point"
        if fmt != "compressed-tensors" and not (made["root"] / fmt).exists():
            vllm_int4_models.reencode(str(made["root"] / "ct"), str(made["root"] / fmt), fmt,
                                      group_size=group, symmetric=symmetric)
    folder = made["root"] / ("ct" if fmt == "compressed-tensors" else fmt)
    if made["floor"] is None:
        made["floor"], _, _ = run_vllm(made["root"] / "dense", tmp_path)
    result, trace, log = run_vllm(folder, tmp_path, tp=2, ep=ep)
    assert "error" not in result, result["error"]
    packs = [line.split() for line in trace if line.split()[1] == "pack"]
    assert len({p[0] for p in packs}) == 2 and len(packs) == 4, trace  # 2 ranks x 2 layers
    for p in packs:
        kind, ranks = ("ep", p[11]) if ep else ("tp", p[10])
        assert p[8] == word and ranks in (f"{kind}0/2", f"{kind}1/2"), p
        assert p[3:6] == (["128", "4", str(group)] if ep else ["64", "8", str(group)]), p
    forwards = [line for line in trace if line.split()[1] == "forward"]
    assert len(forwards) >= 2 * 2 * 4 and all(f.endswith(" local") == ep for f in forwards)
    reference = reference_of(made["model"])
    bound = relative_rms(centred(made["floor"]["logprobs"]), reference).median().item() \
        + INT8_ACTIVATIONS
    ours = relative_rms(centred(result["logprobs"]), reference)
    print(f"{fmt} {name} {'EP' if ep else 'TP'}=2: median {ours.median().item():.4f} (max "
          f"{ours.max().item():.4f}), bound {bound:.4f}")
    assert ours.median().item() < bound, ours.tolist()
    assert int((ours > bound).sum()) <= len(PROMPT) // 4, ours.tolist()
    if fmt in made:  # the one-rank run of the same checkpoint, when this session made it
        to_one = relative_rms(centred(result["logprobs"]), centred(made[fmt]["logprobs"]))
        assert to_one.median().item() < bound, to_one.tolist()


def test_gpt_oss_mxfp4_runs_through_w4a8moe(tmp_path):
    model = vllm_int4_models.make_gpt_oss(str(tmp_path / "oss"), float_folder=str(
        tmp_path / "dense"))
    floor, floor_trace, _ = run_vllm(tmp_path / "dense", tmp_path)
    assert "error" not in floor, floor["error"]
    served = ("gpt-oss", "mxfp4") in SERVED
    result, trace, log = run(tmp_path / "oss", tmp_path, served)
    check_against_reference(result, trace, log, reference_of(model), floor, "mxfp4", 32,
                            compiled=served)
    _made["gpt-oss"] = dict(root=tmp_path, model=model, floor=floor, mxfp4=result)
    assert all(line.split()[6] == "swigluoai" for line in trace if " pack " in line)


def test_formats_setting_leaves_wna16_to_vllm(tmp_path, tmp_path_factory):
    """W4A8MOE_VLLM_FORMATS=w4a8,mxfp4: W4A16 layers go to vLLM's own selection, which on a
    CPU without AMX refuses them."""
    made = checkpoint("sym-g32", tmp_path_factory)
    result, trace, log = run_vllm(made["root"] / "ct", tmp_path,
                                  env={"W4A8MOE_VLLM_FORMATS": "w4a8,mxfp4"})
    assert not [line for line in trace if " pack " in line]
    assert "runs through w4a8moe" not in log
    if not _has_amx():
        assert "error" in result and "No WNA16 MoE backend" in result["error"], result


def _has_amx():
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return "amx_tile" in f.read()


def test_gptq_with_zero_points_is_refused_by_vllms_config(tmp_path, tmp_path_factory):
    """vLLM 0.32 takes GPTQ with sym: true only (its AutoGPTQConfig has no asymmetric int4
    type): refused before any MoE method is chosen, on every platform (docs/vllm.md)."""
    made = checkpoint("asym-g64", tmp_path_factory)
    folder = tmp_path / "gptq-asym"
    vllm_int4_models.reencode(str(made["root"] / "ct"), str(folder), "gptq_v2", group_size=64,
                              symmetric=False)
    result, trace, _ = run_vllm(folder, tmp_path)
    assert not trace
    assert "Unsupported quantization config: bits=4, sym=False" in result.get("error", ""), result


def test_awq_missing_qzeros_gets_a_clear_error(tmp_path, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    made = checkpoint("asym-g64", tmp_path_factory)
    folder = tmp_path / "awq"
    vllm_int4_models.reencode(str(made["root"] / "ct"), str(folder), "awq", group_size=64,
                              symmetric=False)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.up_proj.qzeros"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    result, _, _ = run_vllm(folder, tmp_path)
    assert "error" in result, "vLLM ran a checkpoint without an expert's qzeros"
    assert "w13_qzeros of expert(s) [5] not loaded" in result["error"], result["error"]


def test_mxfp4_scale_of_255_gets_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    vllm_int4_models.make_gpt_oss(str(tmp_path / "oss"))
    path = tmp_path / "oss" / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.0.mlp.experts.down_proj_scales"][3, 7, 1] = 255
    save_file(state, str(path), metadata={"format": "pt"})
    result, _, _ = run_vllm(tmp_path / "oss", tmp_path)
    assert "error" in result
    assert "w2_weight_scale of expert(s) [3]: an e8m0 scale of 255" in result["error"], result


def test_quantization_configs_name_the_formats(tmp_path_factory):
    made = checkpoint("asym-g64", tmp_path_factory)
    config = vllm_models.quantization_config(str(made["root"] / "ct"))
    weights = config["config_groups"]["group_0"]["weights"]
    assert config["format"] == "pack-quantized" and weights["symmetric"] is False
    assert config["config_groups"]["group_0"].get("input_activations") is None
    root = made["root"]
    vllm_int4_models.reencode(str(root / "ct"), str(root / "awq-cfg"), "awq", group_size=64,
                              symmetric=False)
    awq = json.loads((root / "awq-cfg" / "config.json").read_text())["quantization_config"]
    assert awq["quant_method"] == "awq" and awq["zero_point"] is True
