// w4a8moe bench: a real model's MoE layer with synthetic weights; correctness check first, then
// the median time of the forward pass against the read bandwidth measured in the same process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/forward_parts.hpp"
#include "w4a8moe/parallel.hpp"
#include "w4a8moe/probe.hpp"
#include "w4a8moe/progress.hpp"
#include "w4a8moe/synthetic.hpp"

namespace w4a8moe::cli {

namespace {

constexpr double kCheckBound = 2e-3;  // max |out - ref| / max |ref| over the checked tokens

DType parse_float_dtype(const std::string& s, const char* option) {
  if (s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  if (s == "f16") return DType::f16;
  throw Error(std::string(option) + ": expected f32, bf16 or f16, got '" + s + "'");
}

std::vector<uint16_t> to_half(const std::vector<float>& x, DType dtype) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    out[i] = dtype == DType::bf16 ? detail::f32_to_bf16(x[i]) : detail::f32_to_f16(x[i]);
  return out;
}

// The activations as the dtype asked for, and back to f32 (what the operator actually sees).
struct Input {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f32.data()) : half.data();
  }
};

struct CheckResult {
  int tokens_checked = 0;
  double max_rel_err = 0.0;
  double max_abs_ref = 0.0;
};

// Reference on a spread sample of tokens (the reference is slow: plain code in double).
CheckResult check_against_reference(const SyntheticLayer& layer, const Input& x,
                                    const Routing& routing, const std::vector<float>& out_f32,
                                    int64_t tokens, const MoeParams& params) {
  const int64_t H = layer.preset.hidden, K = layer.preset.top_k;
  const int64_t sample = std::min<int64_t>(tokens, 4);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < sample; ++i)
    rows.push_back(sample == 1 ? 0 : i * (tokens - 1) / (sample - 1));
  std::vector<float> xs(static_cast<size_t>(sample * H)), ws(static_cast<size_t>(sample * K));
  std::vector<int32_t> ids(static_cast<size_t>(sample * K));
  for (int64_t i = 0; i < sample; ++i) {
    const int64_t t = rows[static_cast<size_t>(i)];
    for (int64_t h = 0; h < H; ++h)
      xs[static_cast<size_t>(i * H + h)] = detail::load_float(x.data(), x.dtype, t * H + h);
    for (int64_t k = 0; k < K; ++k) {
      ids[static_cast<size_t>(i * K + k)] = routing.ids[static_cast<size_t>(t * K + k)];
      ws[static_cast<size_t>(i * K + k)] = routing.weights[static_cast<size_t>(t * K + k)];
    }
  }
  std::vector<float> ref(static_cast<size_t>(sample * H));
  reference_forward(TensorView::of(xs.data(), DType::f32, {sample, H}),
                    TensorView::of(ids.data(), DType::i32, {sample, K}),
                    TensorView::of(ws.data(), DType::f32, {sample, K}), layer.view(), params,
                    MutableTensorView::of(ref.data(), DType::f32, {sample, H}));
  CheckResult r;
  r.tokens_checked = static_cast<int>(sample);
  for (int64_t i = 0; i < sample; ++i) {
    const int64_t t = rows[static_cast<size_t>(i)];
    double max_ref = 0.0, max_err = 0.0;
    for (int64_t h = 0; h < H; ++h) {
      // Round the reference as the output dtype would, then compare.
      float rv = ref[static_cast<size_t>(i * H + h)];
      if (x.dtype != DType::f32) {
        const std::vector<uint16_t> one = to_half({rv}, x.dtype);
        rv = detail::load_float(one.data(), x.dtype, 0);
      }
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(rv)));
      max_err =
          std::max(max_err, std::fabs(static_cast<double>(out_f32[static_cast<size_t>(t * H + h)]) -
                                      static_cast<double>(rv)));
    }
    r.max_abs_ref = std::max(r.max_abs_ref, max_ref);
    r.max_rel_err = std::max(r.max_rel_err, max_ref > 0 ? max_err / max_ref : max_err);
  }
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---- the options, and the layer they describe ----

// The layer bench times and how: the shapes and settings of a preset (synthetic weights, packed
// here) or of a packed file (its experts, at its shapes).
struct BenchLayer {
  bool from_file = false;  // --packed
  Preset preset{};
  int group = 0;
  WeightFormat format = WeightFormat::int4_symmetric;
  DType x_dtype = DType::f32, scale_dtype = DType::f32;  // stored scales (mxfp4: bf16)
  MoeParams params;
  bool check = false;        // against the reference: not with --packed (no unpacked weights)
  SyntheticLayer synthetic;  // without --packed: the logical weights
  PackedExperts experts;
  double pack_s = 0.0;      // with --packed: the time to open and verify the file
  size_t expert_bytes = 0;  // one expert's packed w13 and w2
};

// --packed W.w4a8 times the file's experts, at its shapes, with the top-k and the activation it
// recorded (top-k 8 or E, silu when it recorded none).
Preset preset_of_file(const PackedFileInfo& f, const char* name) {
  return Preset{name,
                f.hidden,
                f.inter,
                f.experts,
                f.meta.top_k > 0 ? f.meta.top_k : std::min<int64_t>(8, f.experts),
                f.meta.has_params ? f.meta.params.activation : Activation::silu,
                false,
                f.meta.has_params && f.meta.params.apply_router_weight_on_input};
}

void check_counts(const BenchOptions& o) {
  if (o.tokens < 1)
    throw Error("--tokens: expected a positive count, got " + std::to_string(o.tokens));
  if (o.repeat < 1)
    throw Error("--repeat: expected a positive count, got " + std::to_string(o.repeat));
  if (o.execution.threads < 0)
    throw Error("--threads: expected 0 (all) or a positive count, got " +
                std::to_string(o.execution.threads));
  if (o.routing != "uniform" && o.routing != "skewed")
    throw Error("--routing: expected uniform or skewed, got '" + o.routing + "'");
}

// Generates the preset's synthetic weights and packs them (under --expert-parallel: this
// process's share of the experts).
void generate_and_pack(const BenchOptions& o, BenchLayer& b, const Parallel& parallel) {
  b.synthetic = [&] {
    Progress p("generating weights");
    return make_layer(b.preset, b.group, b.scale_dtype, o.seed, &Progress::callback, &p, b.format,
                      o.act_order);
  }();
  const LogicalWeights lw = b.synthetic.view();
  PackOptions po;
  po.group_size = b.group;
  po.weight_format = b.format;
  po.gate_up_layout = lw.gate_up_layout;
  po.experts = parallel.local_experts(b.preset.experts);
  Progress p("packing");
  b.experts = PackedExperts::pack(lw, po);
}

// Opens --packed (timed), checks the options, then generates and packs the synthetic weights
// (timed together) when there is no file.
BenchLayer prepare_layer(const BenchOptions& o, const Parallel& parallel) {
  BenchLayer b;
  b.from_file = !o.packed.empty();
  if (b.from_file && parallel.on())
    throw Error(
        "--packed: expected no packed file with --expert-parallel (each process packs "
        "its share of the preset's experts), got '" +
        o.packed + "'");
  if (b.from_file) {
    const auto load_start = std::chrono::steady_clock::now();
    b.experts = PackedExperts::open(o.packed, o.skip_checksum);
    b.pack_s = seconds_since(load_start);
    b.preset = preset_of_file(b.experts.file.info(), o.packed.c_str());
  } else {
    b.preset = find_preset(o.preset);
  }
  const PackedFileInfo& f = b.experts.file.info();
  b.group = b.from_file ? f.group_size : o.group;
  check_counts(o);
  b.x_dtype = parse_float_dtype(o.dtype, "--dtype");
  b.scale_dtype = b.from_file ? f.w13.scale_dtype : parse_float_dtype(o.scales, "--scales");
  if (o.weights == "mxfp4") {
    b.format = WeightFormat::mxfp4;
    b.scale_dtype = DType::bf16;  // 2^(e - 128), as the packer stores it
  } else if (o.weights == "int4_zp") {
    b.format = WeightFormat::int4_zero_point;
  } else if (o.weights != "int4") {
    throw Error("--weights: expected int4, int4_zp or mxfp4, got '" + o.weights + "'");
  }
  b.check = o.check && !b.from_file;
  b.params.activation = b.preset.activation;
  b.params.apply_router_weight_on_input = b.preset.router_on_input;
  if (b.from_file && f.meta.has_params) b.params = f.meta.params;
  if (!b.from_file) {
    const auto pack_start = std::chrono::steady_clock::now();
    generate_and_pack(o, b, parallel);
    b.pack_s = seconds_since(pack_start);
  }
  b.expert_bytes =
      inspect_packed(b.experts.w13).expert_bytes + inspect_packed(b.experts.w2).expert_bytes;
  return b;
}

void print_header(const BenchOptions& o, const BenchLayer& b, const Context& ctx,
                  const std::string& kernel_set) {
  const Preset& p = b.preset;
  std::printf(
      "w4a8moe bench: %s (H %lld, I %lld, E %lld, top-k %lld, %s%s), %s weights%s, group %d, %s "
      "scales, x %s, %lld tokens, %s routing, %d threads, kernel set %s\n",
      p.name, static_cast<long long>(p.hidden), static_cast<long long>(p.inter),
      static_cast<long long>(p.experts), static_cast<long long>(p.top_k),
      activation_name(p.activation), p.router_on_input ? ", router weight on input" : "",
      weight_format_name(b.format), o.act_order ? " (act-order)" : "", b.group,
      dtype_name(b.scale_dtype), dtype_name(b.x_dtype), static_cast<long long>(o.tokens),
      o.routing.c_str(), ctx.threads(), kernel_set.c_str());
  std::printf("%s %.1f MB in %.2f s%s\n", b.from_file ? "loaded" : "packed",
              static_cast<double>(b.experts.w13.size() + b.experts.w2.size()) / 1e6, b.pack_s,
              b.from_file && !o.skip_checksum ? " (checksum verified)" : "");
  if (b.from_file && o.check)
    std::printf("check: skipped (--packed: no unpacked weights to compare with)\n");
}

// ---- the runs ----

// One forward call of the layer on x, routed by a Routing, into the output.
using RunForward = std::function<void(const Routing&)>;

// The check run: the output of routings[0] against the reference.
CheckResult run_check(const BenchLayer& b, const Input& x, const Routing& routing,
                      const OutputTensor& out, int64_t T, const RunForward& run) {
  Progress p("checking against the reference");
  run(routing);
  std::vector<float> out_f32(static_cast<size_t>(T * b.preset.hidden));
  for (size_t i = 0; i < out_f32.size(); ++i)
    out_f32[i] = detail::load_float(out.view.data, out.view.dtype, static_cast<int64_t>(i));
  return check_against_reference(b.synthetic, x, routing, out_f32, T, b.params);
}

void print_check(const CheckResult& check, int64_t T, double bound = kCheckBound) {
  std::printf(
      "check: %d of %lld tokens against the reference: max rel err %.2e (%s, bound "
      "%.0e), max |out| %.2f\n",
      check.tokens_checked, static_cast<long long>(T), check.max_rel_err,
      check.max_rel_err <= bound ? "ok" : "FAILED", bound, check.max_abs_ref);
}

// Per timed run: its time, the weight bytes of the distinct experts it touched, and the probes
// of the machine's limits taken just before it.
struct Timings {
  std::vector<double> times_s, bytes, bandwidths, peaks, peaks_1, cold_reads_s;
};

// A warm-up, then the timed runs on routings[1..repeat]. The machine's limits are probed between
// the timed runs, so that the limit and the product are measured in the same moments even when
// the machine's load drifts (it is shared).
Timings time_runs(const BenchLayer& b, const std::vector<Routing>& routings, int repeat,
                  int threads, const std::string& kernel_set, const RunForward& run) {
  Timings t;
  Progress p("timing");
  run(routings[1]);  // warm-up: threads, scratch
  for (int r = 0; r < repeat; ++r) {
    const Routing& rt = routings[static_cast<size_t>(r + 1)];
    t.bandwidths.push_back(measure_read_bandwidth(threads, 1));
    t.peaks.push_back(measure_peak_macs(kernel_set, threads, 1));
    if (threads > 1) t.peaks_1.push_back(measure_peak_macs(kernel_set, 1, 1));
    const std::set<int32_t> distinct(rt.ids.begin(), rt.ids.end());
    t.bytes.push_back(static_cast<double>(distinct.size() * b.expert_bytes));
    t.cold_reads_s.push_back(measure_cold_read(distinct.size() * b.expert_bytes, threads));
    flush_from_caches(b.experts.w13.data(), b.experts.w13.size());  // cold weights, as in decode
    flush_from_caches(b.experts.w2.data(), b.experts.w2.size());
    const auto t0 = std::chrono::steady_clock::now();
    run(rt);
    t.times_s.push_back(seconds_since(t0));
    p.update(static_cast<double>(r + 1) / repeat);
  }
  return t;
}

// ---- the figures and the report ----

struct Figures {
  double bandwidth, peak_macs, peak_1, scaling;
  bool degraded;
  double med_s, min_s, med_bytes, macs, gbps;
  double memory_s, compute_s, roofline_s;
  double cold_read_s;  // the same bytes read cold with no computation (measure_cold_read)
};

Figures figures_of(const Timings& t, const Preset& p, int64_t T, int threads) {
  Figures f;
  f.bandwidth = median(t.bandwidths);
  f.peak_macs = median(t.peaks);
  // The all-thread MAC probe over the one-thread probe: about the thread count on a machine that
  // gives this process its cores. docs/performance.md, "The machine, and the degraded rule": below
  // 0.75 per thread (1.5x for two), the host is taking cores away right now, and ratios against the
  // MAC peak overstate (the forward and the probe do not lose the same share of a core).
  f.peak_1 = t.peaks_1.empty() ? f.peak_macs : median(t.peaks_1);
  f.scaling = f.peak_1 > 0 ? f.peak_macs / f.peak_1 : 0.0;
  f.degraded = threads > 1 && f.peak_macs > 0 && f.scaling < 0.75 * threads;
  f.med_s = median(t.times_s);
  f.min_s = *std::min_element(t.times_s.begin(), t.times_s.end());
  f.med_bytes = median(t.bytes);
  f.macs = static_cast<double>(T * p.top_k) * 3.0 * static_cast<double>(p.hidden * p.inter);
  f.gbps = f.med_bytes / f.med_s;  // weight bytes of the distinct experts touched
  // The roofline: the larger of reading the touched experts' weights once at the probed
  // bandwidth and doing the MACs at the probed peak of the set in use (bandwidth alone when the
  // set has no MAC probe).
  f.memory_s = f.med_bytes / f.bandwidth;
  f.compute_s = f.peak_macs > 0 ? f.macs / f.peak_macs : 0.0;
  f.roofline_s = std::max(f.memory_s, f.compute_s);
  f.cold_read_s = median(t.cold_reads_s);
  return f;
}

void print_json(const BenchOptions& o, const BenchLayer& b, const Figures& f,
                const CheckResult& check, int threads, const std::string& kernel_set) {
  const int64_t T = o.tokens;
  nlohmann::json j;
  j["preset"] = b.preset.name;
  j["tokens"] = T;
  j["threads"] = threads;
  j["group"] = b.group;
  j["dtype"] = dtype_name(b.x_dtype);
  j["scales"] = dtype_name(b.scale_dtype);
  j["weights"] = weight_format_name(b.format);
  j["act_order"] = o.act_order;
  j["routing"] = o.routing;
  j["kernel_set"] = kernel_set;
  j["repeat"] = o.repeat;
  j["median_ms"] = f.med_s * 1e3;
  j["min_ms"] = f.min_s * 1e3;
  j["tokens_per_s"] = static_cast<double>(T) / f.med_s;
  j["weight_bytes"] = f.med_bytes;
  j["weight_gb_per_s"] = f.gbps / 1e9;
  j["read_bandwidth_gb_per_s"] = f.bandwidth / 1e9;
  j["bandwidth_fraction"] = f.gbps / f.bandwidth;
  j["macs"] = f.macs;
  j["gmac_per_s"] = f.macs / f.med_s / 1e9;
  j["peak_gmac_per_s"] = f.peak_macs / 1e9;
  j["mac_fraction"] = f.peak_macs > 0 ? f.macs / f.med_s / f.peak_macs : 0.0;
  j["peak_gmac_per_s_1thread"] = f.peak_1 / 1e9;
  j["mac_probe_scaling"] = f.scaling;
  j["roofline_ms"] = f.roofline_s * 1e3;
  j["roofline_memory_ms"] = f.memory_s * 1e3;
  j["roofline_compute_ms"] = f.compute_s * 1e3;
  j["roofline_fraction"] = f.roofline_s / f.med_s;
  j["cold_read_ms"] = f.cold_read_s * 1e3;
  j["cold_read_fraction"] = f.cold_read_s / f.med_s;
  j["machine_degraded"] = f.degraded;
  j["pack_s"] = b.pack_s;  // with --packed: the time to open and verify the file
  if (b.from_file) j["packed_file"] = o.packed;
  if (b.check) {
    j["check_max_rel_err"] = check.max_rel_err;
    j["check_tokens"] = check.tokens_checked;
  } else {
    j["check_max_rel_err"] = nullptr;
  }
  std::printf("%s\n", j.dump().c_str());
}

void print_text(const BenchOptions& o, const Figures& f, int threads,
                const std::string& kernel_set) {
  std::printf("read bandwidth probe: %.1f GB/s (median of %d, %d threads, between the runs)\n",
              f.bandwidth / 1e9, o.repeat, threads);
  if (f.peak_macs > 0)
    std::printf(
        "int8 MAC peak probe (%s): %.1f GMAC/s (median of %d, %d threads; 1 thread %.1f, "
        "scaling %.2fx)\n",
        kernel_set.c_str(), f.peak_macs / 1e9, o.repeat, threads, f.peak_1 / 1e9, f.scaling);
  if (f.degraded)
    std::printf(
        "warning: %d threads probed only %.2fx one thread: the host is not giving this process "
        "%d cores now, so the MAC-peak ratio overstates; measure again later\n",
        threads, f.scaling, threads);
  std::printf("forward: median %.3f ms (min %.3f ms, %d runs), %.1f tokens/s\n", f.med_s * 1e3,
              f.min_s * 1e3, o.repeat, static_cast<double>(o.tokens) / f.med_s);
  std::printf("  weights touched %.1f MB -> %.2f GB/s = %.1f%% of the read bandwidth\n",
              f.med_bytes / 1e6, f.gbps / 1e9, 100.0 * f.gbps / f.bandwidth);
  std::printf("  int8 MACs %.1f M -> %.2f GMAC/s", f.macs / 1e6, f.macs / f.med_s / 1e9);
  if (f.peak_macs > 0)
    std::printf(" = %.1f%% of the int8 MAC peak", 100.0 * f.macs / f.med_s / f.peak_macs);
  std::printf("\n");
  std::printf(
      "  roofline max(weights / bandwidth %.3f ms, MACs / peak %.3f ms) = %.3f ms: the "
      "forward at %.1f%% of it\n",
      f.memory_s * 1e3, f.compute_s * 1e3, f.roofline_s * 1e3, 100.0 * f.roofline_s / f.med_s);
  std::printf(
      "  the same bytes read cold with nothing else to do (%d threads already running): median "
      "%.3f ms = %.2f GB/s: the forward at %.1f%% of it\n",
      threads, f.cold_read_s * 1e3, f.med_bytes / f.cold_read_s / 1e9,
      100.0 * f.cold_read_s / f.med_s);
}

// ---- --expert-parallel: the layer over the processes of an mpirun ----

// Per timed run, over the processes: the slowest process's time, and this process's
// communication time and bytes.
struct ParallelTimings {
  std::vector<double> times_s, comm_s, sent, received;
};

ParallelTimings time_parallel_runs(const BenchLayer& b, const std::vector<Routing>& routings,
                                   int repeat, Parallel& parallel, const RunForward& run) {
  ParallelTimings t;
  run(routings[1]);  // warm-up: threads, scratch, the communicator's buffers
  for (int r = 0; r < repeat; ++r) {
    flush_from_caches(b.experts.w13.data(), b.experts.w13.size());  // cold weights
    flush_from_caches(b.experts.w2.data(), b.experts.w2.size());
    parallel.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    run(routings[static_cast<size_t>(r + 1)]);
    t.times_s.push_back(parallel.max_over_processes(seconds_since(t0)));
    t.comm_s.push_back(parallel.max_over_processes(parallel.comm_seconds()));
    t.sent.push_back(parallel.max_over_processes(static_cast<double>(parallel.bytes_sent())));
    t.received.push_back(
        parallel.max_over_processes(static_cast<double>(parallel.bytes_received())));
  }
  return t;
}

// The check of an expert-parallel run on process 0: its output (all processes' rows) against
// the reference, and against forward() on one process with all the experts.
struct ParallelCheck {
  CheckResult reference;
  double one_process_rel_err = 0.0;
};
constexpr double kOneProcessBound = 1e-5;  // f32 summation order (bf16 results: 1e-2)

ParallelCheck check_parallel(const BenchLayer& b, const BenchOptions& o, const Input& x,
                             const Routing& routing, const OutputTensor& mine, Parallel& parallel,
                             Context& ctx, const RunForward& run) {
  run(routing);
  const std::vector<uint8_t> all =
      parallel.gather_rows({reinterpret_cast<const uint8_t*>(mine.storage.data()), mine.bytes});
  ParallelCheck c;
  if (parallel.rank() != 0) return c;
  const int64_t T = o.tokens, H = b.preset.hidden, K = b.preset.top_k;
  std::vector<float> got(static_cast<size_t>(T * H));
  for (size_t i = 0; i < got.size(); ++i)
    got[i] = detail::load_float(all.data(), b.x_dtype, static_cast<int64_t>(i));
  c.reference = check_against_reference(b.synthetic, x, routing, got, T, b.params);
  // one process, all experts
  const LogicalWeights lw = b.synthetic.view();
  PackOptions po;
  po.group_size = b.group;
  po.weight_format = b.format;
  po.gate_up_layout = lw.gate_up_layout;
  const PackedExperts full = PackedExperts::pack(lw, po);
  OutputTensor one(b.x_dtype, T, H);
  forward(ctx, TensorView::of(x.data(), b.x_dtype, {T, H}),
          TensorView::of(routing.ids.data(), DType::i32, {T, K}),
          TensorView::of(routing.weights.data(), DType::f32, {T, K}), full.w13, full.w2, b.params,
          one.view);
  double top = 0, err = 0;
  for (int64_t i = 0; i < T * H; ++i) {
    const double want = detail::load_float(one.view.data, b.x_dtype, i);
    top = std::max(top, std::abs(want));
    err = std::max(err, std::abs(static_cast<double>(got[static_cast<size_t>(i)]) - want));
  }
  c.one_process_rel_err = top > 0 ? err / top : 0.0;
  return c;
}

// bf16 results round each returned row once more (2^-9 relative) before the sum.
double reference_bound(const Parallel& parallel) {
  return parallel.results() == "bf16" ? 1e-2 : kCheckBound;
}

double one_process_bound(const Parallel& parallel, const BenchLayer& b) {
  if (parallel.results() == "bf16") return 1e-2;
  return b.x_dtype == DType::f32 ? kOneProcessBound : 1e-2;
}

int bench_parallel(const BenchOptions& o, const BenchLayer& b, Parallel& parallel) {
  const int64_t T = o.tokens, H = b.preset.hidden, E = b.preset.experts, K = b.preset.top_k;
  Input x{b.x_dtype, make_activations(T, H, o.seed), {}};
  if (b.x_dtype != DType::f32) x.half = to_half(x.f32, b.x_dtype);
  const TensorView xv = TensorView::of(x.data(), b.x_dtype, {T, H});
  Context ctx(o.execution.threads);
  configure_context(ctx, o.execution);
  const std::string kernel_set = active_kernel_set();
  const bool report = parallel.rank() == 0;
  if (!o.json && report) print_header(o, b, ctx, kernel_set);
  parallel.setup(E, b.experts.w13, b.experts.w2, K, b.params);
  const int64_t n = parallel.token_run(T).second;  // this process's tokens
  OutputTensor mine(b.x_dtype, n, H);
  std::vector<Routing> routings;
  for (int r = 0; r <= o.repeat; ++r)
    routings.push_back(
        make_routing(T, E, K, o.routing == "skewed", o.seed + 1000u * static_cast<unsigned>(r)));
  const RunForward run = [&](const Routing& rt) {
    parallel.forward(ctx, parallel.rows_of(xv),
                     parallel.rows_of(TensorView::of(rt.ids.data(), DType::i32, {T, K})),
                     parallel.rows_of(TensorView::of(rt.weights.data(), DType::f32, {T, K})),
                     mine.view);
  };
  ParallelCheck check;
  if (b.check) {
    check = check_parallel(b, o, x, routings[0], mine, parallel, ctx, run);
    if (!o.json && report) {
      print_check(check.reference, T, reference_bound(parallel));
      std::printf(
          "check: against forward() on one process with every expert: max rel err %.2e "
          "(%s, bound %.0e)\n",
          check.one_process_rel_err,
          check.one_process_rel_err <= one_process_bound(parallel, b) ? "ok" : "FAILED",
          one_process_bound(parallel, b));
    }
  }
  const ParallelTimings t = time_parallel_runs(b, routings, o.repeat, parallel, run);
  const double med = median(t.times_s), comm = median(t.comm_s);
  const double sent = median(t.sent), received = median(t.received);
  if (report && o.json) {
    nlohmann::json j;
    j["preset"] = b.preset.name;
    j["tokens"] = T;
    j["threads"] = ctx.threads();
    j["group"] = b.group;
    j["dtype"] = dtype_name(b.x_dtype);
    j["kernel_set"] = kernel_set;
    j["expert_parallel"] = parallel.way();
    j["processes"] = parallel.ranks();
    j["ep_results"] = parallel.results();
    j["repeat"] = o.repeat;
    j["median_ms"] = med * 1e3;
    j["min_ms"] = *std::min_element(t.times_s.begin(), t.times_s.end()) * 1e3;
    j["comm_ms"] = comm * 1e3;
    j["comm_fraction"] = comm / med;
    j["bytes_sent_per_process"] = sent;
    j["bytes_received_per_process"] = received;
    if (b.check) {
      j["check_max_rel_err"] = check.reference.max_rel_err;
      j["one_process_max_rel_err"] = check.one_process_rel_err;
    }
    std::printf("%s\n", j.dump().c_str());
  } else if (report) {
    std::printf("expert-parallel %s over %d processes (%d threads each, %s results)\n",
                parallel.way().c_str(), parallel.ranks(), ctx.threads(),
                parallel.results().c_str());
    std::printf(
        "forward: median %.3f ms (min %.3f ms, %d runs; the slowest process), %.1f "
        "tokens/s\n",
        med * 1e3, *std::min_element(t.times_s.begin(), t.times_s.end()) * 1e3, o.repeat,
        static_cast<double>(T) / med);
    std::printf(
        "  communication %.3f ms = %.1f%% of the forward; sent %.3f MB, received %.3f MB "
        "per process (most loaded)\n",
        comm * 1e3, 100.0 * comm / med, sent / 1e6, received / 1e6);
  }
  const bool failed = b.check && report &&
                      (!(check.reference.max_rel_err <= reference_bound(parallel)) ||
                       !(check.one_process_rel_err <= one_process_bound(parallel, b)));
  if (parallel.max_over_processes(failed ? 1.0 : 0.0) > 0) {
    if (report) std::fprintf(stderr, "w4a8moe bench: the correctness check failed\n");
    return 1;
  }
  return 0;
}

}  // namespace

int bench_command(const BenchOptions& o) {
  Parallel parallel(o.execution, "f32");
  const BenchLayer b = prepare_layer(o, parallel);
  if (parallel.on()) return bench_parallel(o, b, parallel);
  const int64_t T = o.tokens, H = b.preset.hidden, E = b.preset.experts, K = b.preset.top_k;

  Input x{b.x_dtype, make_activations(T, H, o.seed), {}};
  if (b.x_dtype != DType::f32) x.half = to_half(x.f32, b.x_dtype);
  const TensorView xv = TensorView::of(x.data(), b.x_dtype, {T, H});
  OutputTensor out(b.x_dtype, T, H);

  Context ctx(o.execution.threads);
  configure_context(ctx, o.execution);
  const std::string kernel_set = active_kernel_set();
  if (!o.json) print_header(o, b, ctx, kernel_set);

  // One routing per timed run (plus one for the check), so decode runs do not reuse the same
  // experts from cache.
  std::vector<Routing> routings;
  for (int r = 0; r <= o.repeat; ++r)
    routings.push_back(
        make_routing(T, E, K, o.routing == "skewed", o.seed + 1000u * static_cast<unsigned>(r)));
  const RunForward run = [&](const Routing& rt) {
    forward(ctx, xv, TensorView::of(rt.ids.data(), DType::i32, {T, K}),
            TensorView::of(rt.weights.data(), DType::f32, {T, K}), b.experts.w13, b.experts.w2,
            b.params, out.view);
  };

  CheckResult check;
  if (b.check) {
    check = run_check(b, x, routings[0], out, T, run);
    if (!o.json) print_check(check, T);
  }
  const Timings timings = time_runs(b, routings, o.repeat, ctx.threads(), kernel_set, run);
  const Figures f = figures_of(timings, b.preset, T, ctx.threads());
  if (o.json) {
    print_json(o, b, f, check, ctx.threads(), kernel_set);
  } else {
    print_text(o, f, ctx.threads(), kernel_set);
  }
  if (b.check && !(check.max_rel_err <= kCheckBound)) {
    std::fprintf(stderr, "w4a8moe bench: the correctness check failed: max rel err %.3e > %.0e\n",
                 check.max_rel_err, kCheckBound);
    return 1;
  }
  return 0;
}

}  // namespace w4a8moe::cli
