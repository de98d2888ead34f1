// The ISA clusters: the kernel files of one folder compiled with one set of compiler flags
// (CMakeLists.txt, `w4a8moe_isa_cluster`), each named after the kernel set it serves, and the
// CPU features each is compiled for. This table drives both ends (docs/kernel-sets.md):
//   - every file of a cluster starts with `static_assert(compiled_for("name"))`
//     (cpu/compiled_isa.hpp): its flags must give exactly the cluster's features, no fewer (the
//     code would not compile) and no more (the compiler may emit any instruction they allow);
//   - every kernel set requires, at run time, the features of the cluster named after it
//     (registry.cpp), which include those of the lower clusters whose kernels it reuses.
#pragma once

#include <cstdint>
#include <string_view>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::detail {

// One bit per CPU feature a kernel file can be compiled for: each has its compiler macro
// (kCompiledIsa) and its field of CpuFeatures (kIsaFields).
enum IsaFeature : uint32_t {
  kSse41 = 1u << 0,
  kAvx = 1u << 1,
  kAvx2 = 1u << 2,
  kFma = 1u << 3,
  kF16c = 1u << 4,
  kAvx512f = 1u << 5,
  kAvx512bw = 1u << 6,
  kAvx512vl = 1u << 7,
  kAvx512dq = 1u << 8,
  kAvx512vnni = 1u << 9,
  kAvx512vbmi = 1u << 10,
  kAvx512bf16 = 1u << 11,
  kAvxvnni = 1u << 12,
  kAmxTile = 1u << 13,
  kAmxInt8 = 1u << 14,
  kNeon = 1u << 15,
  kDotprod = 1u << 16,
  kI8mm = 1u << 17,
  kSve = 1u << 18,
  kBf16 = 1u << 19,
};

struct IsaField {
  uint32_t feature;
  bool CpuFeatures::*usable;
};

// The CpuFeatures field that says the CPU (and the OS) can run each feature. AMX-TILE and
// AMX-INT8 are one field: amx_int8 holds when both are usable.
inline constexpr IsaField kIsaFields[] = {
    {kSse41, &CpuFeatures::sse41},
    {kAvx, &CpuFeatures::avx},
    {kAvx2, &CpuFeatures::avx2},
    {kFma, &CpuFeatures::fma},
    {kF16c, &CpuFeatures::f16c},
    {kAvx512f, &CpuFeatures::avx512f},
    {kAvx512bw, &CpuFeatures::avx512bw},
    {kAvx512vl, &CpuFeatures::avx512vl},
    {kAvx512dq, &CpuFeatures::avx512dq},
    {kAvx512vnni, &CpuFeatures::avx512vnni},
    {kAvx512vbmi, &CpuFeatures::avx512vbmi},
    {kAvx512bf16, &CpuFeatures::avx512bf16},
    {kAvxvnni, &CpuFeatures::avxvnni},
    {kAmxTile, &CpuFeatures::amx_int8},
    {kAmxInt8, &CpuFeatures::amx_int8},
    {kNeon, &CpuFeatures::neon},
    {kDotprod, &CpuFeatures::dotprod},
    {kI8mm, &CpuFeatures::i8mm},
    {kSve, &CpuFeatures::sve},
    {kBf16, &CpuFeatures::bf16},
};

struct IsaCluster {
  const char* name;
  uint32_t features;
};

// The features of each cluster: what its flags turn on, implied features included (-mavx2
// also gives AVX and SSE4.1; -mavx512f gives AVX2). Arm: -march=armv8.2-a's own extensions
// come with every dot-product CPU (the dot product exists from Armv8.2 on).
inline constexpr uint32_t kAvx2Isa = kSse41 | kAvx | kAvx2 | kFma | kF16c;
inline constexpr uint32_t kAvx512Isa =
    kAvx2Isa | kAvx512f | kAvx512bw | kAvx512vl | kAvx512dq | kAvx512vnni;
inline constexpr IsaCluster kIsaClusters[] = {
    {"avx2", kAvx2Isa},
    {"avxvnni", kAvx2Isa | kAvxvnni},
    {"avxvnniemu", kAvx2Isa},  // the avxvnni GEMM on the AVX2 model of `vpdpbusd`
    {"avx512vnni", kAvx512Isa},
    {"amxemu", kAvx512Isa | kAvx512vbmi},  // vpermb unpacks the weights
    {"amx", kAvx512Isa | kAvx512vbmi | kAmxTile | kAmxInt8},
    {"neon", kNeon},
    {"neondot", kNeon | kDotprod},
    {"neoni8mm", kNeon | kDotprod | kI8mm},  // every i8mm core has the dot product (Armv8.6)
};

// The features of cluster `name`; a name that is no cluster does not compile.
consteval uint32_t cluster_features(std::string_view name) {
  for (const IsaCluster& c : kIsaClusters)
    if (name == c.name) return c.features;
  throw "not an ISA cluster of src/cpu/isa.hpp";
}

// Whether the CPU can run every one of `features`.
inline bool cpu_has(const CpuFeatures& f, uint32_t features) {
  for (const IsaField& field : kIsaFields)
    if ((features & field.feature) != 0 && !(f.*field.usable)) return false;
  return true;
}

}  // namespace w4a8moe::detail
