#include "w4a8moe/probe.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/large_alloc.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

namespace {

struct Buffer {
  explicit Buffer(size_t bytes)
      : data(static_cast<uint64_t*>(detail::large_alloc(bytes, 4096))), words(bytes / 8) {
    if (!data) throw std::bad_alloc();
    for (size_t i = 0; i < words; ++i) data[i] = i;  // touch every page
  }
  ~Buffer() { std::free(data); }
  uint64_t* data;
  size_t words;
};

volatile uint64_t g_sink;

void parallel_sum(const Buffer& buf, int threads) {
  std::vector<std::thread> pool;
  std::vector<uint64_t> sums(static_cast<size_t>(threads));
  const size_t per = buf.words / static_cast<size_t>(threads);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      sums[static_cast<size_t>(t)] = sum_range(buf.data + per * static_cast<size_t>(t), per);
    });
  for (auto& th : pool) th.join();
  uint64_t s = 0;
  for (uint64_t v : sums) s += v;
  g_sink = s;
}

// The probes' buffer: allocated and touched once per process.
Buffer& probe_buffer() {
  static Buffer buf(size_t{1} << 30);
  return buf;
}

}  // namespace

uint64_t sum_range(const uint64_t* p, size_t n) {
  uint64_t a = 0, b = 0, c = 0, d = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __builtin_prefetch(p + i + 256);  // 2 KiB ahead, as the kernels prefetch their next weights
    a += p[i] + p[i + 4];
    b += p[i + 1] + p[i + 5];
    c += p[i + 2] + p[i + 6];
    d += p[i + 3] + p[i + 7];
  }
  for (; i < n; ++i) a += p[i];
  return a + b + c + d;
}

double measure_cold_read(size_t bytes, int threads) {
  Buffer& buf = probe_buffer();
  const size_t words = std::max<size_t>(std::min(bytes / 8, buf.words), 1);
  const size_t n = static_cast<size_t>(std::max(threads, 1));
  const size_t per = words / n;
  flush_from_caches(buf.data, words * 8);
  // The threads start before the clock and spin until it starts, so that a thread's creation
  // and wake-up are not part of the read. The caller sleeps a moment first: a new thread can
  // start on the caller's CPU, and a caller spinning there would hold it (or share it) until the
  // scheduler moves one of them; waking from the sleep, the caller is placed on an idle CPU.
  std::atomic<size_t> spinning{0}, finished{0};
  std::atomic<bool> go{false};
  std::vector<uint64_t> sums(n);
  auto read = [&](size_t t) {
    const size_t begin = per * t, end = t + 1 == n ? words : begin + per;
    sums[t] = sum_range(buf.data + begin, end - begin);
  };
  std::vector<std::thread> pool;
  for (size_t t = 1; t < n; ++t)
    pool.emplace_back([&, t] {
      spinning.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      read(t);
      finished.fetch_add(1, std::memory_order_release);
    });
  while (spinning.load() + 1 < n) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  const auto t0 = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  read(0);
  while (finished.load(std::memory_order_acquire) + 1 < n) std::this_thread::yield();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& th : pool) th.join();
  uint64_t total = 0;
  for (uint64_t v : sums) total += v;
  g_sink = total;
  return s * static_cast<double>(bytes) / static_cast<double>(words * 8);  // more than the buffer
}

double measure_read_bandwidth(int threads, int runs) {
  const size_t bytes = size_t{1} << 30;
  Buffer& buf = probe_buffer();
  std::vector<double> rates;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    parallel_sum(buf, threads);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rates.push_back(static_cast<double>(bytes) / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

#if defined(__x86_64__)
namespace x86 {
double macs_avx512vnni(int64_t iters);
double macs_avxvnni(int64_t iters);
double macs_avx2(int64_t iters);
double macs_amx(int64_t iters);
}  // namespace x86
#endif

// The kernel sets with a MAC probe (probe_peak_x86.cpp), by name, with the iterations of one
// slice: about a millisecond or less (an AMX iteration does 64 Ki MAC).
struct PeakProbe {
  std::string_view kernel_set;
  double (*macs)(int64_t iters);
  int64_t slice;
};

constexpr PeakProbe kPeakProbes[] = {
#if defined(__x86_64__)
    {"amx", x86::macs_amx, 10'000},
    {"avx512vnni", x86::macs_avx512vnni, 100'000},
    {"avxvnni", x86::macs_avxvnni, 100'000},
    {"avx2", x86::macs_avx2, 100'000},
#endif
    {"", nullptr, 0},
};

double measure_peak_macs(const std::string& kernel_set, int threads, int runs) {
  // a probe runs only when the registry finds its set usable on this CPU
  const std::vector<std::string> usable = available_kernel_sets();
  if (std::find(usable.begin(), usable.end(), kernel_set) == usable.end()) return 0.0;
  const PeakProbe* found = nullptr;
  for (const PeakProbe& p : kPeakProbes)
    if (p.macs != nullptr && p.kernel_set == kernel_set) found = &p;
  if (found == nullptr) return 0.0;
  double (*probe)(int64_t) = found->macs;
  const int64_t slice = found->slice;
  // Each run keeps every thread busy for a window of kWindow, in slices of `slice` iterations
  // (well under a millisecond): a window as long as a prefill forward, so that a host which
  // takes a vCPU away for a few milliseconds costs the probe what it costs the forward, not
  // all or nothing as a 2 ms probe did.
  constexpr auto kWindow = std::chrono::milliseconds(20);
  std::vector<double> rates;
  for (int run = 0; run < runs; ++run) {
    std::vector<std::thread> pool;
    std::vector<double> macs(static_cast<size_t>(threads));
    std::atomic<bool> go{false};
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        while (!go.load(std::memory_order_acquire)) {
        }
        const auto end = std::chrono::steady_clock::now() + kWindow;
        double done = 0;
        do done += probe(slice);
        while (std::chrono::steady_clock::now() < end);
        macs[static_cast<size_t>(t)] = done;
      });
    const auto t0 = std::chrono::steady_clock::now();
    go.store(true, std::memory_order_release);
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0;
    for (double m : macs) total += m;
    rates.push_back(total / s);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// Twice the last-level cache (from sysfs; 64 MiB when unknown), between 64 MiB and 2 GiB.
size_t eviction_bytes() {
  size_t llc = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string text;
    if (!(in >> text) || text.empty()) continue;
    size_t value = std::strtoull(text.c_str(), nullptr, 10);
    if (text.back() == 'K') value <<= 10;
    if (text.back() == 'M') value <<= 20;
    llc = std::max(llc, value);
  }
  return std::clamp<size_t>(2 * llc, size_t{64} << 20, size_t{2} << 30);
}

void flush_from_caches(const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
#if defined(__x86_64__)
  for (uintptr_t a = begin; a < end; a += 64)
    __builtin_ia32_clflush(reinterpret_cast<const void*>(a));
  __builtin_ia32_mfence();
#elif defined(__aarch64__)
  for (uintptr_t a = begin; a < end; a += 64) __asm__ volatile("dc civac, %0" ::"r"(a) : "memory");
  __asm__ volatile("dsb ish" ::: "memory");
#else
  (void)begin;
  (void)end;
  evict_caches();
#endif
}

void evict_caches() {
  static Buffer buf(eviction_bytes());
  g_sink = sum_range(buf.data, buf.words);
}

}  // namespace w4a8moe::cli
