"""The vLLM plugin's own checks, without starting an engine (the engine tests are
test_vllm_engine.py): the supported-version gate, the W4A8MOE_VLLM setting, the ledger of the
vLLM symbols the plugin patches, and the allocator trim after packing."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM (scripts/vllm-env.sh venv) missing")

from w4a8moe import vllm_plugin  # noqa: E402


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.9.1+cpu"])
def test_unsupported_vllm_version_is_refused_with_both_versions(version):
    with pytest.raises(RuntimeError) as e:
        vllm_plugin.check_vllm_version(version)
    low, high = vllm_plugin.SUPPORTED_VLLM
    assert f"vLLM {version} is not supported" in str(e.value)
    assert f">= {low}, < {high}" in str(e.value) and "W4A8MOE_VLLM=off" in str(e.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0+cpu", "0.32.2.dev3"])
def test_supported_vllm_versions_pass(version):
    vllm_plugin.check_vllm_version(version)


def test_setting_other_than_auto_or_off_is_refused(monkeypatch):
    monkeypatch.setenv("W4A8MOE_VLLM", "yes")
    with pytest.raises(ValueError, match="W4A8MOE_VLLM: expected 'auto' or 'off', got 'yes'"):
        vllm_plugin.register()


def test_off_leaves_vllm_untouched(monkeypatch):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a8_int8 as method_module,
    )

    monkeypatch.setenv("W4A8MOE_VLLM", "off")
    before = method_module.select_w4a8_int8_moe_backend
    vllm_plugin.register()
    assert method_module.select_w4a8_int8_moe_backend is before


# In a process of its own (the install patches vLLM for the rest of the process): what an install
# with every family and setting changes among the attributes of vLLM's loaded modules and of
# their classes, a dict's lists and a list's items included (a table edited in place).
_INSTALL_PROBE = """
import importlib, json, sys
from w4a8moe.vllm_plugin import _install, core, patches

def sig(v):
    if isinstance(v, dict):
        return (id(v), tuple((id(k), tuple(map(id, x)) if isinstance(x, list) else id(x))
                             for k, x in list(v.items())))
    return (id(v), tuple(map(id, v))) if isinstance(v, list) else id(v)

def snapshot():
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for key, value in list(vars(module).items()):
            seen[(name, key)] = sig(value)
            if isinstance(value, type) and value.__module__ == name:
                for k, v in list(vars(value).items()):
                    seen[(name, key + "." + k)] = sig(v)
    return seen

for p in patches.LEDGER:
    importlib.import_module(p.module)
before = snapshot()
_install(core.FAMILIES)
after = snapshot()
print(json.dumps({"changed": sorted(k for k, v in before.items() if after.get(k) != v),
                  "applied": [list(p) for p in patches.applied()]}))
"""


def test_an_install_patches_exactly_the_ledger():
    from w4a8moe.vllm_plugin import patches

    env = dict(os.environ, W4A8MOE_VLLM="auto", W4A8MOE_VLLM_FORMATS="all",
               W4A8MOE_VLLM_DENSE="on", W4A8MOE_VLLM_QUANTIZE_DENSE="int8")
    run = subprocess.run([sys.executable, "-c", _INSTALL_PROBE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    ledger = {(p.module, p.attribute) for p in patches.LEDGER}
    assert {tuple(k) for k in found["changed"]} == ledger
    assert sorted(map(tuple, found["applied"])) == sorted(patches.LEDGER)


def test_the_ledger_is_read_from_a_supported_vllm_and_says_why():
    from w4a8moe.vllm_plugin import patches

    for patch in patches.LEDGER:
        vllm_plugin.check_vllm_version(patch.vllm)
        assert patch.module.startswith("vllm.") and patch.what and patch.why, patch
    keys = [(p.module, p.attribute, p.by) for p in patches.LEDGER]
    assert len(keys) == len(set(keys))


def test_a_patch_the_ledger_does_not_list_is_refused():
    from w4a8moe.vllm_plugin import patches

    with pytest.raises(RuntimeError, match="does not list"):
        patches.replace("vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm",
                        "w4a8", lambda vllm: vllm)
    assert not patches.applied()


def _resident_bytes():
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_memory_goes_back_to_the_system():
    """What the packing leaves behind, in small: 256 MiB of 64 KiB tensors (below glibc's mmap
    threshold, so from its heap) each followed by a small tensor that stays; the large ones
    freed stay resident between the live ones until memory.release_freed() returns them."""
    import torch

    from w4a8moe.vllm_plugin import memory

    if not memory._malloc_trim():
        pytest.skip("the C library has no malloc_trim")
    blocks, kept = [], []
    for _ in range(4096):
        blocks.append(torch.ones(16384))  # 64 KiB
        kept.append(torch.ones(64))
    blocks.clear()
    before = _resident_bytes()
    memory.release_freed()
    given_back = before - _resident_bytes()
    assert given_back > 128 * 2**20, f"{given_back / 2**20:.0f} MiB given back of 256"
    assert len(kept) == 4096
