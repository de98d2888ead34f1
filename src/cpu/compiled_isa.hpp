// The guards of the ISA clusters' files (cpu/isa.hpp): the features the including translation
// unit is compiled for, from the compiler's macros, against a cluster's. Included by kernel
// files only.
#pragma once

#include <cstdint>
#include <string_view>

#include "cpu/isa.hpp"

namespace w4a8moe::detail {

namespace {  // internal linkage: each translation unit sees its own flags

// The features the including translation unit is compiled for (GCC spells the AMX macros
// __AMX_TILE__, clang __AMXTILE__).
constexpr uint32_t kCompiledIsa = 0
#if defined(__SSE4_1__)
                                  | kSse41
#endif
#if defined(__AVX__)
                                  | kAvx
#endif
#if defined(__AVX2__)
                                  | kAvx2
#endif
#if defined(__FMA__)
                                  | kFma
#endif
#if defined(__F16C__)
                                  | kF16c
#endif
#if defined(__AVX512F__)
                                  | kAvx512f
#endif
#if defined(__AVX512BW__)
                                  | kAvx512bw
#endif
#if defined(__AVX512VL__)
                                  | kAvx512vl
#endif
#if defined(__AVX512DQ__)
                                  | kAvx512dq
#endif
#if defined(__AVX512VNNI__)
                                  | kAvx512vnni
#endif
#if defined(__AVX512VBMI__)
                                  | kAvx512vbmi
#endif
#if defined(__AVX512BF16__)
                                  | kAvx512bf16
#endif
#if defined(__AVXVNNI__)
                                  | kAvxvnni
#endif
#if defined(__AMX_TILE__) || defined(__AMXTILE__)
                                  | kAmxTile
#endif
#if defined(__AMX_INT8__) || defined(__AMXINT8__)
                                  | kAmxInt8
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
                                  | kNeon
#endif
#if defined(__ARM_FEATURE_DOTPROD)
                                  | kDotprod
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
                                  | kI8mm
#endif
#if defined(__ARM_FEATURE_SVE)
                                  | kSve
#endif
#if defined(__ARM_FEATURE_BF16)
                                  | kBf16
#endif
    ;

// The guard of a cluster's source files: compiled for exactly the cluster's features.
consteval bool compiled_for(std::string_view cluster) {
  return kCompiledIsa == cluster_features(cluster);
}

// The guard of a header shared by several clusters: compiled for at least `cluster`'s features.
consteval bool compiled_for_at_least(std::string_view cluster) {
  return (kCompiledIsa & cluster_features(cluster)) == cluster_features(cluster);
}

}  // namespace

}  // namespace w4a8moe::detail
