"""vLLM's parallelism through w4a8moe's plugin, in the real engine: tensor parallelism over two
worker processes (each rank packs an I/2 slice of every expert, vLLM all-reduces the outputs)
and expert parallelism within it (--enable-expert-parallel: each rank packs only its experts,
computes their share of every token, vLLM's all-reduce adds the ranks' shares), one core per
rank (VLLM_CPU_OMP_THREADS_BIND).

The model: the tiny W4A8 Qwen3-MoE of test_vllm_engine.py with 7 experts, so that vLLM's linear
placement is not even (4 on rank 0, 3 on rank 1). Each run is checked against transformers'
float32 reference with test_vllm_engine.py's bound (the bfloat16 floor measured in the same test
plus 2.5% for the int8 activations) and against the one-rank run: the ranks round their partial
sums to bfloat16 before the all-reduce and quantize their own slice of the intermediate, so two
ranks are not bit-equal to one, but within the same bound. A rank that computed a token's
experts of the other rank too, or that dropped its share, is far outside it (checked: the
reference with one rank's experts removed). The formats of test_vllm_formats.py run there under
both parallelisms; what the plugin refuses (an I/tp that is not a multiple of the group) is here.
"""

import copy
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")
pytest.importorskip("compressed_tensors", reason="compressed-tensors missing")

import vllm_models  # noqa: E402
from test_vllm_engine import (INT8_ACTIVATIONS, PROMPT, centred, ops_lines,  # noqa: E402
                              relative_rms, run_vllm)

EXPERTS = 7
RANK0_EXPERTS = 4  # vLLM's linear placement: the first E % ep ranks take one more
_made = {}


def packs_of(trace):
    """{pid: [pack line words]} of the trace."""
    out = {}
    for line in trace:
        words = line.split()
        if words[1] == "pack":
            out.setdefault(words[0], []).append(words[2:])
    return out


def made(tmp_path_factory):
    """The checkpoint, its reference, the bfloat16 floor and the one-rank run (once)."""
    if not _made:
        root = tmp_path_factory.mktemp("parallel")
        model = vllm_models.make_checkpoint(str(root / "w4a8"), "qwen3_moe", strategy="group",
                                            group_size=32, experts=EXPERTS,
                                            float_folder=str(root / "dense"))
        floor, floor_trace, _ = run_vllm(root / "dense", root)
        assert "error" not in floor, floor["error"]
        assert not ops_lines(floor_trace)
        one, trace, _ = run_vllm(root / "w4a8", root)
        assert "error" not in one, one["error"]
        reference = centred(torch.log_softmax(vllm_models.reference_logits(model, PROMPT), -1))
        _made.update(root=root, model=model, reference=reference, one=one, one_trace=trace,
                     floor=relative_rms(centred(floor["logprobs"]), reference).median().item())
    return _made


def check_close(result, m, label, wrong=None):
    bound = m["floor"] + INT8_ACTIVATIONS
    ours = relative_rms(centred(result["logprobs"]), m["reference"])
    to_one = relative_rms(centred(result["logprobs"]), centred(m["one"]["logprobs"]))
    print(f"{label}: against the reference median {ours.median().item():.4f} (max "
          f"{ours.max().item():.4f}), against one rank {to_one.median().item():.4f}, bf16 floor "
          f"{m['floor']:.4f}, bound {bound:.4f}"
          + ("" if wrong is None else f", against the wrong reference {wrong:.4f}"))
    assert ours.median().item() < bound, f"{label} per position: {ours.tolist()}"
    assert int((ours > bound).sum()) <= len(PROMPT) // 4, ours.tolist()
    assert to_one.median().item() < bound, f"{label} against one rank: {to_one.tolist()}"
    assert len(result["tokens"]) == 4
    if wrong is not None:
        assert wrong > 4 * bound


def test_tensor_parallel_two_ranks_pack_half_of_every_expert(tmp_path_factory):
    m = made(tmp_path_factory)
    result, trace, log = run_vllm(m["root"] / "w4a8", m["root"], tp=2)
    assert "error" not in result, result["error"]
    packs = packs_of(trace)
    assert len(packs) == 2, trace  # two worker processes, each packing both MoE layers
    one_bytes = int(packs_of(m["one_trace"]).popitem()[1][0][7])
    ranks = set()
    for lines in packs.values():
        assert len(lines) == 2, lines
        for p in lines:  # H, I/2, all experts, group; about half the bytes of one rank
            assert p[:4] == ["256", "64", str(EXPERTS), "32"] and p[9] == "ep0/1", p
            assert abs(int(p[7]) - one_bytes / 2) < 0.05 * one_bytes, (p, one_bytes)
            ranks.add(p[8])
    assert ranks == {"tp0/2", "tp1/2"}, ranks
    forwards = [line for line in trace if line.split()[1] == "forward"]
    assert len(forwards) >= 2 * 2 * 4 and not [f for f in forwards if "local" in f], forwards
    assert "runs through w4a8moe" in log and "refused by w4a8moe" not in log
    check_close(result, m, "TP=2")


def test_expert_parallel_each_rank_packs_its_experts(tmp_path_factory):
    m = made(tmp_path_factory)
    result, trace, log = run_vllm(m["root"] / "w4a8", m["root"], tp=2, ep=True)
    assert "error" not in result, result["error"]
    packs = packs_of(trace)
    assert len(packs) == 2, trace
    one_bytes = int(packs_of(m["one_trace"]).popitem()[1][0][7])
    local = {}
    for lines in packs.values():
        assert len(lines) == 2, lines
        for p in lines:  # H, the whole I, the rank's experts; bytes in proportion
            assert p[:2] == ["256", "128"] and p[3] == "32" and p[8] == "tp0/1", p
            experts = int(p[2])
            assert abs(int(p[7]) - one_bytes * experts / EXPERTS) < 0.05 * one_bytes, p
            local[p[9]] = experts
    assert local == {"ep0/2": RANK0_EXPERTS, "ep1/2": EXPERTS - RANK0_EXPERTS}, local
    forwards = [line for line in trace if line.split()[1] == "forward"]
    assert len(forwards) >= 2 * 2 * 4 and all(f.endswith(" local") for f in forwards), forwards
    assert "runs through w4a8moe" in log and "refused by w4a8moe" not in log

    # what a missing all-reduce of the shares would give: rank 1's experts add nothing
    dropped = copy.deepcopy(m["model"])
    with torch.no_grad():
        for layer in range(2):
            vllm_models.experts_of(dropped, layer)[1][RANK0_EXPERTS:] = 0
    wrong = relative_rms(centred(result["logprobs"]), centred(torch.log_softmax(
        vllm_models.reference_logits(dropped, PROMPT), -1))).median().item()
    check_close(result, m, "TP=2 EP=2", wrong)


def test_slice_not_a_multiple_of_the_group_is_refused(tmp_path):
    """W4A16 group 128 with I 128 at TP=2: each rank's I/2 = 64 would cut every group of the
    down projection in two. The plugin refuses with the reason and vLLM's own selection runs
    (on x86 without AMX: its refusal). (vLLM's W4A8 method refuses such a layer itself, before
    any kernel is chosen.)"""
    folder = tmp_path / "g128"
    vllm_models.make_checkpoint(str(folder), "qwen3_moe", strategy="group", group_size=128,
                                fmt="pack-quantized", activations=False)
    result, trace, log = run_vllm(folder, tmp_path, tp=2)
    assert "refused by w4a8moe" in log, log[-3000:]
    line = log.split("MoE (H 256, I 64", 1)[1].splitlines()[0]
    assert "refused by w4a8moe" in line and "128" in line.split("refused", 1)[1], line
    assert not [line for line in trace if " pack " in line], trace
    assert "error" in result, result  # (the workers' own error is in the log)
    if os.uname().machine == "x86_64" and "amx_tile" not in open("/proc/cpuinfo").read():
        assert "No WNA16 MoE backend" in log, log[-3000:]
