// Shared pieces of the libFuzzer harnesses.
//
// Each harness is written once as W4A8MOE_FUZZ_TARGET(name) { ... data, size ... } and built two
// ways: with clang and -fsanitize=fuzzer it is the fuzzer's entry point (LLVMFuzzerTestOneInput);
// otherwise it is the function w4a8moe_fuzz_<name>(), which the GoogleTest replay suite
// (tests/test_fuzz_replay.cpp) calls on every file of fuzz/corpus/<name>/, so a crash once found
// stays fixed in every build, sanitized or not.
//
// A harness returns normally when the library accepts or rejects the input with w4a8moe::Error.
// It aborts (a finding) when an invariant breaks: another exception type, a call accepted that
// the contract says must be refused, different bits for different thread counts.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "w4a8moe/w4a8moe.hpp"

#if defined(W4A8MOE_LIBFUZZER)
#define W4A8MOE_FUZZ_TARGET(name) \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size)
#else
#define W4A8MOE_FUZZ_TARGET(name) int w4a8moe_fuzz_##name(const uint8_t* data, size_t size)
#endif

namespace w4a8moe::fuzz {

// A broken invariant: print it and abort, so libFuzzer (or the replay test) reports the input.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "w4a8moe fuzz finding: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Reads the fuzzer's bytes as a stream of choices; past the end every read gives zero.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t u8() { return at_ < size_ ? data_[at_++] : 0; }
  bool flag() { return (u8() & 1) != 0; }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | u8();
    return v;
  }
  uint64_t u64() { return (uint64_t{u32()} << 32) | u32(); }
  float f32() {
    const uint32_t bits = u32();
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }

  // A dimension: mostly sizes the library likes (multiples of 32 and their neighbours), some
  // small numbers, and hostile values (zero, negatives, the limits and past them, overflow).
  int64_t dim() {
    static constexpr int64_t kNice[] = {1,  2,  3,  4,  8,  16, 31,  32,
                                        33, 40, 63, 64, 65, 96, 128, 256};
    static constexpr int64_t kHostile[] = {0,
                                           -1,
                                           -32,
                                           int64_t{1} << 16,
                                           (int64_t{1} << 16) + 32,
                                           INT32_MAX,
                                           int64_t{1} << 31,
                                           UINT32_MAX,
                                           int64_t{1} << 32,
                                           (int64_t{1} << 32) + 2,
                                           int64_t{1} << 40,
                                           int64_t{1} << 62,
                                           INT64_MAX,
                                           INT64_MIN,
                                           INT64_MAX / 2 + 1};
    const uint8_t b = u8();
    if (b < 160) return kNice[b % 16];
    if (b < 220) return b - 160;
    return kHostile[b % 15];
  }
  // `good` most of the time, else dim().
  int64_t dim_or(int64_t good) { return u8() < 192 ? good : dim(); }

  size_t remaining() const { return size_ - at_; }
  std::span<const uint8_t> rest() {
    const std::span<const uint8_t> r(data_ + at_, size_ - at_);
    at_ = size_;
    return r;
  }
  std::span<const uint8_t> take(size_t n) {
    n = std::min(n, size_ - at_);
    const std::span<const uint8_t> r(data_ + at_, n);
    at_ += n;
    return r;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

// Bytes a view claims, (rows - 1) * stride + last dimension elements, or -1 when a dimension is
// negative or the count overflows (the library must refuse such a view before reading it).
inline int64_t claimed_bytes(DType dtype, int rank, const std::array<int64_t, 3>& shape,
                             int64_t stride) {
  if (rank < 1) return 0;
  uint64_t rows = 1;
  for (int k = 0; k + 1 < rank; ++k) {
    if (shape[static_cast<size_t>(k)] < 0) return -1;
    if (__builtin_mul_overflow(rows, static_cast<uint64_t>(shape[static_cast<size_t>(k)]), &rows))
      return -1;
  }
  const int64_t last = shape[static_cast<size_t>(rank - 1)];
  if (last < 0 || stride < 0) return -1;
  uint64_t span = 0;
  if (rows > 0 && last > 0) {
    if (__builtin_mul_overflow(rows - 1, static_cast<uint64_t>(stride), &span)) return -1;
    if (__builtin_add_overflow(span, static_cast<uint64_t>(last), &span)) return -1;
  }
  const uint64_t element = std::max<size_t>(dtype_bytes(dtype), 1);
  uint64_t bytes;
  if (__builtin_mul_overflow(span, element, &bytes) || bytes > INT64_MAX / 2) return -1;
  return static_cast<int64_t>(bytes);
}

// Heap buffers of exactly the claimed size (plus a misalignment), so that AddressSanitizer sees
// any read past the end. Owns everything it hands out until destroyed.
class Buffers {
 public:
  static constexpr int64_t kCap = int64_t{1} << 20;  // larger claims: the call is skipped

  ~Buffers() {
    for (uint8_t* p : owned_) std::free(p);
  }
  // A buffer for a view claiming `bytes` (-1: an invalid claim; a small buffer is given and the
  // library must refuse the view). Filled from `fill` (cycled), or zero. Sets `skip` when the
  // claim is valid but larger than kCap (the call would be legitimate and slow).
  uint8_t* get(int64_t bytes, size_t misalign, std::span<const uint8_t> fill, bool& skip) {
    if (bytes > kCap) {
      skip = true;
      return nullptr;
    }
    const size_t n = bytes < 0 ? 16 : static_cast<size_t>(bytes);
    auto* p = static_cast<uint8_t*>(std::malloc(std::max<size_t>(n + misalign, 1)));
    if (p == nullptr) finding("the harness could not allocate");
    owned_.push_back(p);
    uint8_t* d = p + misalign;
    for (size_t i = 0; i < n; ++i) d[i] = fill.empty() ? 0 : fill[i % fill.size()];
    return d;
  }

 private:
  std::vector<uint8_t*> owned_;
};

// A file holding `bytes`, readable by its path (/proc/self/fd/N), gone with this object.
class MemFile {
 public:
  explicit MemFile(std::span<const uint8_t> bytes) {
    fd_ = ::memfd_create("w4a8moe-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) finding("memfd_create failed");
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n <= 0) finding("writing the memfd failed");
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// forward() on two packed buffers with a few tokens generated from `r`, on one thread and on two:
// the library may refuse (Error), but when it computes, the bits must agree (docs/operator.md:
// results are bit-identical for any thread count), NaN payloads included.
inline void forward_on_one_and_two_threads(std::span<const uint8_t> w13,
                                           std::span<const uint8_t> w2, Reader& r) {
  const PackedInfo i13 = inspect_packed(w13, "w13");
  const int64_t H = i13.cols, E = i13.experts;
  const int64_t T = 1 + r.u8() % 5, K = 1 + r.u8() % std::min<int64_t>(E, 4);
  const DType dt = r.u8() % 3 == 0 ? DType::f32 : (r.flag() ? DType::bf16 : DType::f16);
  const size_t eb = dtype_bytes(dt);
  std::vector<uint8_t> x(static_cast<size_t>(T * H) * eb);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>(r.u8() ^ (i * 37));
  if (dt == DType::f32)  // keep most f32 values finite and of order one
    for (size_t i = 0; i + 3 < x.size(); i += 4)
      x[i + 3] = static_cast<uint8_t>(0x3e + (x[i + 3] & 0x81));
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(r.u8() % E);
  std::vector<float> weights(ids.size());
  for (size_t i = 0; i < weights.size(); ++i)
    weights[i] = 0.125f * static_cast<float>(1 + r.u8() % 8);
  MoeParams params;
  params.activation = static_cast<Activation>(r.u8() % 5);
  params.apply_router_weight_on_input = r.flag();
  static Context one(1), two(2);
  one.set_memory_limit(size_t{64} << 20);
  two.set_memory_limit(size_t{64} << 20);
  std::vector<uint8_t> out1(x.size(), 0xff), out2(x.size(), 0xee);
  const TensorView xv = TensorView::of(x.data(), dt, {T, H});
  const TensorView iv = TensorView::of(ids.data(), DType::i32, {T, K});
  const TensorView wv = TensorView::of(weights.data(), DType::f32, {T, K});
  forward(one, xv, iv, wv, w13, w2, params, MutableTensorView::of(out1.data(), dt, {T, H}));
  forward(two, xv, iv, wv, w13, w2, params, MutableTensorView::of(out2.data(), dt, {T, H}));
  if (out1 != out2) finding("forward gave different bits on one and on two threads");
}

}  // namespace w4a8moe::fuzz
