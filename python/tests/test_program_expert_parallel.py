"""`mpirun -np N w4a8moe run --expert-parallel all-reduce|dispatch`: each process packs its share
of the case's experts, process 0 writes out. Against the one-process `run` of the same case:
dispatch (exact results, run's default) gives the same bits for 1, 2 and 4 processes
(oversubscribed); all-reduce the same bits with one process and within f32 summation-order error
(relative 1e-6) with more; both the same bits from run to run."""

import shutil
import subprocess

import pytest
import torch

from moe_data import make_inputs, make_weights
from test_library_bits import CLI, needs_cli, read_safetensors, write_safetensors

MPIRUN = shutil.which("mpirun")


def program_has_mpi():
    if not CLI.is_file():
        return False
    r = subprocess.run([str(CLI), "run", "--help"], capture_output=True, text=True, timeout=60)
    return "--expert-parallel" in r.stdout


needs_mpi = pytest.mark.skipif(MPIRUN is None or not program_has_mpi(),
                               reason="mpirun or the program's --expert-parallel is missing")


def write_case(path, activation, on_input, dtype):
    E, I, H, g, T, K = 10, 96, 160, 32, 29, 3  # E = 10 over 4 processes: uneven shares
    w = make_weights(E, I, H, g, seed=5)
    x, ids, wts = make_inputs(T, H, E, K, seed=6, dtype=dtype)
    tensors = {"x": x, "topk_ids": ids, "topk_weights": wts, "w13": w.w13,
               "w13_scale": w.w13_scale, "w2": w.w2, "w2_scale": w.w2_scale}
    metadata = {"group_size": str(g), "activation": activation,
                "apply_router_weight_on_input": "true" if on_input else "false"}
    write_safetensors(path, tensors, metadata)


def run(case, out, np=None, way=None):
    cmd = [str(CLI), "run", "--input", str(case), "--output", str(out), "--threads", "1"]
    if np is not None:
        cmd = [MPIRUN, "-np", str(np), "--oversubscribe", "--allow-run-as-root"] + cmd + [
            "--expert-parallel", way]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return read_safetensors(out, "out")


@needs_cli
@needs_mpi
@pytest.mark.parametrize("way", ["all-reduce", "dispatch"])
@pytest.mark.parametrize("activation,on_input,dtype", [
    ("silu", False, torch.float32), ("swigluoai", False, torch.bfloat16),
    ("gelu", True, torch.float32)])
def test_run_expert_parallel(tmp_path, way, activation, on_input, dtype):
    case = tmp_path / "case.safetensors"
    write_case(case, activation, on_input, dtype)
    one = run(case, tmp_path / "one.safetensors")
    assert one.abs().max() > 0.1  # outputs of order one
    assert torch.equal(run(case, tmp_path / "np1.safetensors", 1, way), one)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    for np in (2, 4):
        got = run(case, tmp_path / f"np{np}.safetensors", np, way)
        if way == "dispatch":
            assert torch.equal(got, one), f"{np} processes: the one-process bits"
        bound = tol * one.float().abs().max()
        assert (got.float() - one.float()).abs().max() <= bound, f"{np} processes"
        again = run(case, tmp_path / f"np{np}b.safetensors", np, way)
        assert torch.equal(got, again), "the same bits from run to run"


@needs_cli
@needs_mpi
def test_expert_parallel_errors(tmp_path):
    case = tmp_path / "case.safetensors"
    write_case(case, "silu", False, torch.float32)
    r = subprocess.run([MPIRUN, "-np", "2", "--oversubscribe", "--allow-run-as-root", str(CLI),
                        "run", "--input", str(case), "--output", str(tmp_path / "o.safetensors"),
                        "--expert-parallel", "scatter"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "--expert-parallel: expected all-reduce or dispatch, got 'scatter'" in r.stderr
