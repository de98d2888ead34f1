// Google Benchmark suites: the GEMM micro-kernel of every kernel set, and the whole layer of
// Qwen3-30B-A3B at decode and prefill token counts. Counters report bytes/s of weights touched
// and int8 MAC/s, and as of_bandwidth / of_mac_peak their fractions of the machine's limits,
// measured by probes in the same process before the benchmarks run (the `w4a8moe bench` program
// measures them between its timed runs instead, which follows a drifting machine more closely).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include "kernels/x86_amx/amx_kernels.hpp"
#endif
#include "api/task_claims.hpp"
#include "common/large_alloc.hpp"
#include "pack/packed_format.hpp"
#include "registry.hpp"
#include "w4a8moe/probe.hpp"
#include "w4a8moe/synthetic.hpp"

namespace {

using namespace w4a8moe;

// The machine's limits, measured by main() before the benchmarks run: read bandwidth (bytes/s,
// all threads) and each kernel set's int8 MAC peak (MAC/s, one thread and all threads).
struct Limits {
  double bandwidth = 0;
  std::map<std::string, std::pair<double, double>> peak;
};
Limits& limits() {
  static Limits l;
  return l;
}

// value / seconds as a fraction of `limit` (0 when the limit is unknown), a plain counter.
double fraction_of(double value, double seconds, double limit) {
  return limit > 0 && seconds > 0 ? value / seconds / limit : 0.0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Layer {
  cli::SyntheticLayer logical;
  PackedWeights w13, w2;
};

// The weight formats the suites run, by the index of their `format` argument.
constexpr WeightFormat kFormats[] = {WeightFormat::int4_symmetric, WeightFormat::int4_zero_point,
                                     WeightFormat::mxfp4};

// Qwen3-30B-A3B's layer in `format` at `group` (mxfp4: 32), bf16 scales, packed once per
// process and kept: interleaved repetitions of several formats then pack each once.
Layer& qwen3_layer(WeightFormat format, int group) {
  static std::map<std::pair<WeightFormat, int>, std::unique_ptr<Layer>> layers;
  std::unique_ptr<Layer>& slot = layers[{format, group}];
  if (slot == nullptr) {
    slot = std::make_unique<Layer>();
    slot->logical = cli::make_layer(cli::find_preset("qwen3-30b-a3b"), group, DType::bf16, 1,
                                    nullptr, nullptr, format);
    const LogicalWeights v = slot->logical.view();
    PackOptions po;
    po.group_size = group;
    po.weight_format = format;
    po.gate_up_layout = v.gate_up_layout;
    slot->w13 = pack_w13(v.w13, v.w13_scale, v.w13_zero_point, v.w13_bias, po);
    slot->w2 = pack_w2(v.w2, v.w2_scale, v.w2_zero_point, v.w2_bias, po);
  }
  return *slot;
}

// Whole layer: a fresh routing per iteration and the weights flushed from every cache level
// (outside the timing), so decode streams its experts from DRAM as in real use. Arguments:
// tokens, skewed routing, the weight format (kFormats) and the group size.
void BM_Layer(benchmark::State& state) {
  Layer& L = qwen3_layer(kFormats[state.range(2)], static_cast<int>(state.range(3)));
  const cli::Preset& p = L.logical.preset;
  const int64_t T = state.range(0), H = p.hidden, K = p.top_k;
  const bool skewed = state.range(1) != 0;
  Context ctx(0);
  const std::vector<float> x = cli::make_activations(T, H, 7);
  std::vector<float> out(static_cast<size_t>(T * H));
  std::vector<cli::Routing> routings;
  for (int r = 0; r < 16; ++r)
    routings.push_back(cli::make_routing(T, p.experts, K, skewed, 100u + static_cast<unsigned>(r)));
  const size_t expert_bytes = L.w13.info().expert_bytes + L.w2.info().expert_bytes;
  double bytes = 0, seconds = 0;
  size_t i = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const cli::Routing& rt = routings[i++ % routings.size()];
    bytes +=
        static_cast<double>(std::set<int32_t>(rt.ids.begin(), rt.ids.end()).size() * expert_bytes);
    cli::flush_from_caches(L.w13.bytes().data(), L.w13.size());
    cli::flush_from_caches(L.w2.bytes().data(), L.w2.size());
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    forward(ctx, TensorView::of(x.data(), DType::f32, {T, H}),
            TensorView::of(rt.ids.data(), DType::i32, {T, K}),
            TensorView::of(rt.weights.data(), DType::f32, {T, K}), L.w13.bytes(), L.w2.bytes(),
            MoeParams{}, MutableTensorView::of(out.data(), DType::f32, {T, H}));
    seconds += seconds_since(t0);
  }
  state.counters["weight_bytes_per_s"] = benchmark::Counter(bytes, benchmark::Counter::kIsRate);
  const double macs = static_cast<double>(state.iterations()) * static_cast<double>(T * K) * 3.0 *
                      static_cast<double>(H * p.inter);
  state.counters["mac_per_s"] = benchmark::Counter(macs, benchmark::Counter::kIsRate);
  state.counters["of_bandwidth"] = fraction_of(bytes, seconds, limits().bandwidth);
  state.counters["of_mac_peak"] =
      fraction_of(macs, seconds, limits().peak[active_kernel_set()].second);
  state.SetLabel(active_kernel_set());
}
// int4 at every token count; the other formats (int4 with zero points at groups 32 and 128,
// MXFP4) beside int4 at 1 and 512 tokens. Compare formats in one run with
// --benchmark_enable_random_interleaving and repetitions (docs/performance.md).
BENCHMARK(BM_Layer)
    ->ArgsProduct({{1, 8, 32, 128, 512}, {0}, {0}, {32}})
    ->Args({512, 1, 0, 32})
    ->ArgsProduct({{1, 512}, {0}, {1, 2}, {32}})
    ->ArgsProduct({{1, 512}, {0}, {0, 1}, {128}})
    ->ArgNames({"tokens", "skewed", "format", "group"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The dense layers of the whole-model presets (docs/whole-model.md) as linear() runs them in
// vLLM: gpt-oss-20b's attention projections (qkv 5120 x 2880, o 2880 x 4096) and LM head
// (201088 x 2880), Qwen3-30B-A3B's LM head (151936 x 2048), in int8 per output row with f32
// scales (the plugin's int8 setting); Qwen3-30B-A3B's attention projections (qkv 5120 x 2048,
// o 2048 x 4096) in int4 at group 128 with bf16 scales (as GPTQ ships them).
// Weights flushed from every cache level before each call (decode reads them from DRAM).
struct DenseShape {
  const char* name;
  int64_t rows, cols;
};
constexpr DenseShape kDense[] = {{"gpt-oss.qkv", 5120, 2880},    {"gpt-oss.o", 2880, 4096},
                                 {"gpt-oss.head", 201088, 2880}, {"qwen3.head", 151936, 2048},
                                 {"qwen3.qkv", 5120, 2048},      {"qwen3.o", 2048, 4096}};

const PackedWeights& dense_layer(size_t shape, bool int8) {
  static std::map<std::pair<size_t, bool>, PackedWeights> layers;
  auto it = layers.find({shape, int8});
  if (it != layers.end()) return it->second;
  const DenseShape& d = kDense[shape];
  const auto n = static_cast<size_t>(d.rows), k = static_cast<size_t>(d.cols);
  PackOptions po;
  PackedWeights packed;
  if (int8) {
    std::vector<int8_t> w(n * k);
    for (size_t i = 0; i < w.size(); ++i)
      w[i] = static_cast<int8_t>((i * 2654435761u >> 13) % 255 - 127);
    const std::vector<float> s(n, 1.0f / 2048);
    po.weight_format = WeightFormat::int8;
    packed = pack_linear(TensorView::of(w.data(), DType::i8, {d.rows, d.cols}),
                         TensorView::of(s.data(), DType::f32, {d.rows}), {}, {}, po);
  } else {
    std::vector<uint8_t> w(n * k / 2);
    for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(i * 2654435761u >> 11);
    const std::vector<float> s(n * k / 128, 1.0f / 64);
    po.group_size = 128;
    po.scale_storage = ScaleStorage::bf16;
    packed = pack_linear(TensorView::of(w.data(), DType::u8, {d.rows, d.cols / 2}),
                         TensorView::of(s.data(), DType::f32, {d.rows, d.cols / 128}), {}, {}, po);
  }
  return layers.emplace(std::pair{shape, int8}, std::move(packed)).first->second;
}

// Arguments: the shape (kDense), tokens, int8 (1) or int4 g128 (0).
void BM_Linear(benchmark::State& state) {
  const auto shape = static_cast<size_t>(state.range(0));
  const int64_t T = state.range(1);
  const PackedWeights& w = dense_layer(shape, state.range(2) != 0);
  const DenseShape& d = kDense[shape];
  Context ctx(0);
  const std::vector<float> x = cli::make_activations(T, d.cols, 7);
  std::vector<float> out(static_cast<size_t>(T * d.rows));
  double seconds = 0;
  for (auto _ : state) {
    state.PauseTiming();
    cli::flush_from_caches(w.bytes().data(), w.size());
    state.ResumeTiming();
    const auto t0 = std::chrono::steady_clock::now();
    linear(ctx, TensorView::of(x.data(), DType::f32, {T, d.cols}), w.bytes(),
           MutableTensorView::of(out.data(), DType::f32, {T, d.rows}));
    seconds += seconds_since(t0);
  }
  const auto it = static_cast<double>(state.iterations());
  const double bytes = it * static_cast<double>(w.size());
  const double macs = it * static_cast<double>(T * d.rows * d.cols);
  state.counters["weight_bytes_per_s"] = benchmark::Counter(bytes, benchmark::Counter::kIsRate);
  state.counters["mac_per_s"] = benchmark::Counter(macs, benchmark::Counter::kIsRate);
  state.counters["of_bandwidth"] = fraction_of(bytes, seconds, limits().bandwidth);
  state.counters["of_mac_peak"] =
      fraction_of(macs, seconds, limits().peak[active_kernel_set()].second);
  state.SetLabel(std::string(d.name) + " " + w.info().layout);
}
BENCHMARK(BM_Linear)
    ->ArgsProduct({{0, 1, 2, 3}, {1, 8, 32}, {1}})
    ->ArgsProduct({{4, 5}, {1, 8, 32}, {0}})
    ->ArgNames({"shape", "tokens", "int8"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// Reading a decode step's worth of weights (21 MB, Qwen3-30B-A3B at one token) cold on every
// hardware thread, with nothing else to do, in the access patterns a forward's tasks can have
// (docs/performance.md, "Decode: where the time goes"): 0, each thread one contiguous share;
// 1, runs of `kib` KiB taken in turn from one counter; 2, the same runs claimed as the driver
// claims its tasks (TaskClaims: a thread's own share from the front, the others' from the
// back); 3, each thread its own share, alternating between four runs like a phase-1 task (the
// gate rows, their scales at 1/16 of the size, the up rows, their scales).
uint64_t sum_lines(const uint8_t* p, size_t bytes) {
  return cli::sum_range(reinterpret_cast<const uint64_t*>(p), bytes / 8);
}

void BM_ReadPattern(benchmark::State& state) {
  const int pattern = static_cast<int>(state.range(0));
  const size_t run = static_cast<size_t>(state.range(1)) << 10;
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  constexpr size_t kBytes = size_t{21} << 20, kRegions = 16;
  // on 2 MiB pages, as the packed weights; rotated over so that no iteration reuses another's
  static const std::unique_ptr<uint8_t, decltype(&std::free)> memory = [] {
    auto* p = static_cast<uint8_t*>(detail::large_alloc(kBytes * kRegions, 64));
    if (p == nullptr) throw std::bad_alloc();
    std::fill_n(p, kBytes * kRegions, uint8_t{1});
    return std::unique_ptr<uint8_t, decltype(&std::free)>(p, &std::free);
  }();
  const size_t runs = kBytes / run;
  detail::TaskClaims claims(threads);
  std::atomic<size_t> next{0};
  std::atomic<int> started{0}, finished{0};
  std::atomic<int64_t> go{0};
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> sink{0};
  const uint8_t* base = nullptr;
  auto read = [&](int t) {
    uint64_t sum = 0;
    const size_t share = kBytes / static_cast<size_t>(threads);
    const uint8_t* own = base + share * static_cast<size_t>(t);
    if (pattern == 0) {
      sum = sum_lines(own, share);
    } else if (pattern == 1) {
      for (size_t r = next.fetch_add(1); r < runs; r = next.fetch_add(1))
        sum += sum_lines(base + r * run, run);
    } else if (pattern == 2) {
      for (int64_t r = claims.claim(t); r >= 0; r = claims.claim(t))
        sum += sum_lines(base + static_cast<size_t>(r) * run, run);
    } else {
      const size_t rows = share / 2 * 15 / 16 / run * run, scales = run / 16;
      for (size_t o = 0, so = 0; o < rows; o += run, so += scales) {
        sum += sum_lines(own + o, run);
        sum += sum_lines(own + 2 * rows + so, scales);
        sum += sum_lines(own + rows + o, run);
        sum += sum_lines(own + 2 * rows + rows / 16 + so, scales);
      }
    }
    sink.fetch_add(sum, std::memory_order_relaxed);
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t)
    pool.emplace_back([&, t] {
      started.fetch_add(1);
      for (int64_t seen = 0;;) {
        int64_t g;
        while ((g = go.load(std::memory_order_acquire)) == seen && !stop.load()) {
        }
        if (stop.load()) return;
        seen = g;
        read(t);
        finished.fetch_add(1, std::memory_order_release);
      }
    });
  while (started.load() < threads - 1) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the caller onto an idle CPU
  int64_t round = 0;
  for (auto _ : state) {
    base = memory.get() + kBytes * static_cast<size_t>(round % kRegions);
    cli::flush_from_caches(base, kBytes);
    next.store(0);
    claims.reset(static_cast<int64_t>(runs));
    finished.store(0);
    const auto t0 = std::chrono::steady_clock::now();
    go.store(++round, std::memory_order_release);
    read(0);
    while (finished.load(std::memory_order_acquire) < threads - 1) {
    }
    state.SetIterationTime(seconds_since(t0));
  }
  stop.store(true);
  for (auto& th : pool) th.join();
  benchmark::DoNotOptimize(sink.load());
  state.counters["bytes_per_s"] =
      benchmark::Counter(static_cast<double>(kBytes) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ReadPattern)
    ->Args({0, 64})
    ->ArgsProduct({{1, 2, 3}, {64, 256}})
    ->ArgNames({"pattern", "kib"})
    ->Unit(benchmark::kMillisecond)
    ->UseManualTime();

// One GEMM micro-kernel call over a 64-row slice of an expert of K = 2048 (hot in cache), with
// weight groups of 32, 128 or channelwise.
void BM_Gemm(benchmark::State& state, const detail::KernelSet* set, detail::GemmFn fn) {
  if (!set->usable(cpu_features())) {
    state.SkipWithError("kernel set not usable on this CPU");
    return;
  }
  const int64_t m = state.range(0), K = 2048, N = 64;
  const int64_t G = state.range(1);  // weight group size, -1: channelwise
  const WeightFormat format = kFormats[state.range(2)];
  const int64_t groups = G < 0 ? 1 : K / G;
  auto scale_shaped = [&](const void* data, DType dtype) {  // [1, N, groups] or [1, N]
    return G < 0 ? TensorView::of(data, dtype, {1, N})
                 : TensorView::of(data, dtype, {1, N, groups});
  };
  // int4 (either format): values 3 - 8 as nibbles, f32 scales, zero points 1; MXFP4: code 3,
  // e8m0 exponents 120
  const bool mxfp4 = format == WeightFormat::mxfp4;
  std::vector<uint8_t> w(static_cast<size_t>(N * K / 2), mxfp4 ? 0x33 : 0xbb);
  std::vector<float> s(static_cast<size_t>(N * groups), 0.01f);
  std::vector<uint8_t> e8m0(s.size(), 120);
  std::vector<int8_t> z(s.size(), 1);
  const TensorView scale =
      mxfp4 ? scale_shaped(e8m0.data(), DType::u8) : scale_shaped(s.data(), DType::f32);
  const TensorView zero_point =
      format == WeightFormat::int4_zero_point ? scale_shaped(z.data(), DType::i8) : TensorView{};
  PackOptions po;
  po.group_size = static_cast<int>(G);
  po.kernel_set = set->name;
  po.weight_format = format;
  const PackedWeights pw =
      pack_w2(TensorView::of(w.data(), DType::u8, {1, N, K / 2}), scale, zero_point, {}, po);
  const detail::Geometry g = detail::read_geometry(pw.bytes(), "bench");
  std::vector<float> a(static_cast<size_t>(K), 0.5f);
  // a quantized row: K bytes, then one int32 group term per group
  std::vector<std::vector<int32_t>> q(static_cast<size_t>(m),
                                      std::vector<int32_t>(static_cast<size_t>(K / 4 + groups)));
  std::vector<detail::QuantRow> rows(static_cast<size_t>(m));
  for (int64_t r = 0; r < m; ++r) {
    detail::QuantizeArgs qa;
    qa.src = a.data();
    qa.cols = K;
    qa.cols_padded = K;
    qa.group_len = G < 0 ? K : G;
    qa.group_term_offset = set->group_term_offset(g);
    qa.dst = q[static_cast<size_t>(r)].data();
    qa.row = &rows[static_cast<size_t>(r)];
    set->quantize(qa);
  }
  std::vector<float> c(static_cast<size_t>(m * N));
  detail::GemmArgs args;
  args.m = m;
  args.a = rows.data();
  args.expert = pw.bytes().data() + detail::kHeaderBytes;
  args.geometry = &g;
  args.n_begin = 0;
  args.n_end = N;
  args.c = c.data();
  args.c_stride = N;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (fn != nullptr)
      fn(args);
    else
      set->gemm(args);
    benchmark::DoNotOptimize(c.data());
  }
  const double seconds = seconds_since(t0);
  const double macs = static_cast<double>(state.iterations()) * static_cast<double>(m * N * K);
  state.counters["mac_per_s"] = benchmark::Counter(macs, benchmark::Counter::kIsRate);
  state.counters["of_mac_peak"] = fraction_of(macs, seconds, limits().peak[set->name].first);
}

const int kRegistered = [] {
  for (const detail::KernelSet& set : detail::kernel_table()) {
    if (set.model_only) continue;  // a software model: its speed means nothing
    const std::vector<int64_t> rows =
        benchmark::CreateDenseRange(1, static_cast<int>(set.tile_m), 1);
    benchmark::RegisterBenchmark((std::string("BM_Gemm/") + set.name).c_str(), BM_Gemm, &set,
                                 nullptr)
        ->ArgsProduct({rows, {32, 64, 128, 256, -1}, {0}})
        ->ArgsProduct({rows, {32, 128, -1}, {1}})
        ->ArgsProduct({rows, {32}, {2}})
        ->ArgNames({"m", "g", "format"});
  }
#if defined(__x86_64__)
  // the amx set's tile GEMM alone, whatever the set's choice by rows
  for (const detail::KernelSet& set : detail::kernel_table())
    if (std::string_view(set.name) == "amx")
      benchmark::RegisterBenchmark("BM_Gemm/amx-tiles", BM_Gemm, &set, detail::amx::gemm_tiles)
          ->ArgsProduct({benchmark::CreateDenseRange(1, static_cast<int>(set.tile_m), 1),
                         {32, 64, 128, 256, -1},
                         {0}})
          ->ArgNames({"m", "g", "format"});
#endif
  return 0;
}();

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const int threads = static_cast<int>(std::thread::hardware_concurrency());
  Limits& l = limits();
  l.bandwidth = cli::measure_read_bandwidth(threads);
  std::printf("read bandwidth probe (%d threads): %.1f GB/s\n", threads, l.bandwidth / 1e9);
  for (const detail::KernelSet& set : detail::kernel_table()) {
    const double one = cli::measure_peak_macs(set.name, 1);
    if (one <= 0) continue;
    const double all = cli::measure_peak_macs(set.name, threads);
    l.peak[set.name] = {one, all};
    std::printf("int8 MAC peak probe %s: %.1f GMAC/s (1 thread), %.1f GMAC/s (%d threads)\n",
                set.name, one / 1e9, all / 1e9, threads);
  }
  std::printf("of_bandwidth, of_mac_peak: fractions of these limits (BM_Gemm: 1 thread)\n");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
