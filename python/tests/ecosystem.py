"""Helpers of the tests whose files are written by the ecosystem's own libraries (gguf,
transformers, compressed-tensors, safetensors): where the programs are, running them, and the
comparison with a float reference."""

import os
import subprocess

import pytest
import torch


def program(name, env_var):
    """A program of the build: $env_var, or next to the w4a8moe program ($W4A8MOE_CLI)."""
    path = os.environ.get(env_var)
    if not path and os.environ.get("W4A8MOE_CLI"):
        build = os.path.dirname(os.environ["W4A8MOE_CLI"])
        for candidate in (os.path.join(build, name), os.path.join(build, "tests", name)):
            if os.path.exists(candidate):
                path = candidate
    if not path or not os.path.exists(path):
        pytest.skip(f"{name} not found: set {env_var} (or W4A8MOE_CLI to build/w4a8moe)")
    return path


def cli():
    return program("w4a8moe", "W4A8MOE_CLI")


def run(args):
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"{' '.join(map(str, args))} exited {done.returncode}:\n"
                                  f"{done.stdout}\n{done.stderr}")
    return done.stdout


def run_layer(model, x, tmp_path, *extra):
    """`w4a8moe layer` on x (float32 [T, H]); returns (out, topk_ids, topk_weights, stdout)."""
    from safetensors.torch import load_file, save_file

    inp, outp = tmp_path / "x.safetensors", tmp_path / "out.safetensors"
    save_file({"x": x.contiguous()}, str(inp))
    stdout = run([cli(), "layer", "--model", str(model), "--layer", "0", "--input", str(inp),
                  "--output", str(outp), "--repeat", "1", *extra])
    got = load_file(str(outp))
    return got["out"], got["topk_ids"].long(), got["topk_weights"], stdout


def relative_rms(out, ref):
    return ((out.double() - ref.double()).pow(2).mean().sqrt()
            / ref.double().pow(2).mean().sqrt()).item()


def float_moe(x, topk_ids, topk_weights, gate, up, down, act=torch.nn.functional.silu,
              on_input=False):
    """Float experts on given routing: gate, up [E, I, H], down [E, H, I] (float tensors)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e, r = int(topk_ids[t, k]), float(topk_weights[t, k])
            a = xd[t] * r if on_input else xd[t]
            h = act(gate[e].double() @ a) * (up[e].double() @ a)
            y = down[e].double() @ h
            out[t] += y if on_input else r * y
    return out


def quantize_with_qparams(module, args, strategy, group_size, scale_dtype=None):
    """compressed-tensors' qparams for one module it attached a scheme to: scales (and zero
    points, where the module has them) from calculate_qparams over each group's or row's range
    (scales first rounded to scale_dtype when given), then the weight put on the int4 grid by
    fake_quantize. Returns that weight (what the checkpoint will mean)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = module.weight.data
    if strategy == "group":
        g = w.reshape(w.shape[0], -1, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zero_point = calculate_qparams(lo, hi, args)
    if scale_dtype is not None:
        scale = scale.to(scale_dtype)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point)
    module.weight.data.copy_(fake_quantize(w, module.weight_scale, zero_point, args))
    return module.weight.data
