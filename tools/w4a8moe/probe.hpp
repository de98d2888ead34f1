// Short probes of the machine's limits, run in the same process as a benchmark so that the
// benchmark's figures can be reported as a fraction of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace w4a8moe::cli {

// The sum of words [0, n) of p, read with a software prefetch 2 KiB ahead, as the kernels
// prefetch their next weights: the read loop of every probe here.
uint64_t sum_range(const uint64_t* p, size_t n);

// Streaming read bandwidth in bytes/s: `threads` threads each sum their part of a 1 GiB buffer
// (allocated once per process); median of `runs`.
double measure_read_bandwidth(int threads, int runs = 5);

// Seconds for `threads` threads, already running, to read `bytes` of the probe buffer just
// flushed from the caches, each its contiguous share, with nothing else to do (beyond 1 GiB:
// 1 GiB's time scaled): what reading a forward's weights from DRAM takes at best when the read
// is short (a decode step) and the streams start and stop with it, which the 1 GiB probe does
// not show.
double measure_cold_read(size_t bytes, int threads);

// Peak int8 MAC rate (MAC/s) of a kernel set's core instructions on `threads` threads at once,
// each run a 20 ms window; 0 when the set has no probe on this machine (e.g. the portable set).
double measure_peak_macs(const std::string& kernel_set, int threads, int runs = 5);

// Writes back and drops every cache line of [data, data + bytes) from all cache levels
// (clflush on x86, dc civac on AArch64): the next read of it comes from DRAM. The way to make
// a benchmark's weights cold on machines whose last-level cache holds most of a layer.
void flush_from_caches(const void* data, size_t bytes);

// Reads twice the last-level cache's size of memory used nowhere else, so that the next timed
// run starts with cold caches.
void evict_caches();

}  // namespace w4a8moe::cli
