// What the forward ops of torch_ops.cpp and torch_routed_ops.cpp share: the facts of the packed
// headers, decoded once per buffer, and the ops' size arguments checked against them.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "torch_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe_torch::headers {

// The size arguments of a forward op.
struct Sizes {
  int64_t hidden, inter, group_size;
};

// What the op holds hidden_size, intermediate_size and group_size against: a packed header's role
// and dimensions, and its expert count (the E of the router logits).
struct HeaderFacts {
  w4a8moe::WeightRole role;
  int64_t experts, rows, cols;
  int group_size;
};

// The packed headers the forward ops have decoded. forward() decodes and checks both headers on
// every call; the ops need them before that, to check their size arguments, and take them from
// here so that a call decodes each header once (in forward()), or twice the first time a buffer
// is seen. An entry is keyed on the buffer's address and size and keeps a copy of the header's
// bytes; it serves only a buffer of that size that still holds those bytes. What a header says
// is a function of those bytes and the buffer's size alone (docs/packed-format.md, "The
// buffer": the header, then the experts), so an entry that serves gives what decoding gives,
// and a buffer rewritten in place, or freed and its memory reused by another, is decoded anew.
// Thread-safe without waiting: a call that finds the lock taken (by a concurrent call, or in a
// child forked while a parent thread held it) decodes instead.
class HeaderCache {
 public:
  static HeaderCache& instance() {
    static HeaderCache* cache = new HeaderCache;  // never destroyed: ops may run during exit
    return *cache;
  }

  HeaderFacts facts(std::span<const uint8_t> packed, const char* name) {
    {
      std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
      if (lock.owns_lock()) {
        const auto it = entries_.find(packed.data());
        if (it != entries_.end() && it->second.size == packed.size() &&
            std::equal(it->second.header.begin(), it->second.header.end(), packed.begin()))
          return it->second.facts;
      }
    }
    const w4a8moe::PackedInfo info = w4a8moe::inspect_packed(packed, name);
    const HeaderFacts facts{info.role, info.experts, info.rows, info.cols, info.group_size};
    const size_t header_bytes =
        info.total_bytes - static_cast<size_t>(info.experts) * info.expert_bytes;
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (lock.owns_lock()) {
      if (entries_.size() >= kMaxEntries) entries_.clear();
      Entry& e = entries_[packed.data()];
      e.size = packed.size();
      e.header.assign(packed.begin(), packed.begin() + static_cast<std::ptrdiff_t>(header_bytes));
      e.facts = facts;
    }
    return facts;
  }

 private:
  // Two buffers per MoE layer: more than the layers of the models in use. When full, it starts
  // over.
  static constexpr size_t kMaxEntries = 1024;
  struct Entry {
    size_t size = 0;
    std::vector<uint8_t> header;
    HeaderFacts facts{};
  };
  std::mutex mutex_;
  std::unordered_map<const uint8_t*, Entry> entries_;
};

// hidden_size, intermediate_size and group_size must agree with the packed buffers' headers.
inline void check_sizes_against_packed(const HeaderFacts& w13, const HeaderFacts& w2,
                                       const Sizes& s) {
  TORCH_CHECK(w13.role == w4a8moe::WeightRole::w13,
              "w13_packed: expected weights packed as w13, got a buffer packed as w2");
  TORCH_CHECK(w2.role == w4a8moe::WeightRole::w2,
              "w2_packed: expected weights packed as w2, got a buffer packed as w13");
  TORCH_CHECK(s.hidden == w13.cols, "hidden_size: expected ", w13.cols,
              " (the hidden size of w13_packed), got ", s.hidden);
  TORCH_CHECK(2 * s.inter == w13.rows, "intermediate_size: expected ", w13.rows / 2,
              " (half the rows of w13_packed), got ", s.inter);
  TORCH_CHECK(s.hidden == w2.rows && s.inter == w2.cols, "w2_packed: expected [", s.hidden, ", ",
              s.inter, "] per expert (hidden_size, intermediate_size), got [", w2.rows, ", ",
              w2.cols, "]");
  TORCH_CHECK(s.group_size == w13.group_size && s.group_size == w2.group_size,
              "group_size: expected ", w13.group_size, " (the group size of w13_packed), got ",
              s.group_size);
}

// What the Meta kernels check of the packed tensors and the size arguments: a meta tensor holds no
// header to check them against, only its dtype.
inline void check_meta_packed(const at::Tensor& w13_packed, const at::Tensor& w2_packed,
                              const Sizes& s) {
  TORCH_CHECK(w13_packed.scalar_type() == at::kByte && w2_packed.scalar_type() == at::kByte,
              "w13_packed, w2_packed: expected uint8 tensors of packed weights, got ",
              w13_packed.scalar_type(), " and ", w2_packed.scalar_type());
  TORCH_CHECK(s.inter >= 1, "intermediate_size: expected a positive value, got ", s.inter);
  TORCH_CHECK(w4a8moe::is_valid_group_size(s.group_size),
              "group_size: expected -1 or a multiple of 32, got ", s.group_size);
}

// The bytes of both packed tensors, their headers checked against the size arguments.
struct Packed {
  std::span<const uint8_t> w13, w2;
  HeaderFacts w13_facts;
};

inline Packed checked_packed(const at::Tensor& w13_packed, const at::Tensor& w2_packed,
                             const Sizes& sizes) {
  Packed p{util::bytes_of(w13_packed, "w13_packed"), util::bytes_of(w2_packed, "w2_packed"), {}};
  // w2's header first: a call with both headers damaged names w2_packed.
  HeaderCache& cache = HeaderCache::instance();
  const HeaderFacts w2_facts = cache.facts(p.w2, "w2_packed");
  p.w13_facts = cache.facts(p.w13, "w13_packed");
  check_sizes_against_packed(p.w13_facts, w2_facts, sizes);
  return p;
}

}  // namespace w4a8moe_torch::headers
