// w4a8moe bench: a real model's MoE layer with synthetic weights; correctness check first, then
// the median time of the forward pass against the read bandwidth measured in the same process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "w4a8moe/commands.hpp"
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

}  // namespace

int bench_command(const BenchOptions& o) {
  // --packed W.w4a8 times the file's experts, at its shapes, with the top-k and the
  // activation it recorded (top-k 8 or E, silu when it recorded none); there are no unpacked
  // weights to check against.
  PackedFile file;
  Preset packed_preset{};
  double load_s = 0.0;
  if (!o.packed.empty()) {
    PackedFileOptions file_options;
    file_options.verify_checksum = !o.skip_checksum;
    const auto load_start = std::chrono::steady_clock::now();
    file = PackedFile::open(o.packed, file_options);
    load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    const PackedFileInfo& f = file.info();
    packed_preset = Preset{o.packed.c_str(),
                           f.hidden,
                           f.inter,
                           f.experts,
                           f.meta.top_k > 0 ? f.meta.top_k : std::min<int64_t>(8, f.experts),
                           f.meta.has_params ? f.meta.params.activation : Activation::silu,
                           false,
                           f.meta.has_params && f.meta.params.apply_router_weight_on_input};
  }
  const bool from_file = !o.packed.empty();
  const Preset& preset = from_file ? packed_preset : find_preset(o.preset);
  const int group = from_file ? file.info().group_size : o.group;
  if (o.tokens < 1)
    throw Error("--tokens: expected a positive count, got " + std::to_string(o.tokens));
  if (o.repeat < 1)
    throw Error("--repeat: expected a positive count, got " + std::to_string(o.repeat));
  if (o.threads < 0)
    throw Error("--threads: expected 0 (all) or a positive count, got " +
                std::to_string(o.threads));
  if (o.routing != "uniform" && o.routing != "skewed")
    throw Error("--routing: expected uniform or skewed, got '" + o.routing + "'");
  const DType x_dtype = parse_float_dtype(o.dtype, "--dtype");
  const DType scale_dtype =
      from_file ? file.info().w13.scale_dtype : parse_float_dtype(o.scales, "--scales");
  const bool quiet = o.json;
  const bool do_check = o.check && !from_file;
  const int64_t T = o.tokens, H = preset.hidden, I = preset.inter, E = preset.experts,
                K = preset.top_k;

  MoeParams params;
  params.activation = preset.activation;
  params.apply_router_weight_on_input = preset.router_on_input;
  if (from_file && file.info().meta.has_params) params = file.info().meta.params;

  SyntheticLayer layer;
  PackedWeights w13_packed, w2_packed;
  std::span<const uint8_t> w13 = file.w13(), w2 = file.w2();
  const auto pack_start = std::chrono::steady_clock::now();
  if (!from_file) {
    layer = [&] {
      Progress p("generating weights");
      return make_layer(preset, group, scale_dtype, o.seed, &Progress::callback, &p);
    }();
    const LogicalWeights lw = layer.view();
    PackOptions po;
    po.group_size = group;
    po.gate_up_layout = lw.gate_up_layout;
    Progress p("packing");
    w13_packed = pack_w13(lw.w13, lw.w13_scale, lw.w13_bias, po);
    w2_packed = pack_w2(lw.w2, lw.w2_scale, lw.w2_bias, po);
    w13 = w13_packed.bytes();
    w2 = w2_packed.bytes();
  }
  const double pack_s =
      from_file
          ? load_s
          : std::chrono::duration<double>(std::chrono::steady_clock::now() - pack_start).count();
  const size_t expert_bytes = inspect_packed(w13).expert_bytes + inspect_packed(w2).expert_bytes;

  Input x{x_dtype, make_activations(T, H, o.seed), {}};
  if (x_dtype != DType::f32) x.half = to_half(x.f32, x_dtype);
  const TensorView xv = TensorView::of(x.data(), x_dtype, {T, H});
  std::vector<uint16_t> out_half(x_dtype == DType::f32 ? 0 : static_cast<size_t>(T * H));
  std::vector<float> out_f32(static_cast<size_t>(T * H));
  const MutableTensorView ov = MutableTensorView::of(
      x_dtype == DType::f32 ? static_cast<void*>(out_f32.data()) : out_half.data(), x_dtype,
      {T, H});

  Context ctx(o.threads);
  const std::string kernel_set = active_kernel_set();
  if (!quiet) {
    std::printf(
        "w4a8moe bench: %s (H %lld, I %lld, E %lld, top-k %lld, %s%s), group %d, %s "
        "scales, x %s, %lld tokens, %s routing, %d threads, kernel set %s\n",
        preset.name, static_cast<long long>(H), static_cast<long long>(I),
        static_cast<long long>(E), static_cast<long long>(K), activation_name(preset.activation),
        preset.router_on_input ? ", router weight on input" : "", group, dtype_name(scale_dtype),
        dtype_name(x_dtype), static_cast<long long>(T), o.routing.c_str(), ctx.threads(),
        kernel_set.c_str());
    std::printf("%s %.1f MB in %.2f s%s\n", from_file ? "loaded" : "packed",
                static_cast<double>(w13.size() + w2.size()) / 1e6, pack_s,
                from_file && !o.skip_checksum ? " (checksum verified)" : "");
    if (from_file && o.check)
      std::printf("check: skipped (--packed: no unpacked weights to compare with)\n");
  }

  // One routing per timed run (plus one for the check), so decode runs do not reuse the same
  // experts from cache.
  std::vector<Routing> routings;
  for (int r = 0; r <= o.repeat; ++r)
    routings.push_back(
        make_routing(T, E, K, o.routing == "skewed", o.seed + 1000u * static_cast<unsigned>(r)));
  auto run = [&](const Routing& rt) {
    forward(ctx, xv, TensorView::of(rt.ids.data(), DType::i32, {T, K}),
            TensorView::of(rt.weights.data(), DType::f32, {T, K}), w13, w2, params, ov);
  };

  CheckResult check;
  if (do_check) {
    Progress p("checking against the reference");
    run(routings[0]);
    if (x_dtype != DType::f32)
      for (size_t i = 0; i < out_f32.size(); ++i)
        out_f32[i] = detail::load_float(out_half.data(), x_dtype, static_cast<int64_t>(i));
    check = check_against_reference(layer, x, routings[0], out_f32, T, params);
    p.finish();
    if (!quiet)
      std::printf(
          "check: %d of %lld tokens against the reference: max rel err %.2e (%s, bound "
          "%.0e), max |out| %.2f\n",
          check.tokens_checked, static_cast<long long>(T), check.max_rel_err,
          check.max_rel_err <= kCheckBound ? "ok" : "FAILED", kCheckBound, check.max_abs_ref);
  }

  // The machine's limits are probed between the timed runs, so that the limit and the product
  // are measured in the same moments even when the machine's load drifts (it is shared).
  std::vector<double> times_s, bytes, bandwidths, peaks, peaks_1;
  {
    Progress p("timing");
    run(routings[1]);  // warm-up: threads, scratch
    for (int r = 0; r < o.repeat; ++r) {
      const Routing& rt = routings[static_cast<size_t>(r + 1)];
      bandwidths.push_back(measure_read_bandwidth(ctx.threads(), 1));
      peaks.push_back(measure_peak_macs(kernel_set, ctx.threads(), 1));
      if (ctx.threads() > 1) peaks_1.push_back(measure_peak_macs(kernel_set, 1, 1));
      flush_from_caches(w13.data(), w13.size());  // cold weights, as in real decode
      flush_from_caches(w2.data(), w2.size());
      const auto t0 = std::chrono::steady_clock::now();
      run(rt);
      times_s.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      const std::set<int32_t> distinct(rt.ids.begin(), rt.ids.end());
      bytes.push_back(static_cast<double>(distinct.size() * expert_bytes));
      p.update(static_cast<double>(r + 1) / o.repeat);
    }
  }
  const double bandwidth = median(bandwidths);
  const double peak_macs = median(peaks);
  // The all-thread MAC probe over the one-thread probe: about the thread count on a machine that
  // gives this process its cores. docs/performance.md, "The machine, and the degraded rule": below
  // 0.75 per thread (1.5x for two), the host is taking cores away right now, and ratios against the
  // MAC peak overstate (the forward and the probe do not lose the same share of a core).
  const double peak_1 = peaks_1.empty() ? peak_macs : median(peaks_1);
  const double scaling = peak_1 > 0 ? peak_macs / peak_1 : 0.0;
  const bool degraded = ctx.threads() > 1 && peak_macs > 0 && scaling < 0.75 * ctx.threads();
  if (!quiet) {
    std::printf("read bandwidth probe: %.1f GB/s (median of %d, %d threads, between the runs)\n",
                bandwidth / 1e9, o.repeat, ctx.threads());
    if (peak_macs > 0)
      std::printf(
          "int8 MAC peak probe (%s): %.1f GMAC/s (median of %d, %d threads; 1 thread %.1f, "
          "scaling %.2fx)\n",
          kernel_set.c_str(), peak_macs / 1e9, o.repeat, ctx.threads(), peak_1 / 1e9, scaling);
    if (degraded)
      std::printf(
          "warning: %d threads probed only %.2fx one thread: the host is not giving this process "
          "%d cores now, so the MAC-peak ratio overstates; measure again later\n",
          ctx.threads(), scaling, ctx.threads());
  }
  const double med_s = median(times_s);
  const double min_s = *std::min_element(times_s.begin(), times_s.end());
  const double med_bytes = median(bytes);
  const double macs = static_cast<double>(T * K) * 3.0 * static_cast<double>(H * I);
  const double gbps = med_bytes / med_s;  // weight bytes of the distinct experts touched
  // The roofline: the larger of reading the touched experts' weights once at the probed
  // bandwidth and doing the MACs at the probed peak of the set in use (bandwidth alone when the
  // set has no MAC probe).
  const double memory_s = med_bytes / bandwidth;
  const double compute_s = peak_macs > 0 ? macs / peak_macs : 0.0;
  const double roofline_s = std::max(memory_s, compute_s);

  if (o.json) {
    nlohmann::json j;
    j["preset"] = preset.name;
    j["tokens"] = T;
    j["threads"] = ctx.threads();
    j["group"] = group;
    j["dtype"] = dtype_name(x_dtype);
    j["scales"] = dtype_name(scale_dtype);
    j["routing"] = o.routing;
    j["kernel_set"] = kernel_set;
    j["repeat"] = o.repeat;
    j["median_ms"] = med_s * 1e3;
    j["min_ms"] = min_s * 1e3;
    j["tokens_per_s"] = static_cast<double>(T) / med_s;
    j["weight_bytes"] = med_bytes;
    j["weight_gb_per_s"] = gbps / 1e9;
    j["read_bandwidth_gb_per_s"] = bandwidth / 1e9;
    j["bandwidth_fraction"] = gbps / bandwidth;
    j["macs"] = macs;
    j["gmac_per_s"] = macs / med_s / 1e9;
    j["peak_gmac_per_s"] = peak_macs / 1e9;
    j["mac_fraction"] = peak_macs > 0 ? macs / med_s / peak_macs : 0.0;
    j["peak_gmac_per_s_1thread"] = peak_1 / 1e9;
    j["mac_probe_scaling"] = scaling;
    j["roofline_ms"] = roofline_s * 1e3;
    j["roofline_memory_ms"] = memory_s * 1e3;
    j["roofline_compute_ms"] = compute_s * 1e3;
    j["roofline_fraction"] = roofline_s / med_s;
    j["machine_degraded"] = degraded;
    j["pack_s"] = pack_s;  // with --packed: the time to open and verify the file
    if (from_file) j["packed_file"] = o.packed;
    if (do_check) {
      j["check_max_rel_err"] = check.max_rel_err;
      j["check_tokens"] = check.tokens_checked;
    } else {
      j["check_max_rel_err"] = nullptr;
    }
    std::printf("%s\n", j.dump().c_str());
  } else {
    std::printf("forward: median %.3f ms (min %.3f ms, %d runs), %.1f tokens/s\n", med_s * 1e3,
                min_s * 1e3, o.repeat, static_cast<double>(T) / med_s);
    std::printf("  weights touched %.1f MB -> %.2f GB/s = %.1f%% of the read bandwidth\n",
                med_bytes / 1e6, gbps / 1e9, 100.0 * gbps / bandwidth);
    std::printf("  int8 MACs %.1f M -> %.2f GMAC/s", macs / 1e6, macs / med_s / 1e9);
    if (peak_macs > 0)
      std::printf(" = %.1f%% of the int8 MAC peak", 100.0 * macs / med_s / peak_macs);
    std::printf("\n");
    std::printf(
        "  roofline max(weights / bandwidth %.3f ms, MACs / peak %.3f ms) = %.3f ms: the "
        "forward at %.1f%% of it\n",
        memory_s * 1e3, compute_s * 1e3, roofline_s * 1e3, 100.0 * roofline_s / med_s);
  }
  if (do_check && !(check.max_rel_err <= kCheckBound)) {
    std::fprintf(stderr, "w4a8moe bench: the correctness check failed: max rel err %.3e > %.0e\n",
                 check.max_rel_err, kCheckBound);
    return 1;
  }
  return 0;
}

}  // namespace w4a8moe::cli
