// Tasks claimed by the threads of a forward pass: one contiguous segment of the tasks per
// thread, which the thread takes from the front; a thread whose segment is used up takes the
// others' remaining tasks from their backs. Consecutive tasks read neighbouring weights, so each
// thread streams its own region of memory, far from the others'. Taking tasks in turn from one
// counter would have the threads read alternate 64 KiB runs of the same region, which DRAM
// serves about 1.3x slower here (docs/performance.md, "Decode: where the time goes"). Taking
// from the backs keeps a late or slow thread from holding the others up.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>

namespace w4a8moe::detail {

class TaskClaims {
 public:
  explicit TaskClaims(int threads)
      : threads_(threads < 1 ? 1 : threads),
        segments_(new Segment[static_cast<size_t>(threads_)]) {}

  // Tasks [0, n) from now on. Not concurrent with claim(): the caller publishes it (release)
  // before another thread claims.
  void reset(int64_t n) noexcept {
    for (int t = 0; t < threads_; ++t) {
      Segment& s = segments_[static_cast<size_t>(t)];
      s.front = bound(n, t);
      s.back = bound(n, t + 1);
    }
  }

  // A task not claimed before, or -1 when none is left.
  int64_t claim(int thread) noexcept {
    {
      Segment& own = segments_[static_cast<size_t>(thread)];
      std::lock_guard lock(own.m);
      if (own.front < own.back) return own.front++;
    }
    for (int k = 1; k < threads_; ++k) {
      Segment& other = segments_[static_cast<size_t>((thread + k) % threads_)];
      std::lock_guard lock(other.m);
      if (other.front < other.back) return --other.back;
    }
    return -1;
  }

 private:
  // A lock per segment: the owner and a thief meet only at a segment's last tasks, and a claim
  // is a few instructions under the lock against microseconds of work per task.
  struct alignas(64) Segment {
    std::mutex m;
    int64_t front = 0, back = 0;
  };

  // The first task of segment t: t * n / threads, without overflow.
  int64_t bound(int64_t n, int t) const noexcept {
    const int64_t q = n / threads_, r = n % threads_;
    return q * t + r * t / threads_;
  }

  int threads_;
  std::unique_ptr<Segment[]> segments_;
};

}  // namespace w4a8moe::detail
