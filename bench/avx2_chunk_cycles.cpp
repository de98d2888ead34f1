// Cycles of the avx2 tile's instruction sequences, written out in assembly so that no compiler
// choice (scheduling, spills) enters: what one core sustains for the 5-row tile's chunk (8 panel
// rows x 8 columns x 5 token rows, 320 MACs) alone, with its group's start and epilogue, and for
// the int16-sum alternative, plus the single instructions' rates. docs/prefill-avx2.md reads it.
//
//   build/bench/w4a8moe_avx2_chunk_cycles
//
// The clock is measured by a chain of dependent scalar adds (one per cycle), so the figures are
// core cycles at whatever frequency the core runs. Data stays in L1 (the weights of one group
// are reused; the hot tile streams them from L2, which measured the same here).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

template <class F>
double seconds(F&& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double cycle_seconds(int64_t n) {
  const double s = seconds([&] {
    for (int64_t i = 0; i < n; ++i) asm volatile(".rept 32\n\tadd $1, %%rax\n\t.endr" ::: "rax");
  });
  return s / (static_cast<double>(n) * 32.0);
}

// ---- single instructions, 8 independent ones per iteration (register operands, rsp for loads)
#define W4A8_X8(ins)                                                          \
  ins " %%ymm13, %%ymm12, %%ymm0\n\t" ins " %%ymm13, %%ymm12, %%ymm1\n\t" ins \
      " %%ymm13, %%ymm12, %%ymm2\n\t" ins " %%ymm13, %%ymm12, %%ymm3\n\t" ins \
      " %%ymm13, %%ymm12, %%ymm4\n\t" ins " %%ymm13, %%ymm12, %%ymm5\n\t" ins \
      " %%ymm13, %%ymm12, %%ymm6\n\t" ins " %%ymm13, %%ymm12, %%ymm7\n\t"
#define W4A8_PAIR4(a, b)                                                \
  a " %%ymm13, %%ymm12, %%ymm0\n\t" b " %%ymm13, %%ymm12, %%ymm1\n\t" a \
    " %%ymm13, %%ymm12, %%ymm2\n\t" b " %%ymm13, %%ymm12, %%ymm3\n\t" a \
    " %%ymm13, %%ymm12, %%ymm4\n\t" b " %%ymm13, %%ymm12, %%ymm5\n\t" a \
    " %%ymm13, %%ymm12, %%ymm6\n\t" b " %%ymm13, %%ymm12, %%ymm7\n\t"
#define W4A8_BCAST8                                                      \
  "vpbroadcastd (%%rsp), %%ymm0\n\tvpbroadcastd 4(%%rsp), %%ymm1\n\t"    \
  "vpbroadcastd 8(%%rsp), %%ymm2\n\tvpbroadcastd 12(%%rsp), %%ymm3\n\t"  \
  "vpbroadcastd 16(%%rsp), %%ymm4\n\tvpbroadcastd 20(%%rsp), %%ymm5\n\t" \
  "vpbroadcastd 24(%%rsp), %%ymm6\n\tvpbroadcastd 28(%%rsp), %%ymm7\n\t"
#define W4A8_CLOBBER_LOW "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7"
#define W4A8_INSTR(name, text)                                                        \
  double name(int64_t n) {                                                            \
    return seconds([&] {                                                              \
             for (int64_t i = 0; i < n; ++i) asm volatile(text ::: W4A8_CLOBBER_LOW); \
           }) /                                                                       \
           (static_cast<double>(n) * 8.0);                                            \
  }
W4A8_INSTR(maddubs, W4A8_X8("vpmaddubsw"))
W4A8_INSTR(maddwd, W4A8_X8("vpmaddwd"))
W4A8_INSTR(maddubs_maddwd, W4A8_PAIR4("vpmaddubsw", "vpmaddwd"))
W4A8_INSTR(addw, W4A8_X8("vpaddw"))
W4A8_INSTR(maddubs_addw, W4A8_PAIR4("vpmaddubsw", "vpaddw"))
W4A8_INSTR(pshufb, W4A8_X8("vpshufb"))
W4A8_INSTR(maddubs_pshufb, W4A8_PAIR4("vpmaddubsw", "vpshufb"))
W4A8_INSTR(broadcast, W4A8_BCAST8)

// ---- the tile's sequences. rdi: the group's 4 chunks of weights (32 bytes each, 8 rows x 8
// offset nibbles), rsi: the 5 token rows' activations (stride 4096), rdx: their group terms,
// rcx: the f32 sums (and spill slots), rbx: the 8 scales (zeros: no denormals). ymm15 stands for
// the 0x0f mask, ymm14 for the int16 ones.
#define W4A8_DECODE(o)                                   \
  "vmovdqu " #o                                          \
  "(%%rdi), %%ymm0\n\tvpand %%ymm15, %%ymm0, %%ymm1\n\t" \
  "vpsrlw $4, %%ymm0, %%ymm2\n\tvpand %%ymm15, %%ymm2, %%ymm2\n\t"
// the kernel's row step: two products to int16 pairs, their sum, widened, into the int32 sum
#define W4A8_ROW(off, acc)                                                     \
  "vpbroadcastd " #off "(%%rsi), %%ymm6\n\tvpbroadcastd 4+" #off               \
  "(%%rsi), %%ymm7\n\t"                                                        \
  "vpmaddubsw %%ymm6, %%ymm1, %%ymm6\n\tvpmaddubsw %%ymm7, %%ymm2, %%ymm7\n\t" \
  "vpaddw %%ymm7, %%ymm6, %%ymm6\n\tvpmaddwd %%ymm14, %%ymm6, %%ymm6\n\t"      \
  "vpaddd %%ymm6, "                                                            \
  "%%" #acc                                                                    \
  ", "                                                                         \
  "%%" #acc "\n\t"
#define W4A8_CHUNK(o, k)   \
  W4A8_DECODE(o)           \
  W4A8_ROW(k, ymm3)        \
  W4A8_ROW(4096 + k, ymm4) \
  W4A8_ROW(8192 + k, ymm5) W4A8_ROW(12288 + k, ymm8) W4A8_ROW(16384 + k, ymm9)
// int16 sums: the chunk's pairs added to the row's int16 sum (the first chunk starts it)
#define W4A8_ROW16(off, acc, first)                              \
  "vpbroadcastd " #off "(%%rsi), %%ymm6\n\tvpbroadcastd 4+" #off \
  "(%%rsi), %%ymm7\n\t"                                          \
  "vpmaddubsw %%ymm6, %%ymm1, %%ymm6\n\tvpmaddubsw %%ymm7, %%ymm2, %%ymm7\n\t" first(acc)
#define W4A8_START16(acc)   \
  "vpaddw %%ymm7, %%ymm6, " \
  "%%" #acc "\n\t"
#define W4A8_ADD16(acc)                              \
  "vpaddw %%ymm7, %%ymm6, %%ymm6\n\tvpaddw %%ymm6, " \
  "%%" #acc                                          \
  ", "                                               \
  "%%" #acc "\n\t"
#define W4A8_CHUNK16(o, k, f)   \
  W4A8_DECODE(o)                \
  W4A8_ROW16(k, ymm3, f)        \
  W4A8_ROW16(4096 + k, ymm4, f) \
  W4A8_ROW16(8192 + k, ymm5, f) W4A8_ROW16(12288 + k, ymm8, f) W4A8_ROW16(16384 + k, ymm9, f)
#define W4A8_GROUP16               \
  W4A8_CHUNK16(0, 0, W4A8_START16) \
  W4A8_CHUNK16(32, 8, W4A8_ADD16) W4A8_CHUNK16(64, 16, W4A8_ADD16) W4A8_CHUNK16(96, 24, W4A8_ADD16)
#define W4A8_WIDEN(acc)  \
  "vpmaddwd %%ymm14, "   \
  "%%" #acc              \
  ", "                   \
  "%%" #acc              \
  "\n\tvpaddd (%%rdx), " \
  "%%" #acc              \
  ", "                   \
  "%%" #acc "\n\t"
// the same through memory, as GCC 12 compiles it (the sums spilled, the widening from the slot)
#define W4A8_WIDEN_SPILLED(acc, slot)               \
  "vmovdqa "                                        \
  "%%" #acc ", " #slot "(%%rcx)\n\tvpmaddwd " #slot \
  "(%%rcx), %%ymm14, "                              \
  "%%" #acc                                         \
  "\n\tvpaddd (%%rdx), "                            \
  "%%" #acc                                         \
  ", "                                              \
  "%%" #acc "\n\t"
#define W4A8_START(off, acc) \
  "vpbroadcastd " #off       \
  "(%%rdx), "                \
  "%%" #acc "\n\t"
#define W4A8_STARTS   \
  W4A8_START(0, ymm3) \
  W4A8_START(4096, ymm4) W4A8_START(8192, ymm5) W4A8_START(12288, ymm8) W4A8_START(16384, ymm9)
// the group's epilogue: int32 sums to f32, times the 8 rows' scales, into the f32 sums in L1
#define W4A8_EPI(acc, f)          \
  "vcvtdq2ps "                    \
  "%%" #acc                       \
  ", "                            \
  "%%" #acc "\n\tvfmadd213ps " #f \
  "(%%rcx), %%ymm10, "            \
  "%%" #acc                       \
  "\n\t"                          \
  "vmovaps "                      \
  "%%" #acc ", " #f "(%%rcx)\n\t"
#define W4A8_EPILOGUE                                                                    \
  "vmovups (%%rbx), %%ymm10\n\t" W4A8_EPI(ymm3, 0) W4A8_EPI(ymm4, 32) W4A8_EPI(ymm5, 64) \
      W4A8_EPI(ymm8, 96) W4A8_EPI(ymm9, 128)
#define W4A8_CHUNKS4 W4A8_CHUNK(0, 0) W4A8_CHUNK(32, 8) W4A8_CHUNK(64, 16) W4A8_CHUNK(96, 24)

struct Buffers {
  std::vector<uint8_t> weights = std::vector<uint8_t>(4096, 0x5a);
  std::vector<int8_t> act = std::vector<int8_t>(5 * 4096 + 64, 3);
  alignas(32) float sums[128] = {};  // 5 rows of f32 sums, then 5 spill slots
  alignas(32) float scales[8] = {};
};

// cycles per chunk of `groups` groups of 4 chunks, walking 32 columns per group
template <int kVariant>
double group_cycles(int64_t groups, Buffers& b, double cycle) {
  const double s = seconds([&] {
    int64_t k = 0;
    for (int64_t i = 0; i < groups; ++i) {
      const uint8_t* w = b.weights.data() + (k * 4) % 4096;
      const int8_t* a = b.act.data() + k;
      const int8_t* terms = b.act.data() + 2048 + k / 8;
      float* f = b.sums;
      const float* sc = b.scales;
#define W4A8_OPERANDS                   \
  ::"D"(w), "S"(a), "d"(terms), "c"(f), \
      "b"(sc)                           \
      : "xmm0",                         \
        "xmm1",                         \
        "xmm2",                         \
        "xmm3",                         \
        "xmm4",                         \
        "xmm5",                         \
        "xmm6",                         \
        "xmm7",                         \
        "xmm8",                         \
        "xmm9",                         \
        "xmm10",                        \
        "memory"
      if constexpr (kVariant == 0) asm volatile(W4A8_CHUNKS4 W4A8_OPERANDS);
      if constexpr (kVariant == 1)
        asm volatile(W4A8_STARTS W4A8_CHUNKS4 W4A8_EPILOGUE W4A8_OPERANDS);
      if constexpr (kVariant == 2) asm volatile(W4A8_GROUP16 W4A8_OPERANDS);
      if constexpr (kVariant == 3)
        asm volatile(W4A8_GROUP16 W4A8_WIDEN(ymm3) W4A8_WIDEN(ymm4) W4A8_WIDEN(ymm5)
                         W4A8_WIDEN(ymm8) W4A8_WIDEN(ymm9) W4A8_EPILOGUE W4A8_OPERANDS);
      if constexpr (kVariant == 4)
        asm volatile(W4A8_GROUP16 W4A8_WIDEN_SPILLED(ymm3, 160) W4A8_WIDEN_SPILLED(ymm4, 192)
                         W4A8_WIDEN_SPILLED(ymm5, 224) W4A8_WIDEN_SPILLED(ymm8, 256)
                             W4A8_WIDEN_SPILLED(ymm9, 288) W4A8_EPILOGUE W4A8_OPERANDS);
#undef W4A8_OPERANDS
      k = (k + 32) % 2048;
    }
  });
  return s / (static_cast<double>(groups) * 4.0) / cycle;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("this CPU has no AVX2 and FMA: nothing to measure\n");
    return 0;
  }
  constexpr int64_t kIters = 20'000'000;
  const double cycle = cycle_seconds(kIters);
  std::printf("core clock %.2f GHz (dependent adds)\n\n", 1e-9 / cycle);
  std::printf("single instructions, 8 independent per iteration: cycles per instruction\n");
  // ymm12-15 (operands, the nibble mask, the int16 ones) are only read, whatever they hold:
  // none of these instructions' timing depends on the values
  const struct {
    const char* name;
    double (*f)(int64_t);
  } singles[] = {{"vpmaddubsw", maddubs},
                 {"vpmaddwd", maddwd},
                 {"vpmaddubsw + vpmaddwd", maddubs_maddwd},
                 {"vpaddw", addw},
                 {"vpmaddubsw + vpaddw", maddubs_addw},
                 {"vpshufb", pshufb},
                 {"vpmaddubsw + vpshufb", maddubs_pshufb},
                 {"vpbroadcastd ymm, m32", broadcast}};
  for (const auto& s : singles) std::printf("  %-24s %.2f\n", s.name, s.f(kIters) / cycle);

  Buffers b;
  constexpr int64_t kGroups = 5'000'000;
  std::printf("\nthe 5-row tile's chunk (320 MACs): cycles per chunk, groups of 4 chunks\n");
  std::printf(
      "  widened per chunk, chunks only            %.2f (15 multiply-pipe ops: 7.5 on two pipes)\n",
      group_cycles<0>(kGroups, b, cycle));
  std::printf("  widened per chunk, with start + epilogue  %.2f\n",
              group_cycles<1>(kGroups, b, cycle));
  std::printf("  int16 sums, chunks only                   %.2f (10 multiply-pipe ops: 5)\n",
              group_cycles<2>(kGroups, b, cycle));
  std::printf("  int16 sums, widened once, + epilogue      %.2f\n",
              group_cycles<3>(kGroups, b, cycle));
  std::printf("  the same, sums spilled before widening    %.2f\n",
              group_cycles<4>(kGroups, b, cycle));
  return 0;
}
