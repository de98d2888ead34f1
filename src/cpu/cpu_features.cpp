// CPU feature detection: CPUID + XGETBV on x86 (a feature counts only when the OS saves its
// register state), getauxval on Linux/AArch64.
#include "cpu/cpu_features.hpp"

#include <string>

#include "w4a8moe/w4a8moe.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace w4a8moe {

namespace {

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t{edx} << 32) | eax;
}

// AMX needs three things: the CPU's AMX-TILE and AMX-INT8, the OS enabling the tile state
// (XCR0 bits 17 TILECFG and 18 TILEDATA), and on Linux the process's permission to use the tile
// data, asked once per process with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). The
// permission then holds for every thread of the process, including those started later.
bool request_amx_permission() {
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

void detect_x86(CpuFeatures& f) {
  f.arch = "x86_64";
  f.amx_status = "unavailable: the CPU has no CPUID leaf 7";
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return;
  f.sse41 = (c >> 19) & 1;
  const bool osxsave = (c >> 27) & 1;
  const bool cpu_avx = (c >> 28) & 1, cpu_fma = (c >> 12) & 1, cpu_f16c = (c >> 29) & 1;
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;              // SSE and AVX state
  const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  f.avx = cpu_avx && os_ymm;
  f.fma = cpu_fma && f.avx;
  f.f16c = cpu_f16c && f.avx;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ((b >> 5) & 1) && f.avx;
  f.avx512f = ((b >> 16) & 1) && os_zmm;
  f.avx512bw = ((b >> 30) & 1) && f.avx512f;
  f.avx512vl = ((b >> 31) & 1) && f.avx512f;
  f.avx512dq = ((b >> 17) & 1) && f.avx512f;
  f.avx512vnni = ((c >> 11) & 1) && f.avx512f;
  f.avx512vbmi = ((c >> 1) & 1) && f.avx512f;
  const bool cpu_amx = ((d >> 24) & 1) && ((d >> 25) & 1);  // AMX-TILE, AMX-INT8
  __cpuid_count(7, 1, a, b, c, d);
  f.avxvnni = ((a >> 4) & 1) && f.avx2;
  f.avx512bf16 = ((a >> 5) & 1) && f.avx512f;
  const bool os_tiles = (xcr0 & (uint64_t{3} << 17)) == (uint64_t{3} << 17);
  f.amx_status =
      detail::amx_status(cpu_amx, os_tiles, cpu_amx && os_tiles && request_amx_permission());
  f.amx_int8 = f.amx_status == "usable";
}
#endif

#if defined(__aarch64__) && defined(__APPLE__)
bool apple_feature(const char* name) {
  int value = 0;
  size_t size = sizeof value;
  return sysctlbyname(name, &value, &size, nullptr, 0) == 0 && value != 0;
}
#endif

#if defined(__aarch64__)
#if defined(__linux__)
// Bits of AT_HWCAP and AT_HWCAP2 (the Linux AArch64 ABI, asm/hwcap.h), written here so that
// kernel headers older than a feature still detect it.
constexpr unsigned long kHwcapAsimddp = 1ul << 20, kHwcapSve = 1ul << 22;
constexpr unsigned long kHwcap2I8mm = 1ul << 13, kHwcap2Bf16 = 1ul << 14;
#endif

void detect_arm(CpuFeatures& f) {
  f.arch = "aarch64";
  f.neon = true;  // mandatory in AArch64
#if defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP);
  const unsigned long hw2 = getauxval(AT_HWCAP2);
  f.dotprod = (hw & kHwcapAsimddp) != 0;
  f.sve = (hw & kHwcapSve) != 0;
  f.i8mm = (hw2 & kHwcap2I8mm) != 0;
  f.bf16 = (hw2 & kHwcap2Bf16) != 0;
#elif defined(__APPLE__)
  f.dotprod = apple_feature("hw.optional.arm.FEAT_DotProd");
  f.i8mm = apple_feature("hw.optional.arm.FEAT_I8MM");
  f.bf16 = apple_feature("hw.optional.arm.FEAT_BF16");
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
  f.arch = "other";
#if defined(__x86_64__) || defined(_M_X64)
  detect_x86(f);
#elif defined(__aarch64__)
  detect_arm(f);
#endif
  return f;
}

}  // namespace

namespace detail {

std::string amx_status(bool cpu_has_amx, bool os_enables_tiles, bool permission_granted) {
  if (!cpu_has_amx) return "unavailable: the CPU has no AMX-TILE and AMX-INT8 (CPUID leaf 7)";
  if (!os_enables_tiles)
    return "unavailable: the OS does not enable the tile state (XCR0 bits 17 and 18)";
  if (!permission_granted)
#if defined(__linux__)
    return "unavailable: Linux refused the tile data permission "
           "(arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or later grants it)";
#else
    return "unavailable: the tile data permission is requested on Linux only";
#endif
  return "usable";
}

}  // namespace detail

std::string CpuFeatures::summary() const {
  std::string s = arch;
  auto add = [&](bool on, const char* name) {
    if (on) (s += ' ') += name;
  };
  add(sse41, "sse4.1");
  add(avx, "avx");
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512dq, "avx512dq");
  add(avx512vnni, "avx512vnni");
  add(avx512bf16, "avx512bf16");
  add(avxvnni, "avxvnni");
  add(avx512vbmi, "avx512vbmi");
  add(amx_int8, "amx-int8");
  add(neon, "neon");
  add(dotprod, "dotprod");
  add(i8mm, "i8mm");
  add(sve, "sve");
  add(bf16, "bf16");
  return s;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace w4a8moe
