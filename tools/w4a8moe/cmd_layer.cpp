// w4a8moe layer (issue 7): one MoE layer of a real checkpoint (a GGUF file or a compressed-tensors
// folder): load and pack it (streaming), route hidden states with the model's own router, run
// forward(), write `out`, and optionally compare with the float reference.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "io/safetensors.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/progress.hpp"
#include "w4a8moe/routing.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

namespace {

// Above this relative RMS error against the float reference the result is wrong, not merely
// quantized (int8 activations cost a few 1e-3).
constexpr double kCompareBound = 5e-2;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double peak_rss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // Linux: KiB
}

std::string routing_text(const RoutingConfig& r, bool has_bias, bool has_selection_bias) {
  std::string s = gating_name(r.gating);
  if (r.renormalize) s += ", renormalised";
  if (r.groups > 1)
    s += std::string(", ") + std::to_string(r.groups_used) + " of " + std::to_string(r.groups) +
         " groups (" + (r.group_score == GroupScore::top2_sum ? "top-2 sum" : "max") + ")";
  if (r.scaling != 1.0f) {
    char buf[64];
    std::snprintf(buf, sizeof buf, ", scaled by %g", static_cast<double>(r.scaling));
    s += buf;
  }
  if (has_bias) s += ", router bias";
  if (has_selection_bias) s += ", selection bias";
  return s;
}

}  // namespace

int layer_command(const LayerOptions& options) {
  try {
    if (options.threads < 0)
      throw Error("--threads: expected 0 (all hardware threads) or more, got " +
                  std::to_string(options.threads));
    if (options.repeat < 1)
      throw Error("--repeat: expected at least 1, got " + std::to_string(options.repeat));
    if (options.input.empty() && options.tokens < 1)
      throw Error("--tokens: expected at least 1, got " + std::to_string(options.tokens));
    io::LoadOptions load;
    load.group_size = options.group;
    load.require_exact = options.exact;

    // Load and pack.
    const auto load_start = std::chrono::steady_clock::now();
    const std::unique_ptr<io::LayerSource> source =
        io::open_layer(options.model, options.layer, load);
    const io::LayerInfo& info = source->info();
    const io::Router router = source->router();
    io::PackedLayer packed;
    {
      Progress progress("w4a8moe layer: packing " + std::to_string(info.experts) + " experts");
      packed = io::pack_layer(*source, options.threads, [&](double f) { progress.update(f); });
    }
    const double load_seconds = seconds_since(load_start);
    const int64_t H = info.hidden, E = info.experts, K = info.top_k;

    std::printf("model: %s (%s), layer %d: H %lld, I %lld, E %lld, top-k %lld, %s\n",
                options.model.c_str(), info.format.c_str(), info.layer, static_cast<long long>(H),
                static_cast<long long>(info.inter), static_cast<long long>(E),
                static_cast<long long>(K), activation_name(info.params.activation));
    std::printf(
        "architecture: %s; routing: %s%s\n", info.model.c_str(),
        routing_text(info.routing, !router.bias.empty(), !router.selection_bias.empty()).c_str(),
        info.params.apply_router_weight_on_input ? "; router weight on the input" : "");
    for (const io::Conversion& c : source->conversions()) {
      if (c.exact) {
        std::printf("weights: %s: %s -> int4 exactly\n", c.tensor.c_str(), c.source.c_str());
      } else {
        std::printf(
            "weights: %s: %s -> int4 g%d (converted): relative RMS error %.3e, max abs error "
            "%.3e of the weights\n",
            c.tensor.c_str(), c.source.c_str(), info.group_size, c.relative_rms(), c.max_abs_err);
      }
    }
    for (const std::string& note : info.notes) std::printf("note: %s\n", note.c_str());
    const double packed_mib =
        static_cast<double>(packed.w13.size() + packed.w2.size()) / (1024.0 * 1024.0);
    std::printf("load: %.3f s (packed %.1f MiB for kernel set %s; peak resident memory %.1f MiB)\n",
                load_seconds, packed_mib, active_kernel_set().c_str(), peak_rss_mib());

    // Hidden states.
    io::SafetensorsFile input_file;
    TensorView x;
    std::vector<float> x_random;
    if (!options.input.empty()) {
      input_file = io::SafetensorsFile::read(options.input);
      if (!input_file.contains("x"))
        throw Error("input file '" + options.input + "': tensor 'x' [T, H] is missing");
      const io::TensorEntry& e = input_file.entry("x");
      if (!detail::is_float_dtype(e.dtype) || e.shape.size() != 2 || e.shape[1] != H ||
          e.shape[0] < 1)
        throw Error(
            "input file '" + options.input + "': tensor 'x' must be F32, BF16 or F16 [T, " +
            std::to_string(H) + "] with T >= 1, got " + io::safetensors_dtype_name(e.dtype) +
            " of rank " + std::to_string(e.shape.size()) +
            (e.shape.size() == 2
                 ? " [" + std::to_string(e.shape[0]) + ", " + std::to_string(e.shape[1]) + "]"
                 : std::string()));
      x = input_file.view("x");
    } else {
      std::mt19937_64 rng(options.seed);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      x_random.resize(static_cast<size_t>(options.tokens) * static_cast<size_t>(H));
      for (float& v : x_random) v = normal(rng);
      x = TensorView::of(x_random.data(), DType::f32, {options.tokens, H});
    }
    const int64_t T = x.shape[0];

    // Route.
    std::vector<float> logits(static_cast<size_t>(T * E));
    std::vector<int32_t> ids(static_cast<size_t>(T * K));
    std::vector<float> weights(static_cast<size_t>(T * K));
    const auto route_start = std::chrono::steady_clock::now();
    router_logits(
        x, TensorView::of(router.weight.data(), DType::f32, {E, H}),
        router.bias.empty() ? TensorView{} : TensorView::of(router.bias.data(), DType::f32, {E}),
        MutableTensorView::of(logits.data(), DType::f32, {T, E}));
    route(TensorView::of(logits.data(), DType::f32, {T, E}),
          router.selection_bias.empty()
              ? TensorView{}
              : TensorView::of(router.selection_bias.data(), DType::f32, {E}),
          info.routing, MutableTensorView::of(ids.data(), DType::i32, {T, K}),
          MutableTensorView::of(weights.data(), DType::f32, {T, K}));
    const double route_seconds = seconds_since(route_start);

    // Run.
    Context context(options.threads);
    const size_t out_bytes = static_cast<size_t>(T * H) * dtype_bytes(x.dtype);
    std::vector<uint64_t> out_storage(out_bytes / sizeof(uint64_t) + 1);
    const MutableTensorView out = MutableTensorView::of(out_storage.data(), x.dtype, {T, H});
    const TensorView ids_view = TensorView::of(ids.data(), DType::i32, {T, K});
    const TensorView weights_view = TensorView::of(weights.data(), DType::f32, {T, K});
    forward(context, x, ids_view, weights_view, packed.w13.bytes(), packed.w2.bytes(), info.params,
            out);  // warm-up
    std::vector<double> times;
    for (int r = 0; r < options.repeat; ++r) {
      const auto start = std::chrono::steady_clock::now();
      forward(context, x, ids_view, weights_view, packed.w13.bytes(), packed.w2.bytes(),
              info.params, out);
      times.push_back(seconds_since(start));
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    std::printf(
        "forward: %lld tokens, %d threads: %.3f ms per forward (median of %d), %.1f tokens/s; "
        "routing %.3f ms\n",
        static_cast<long long>(T), context.threads(), median * 1e3, options.repeat,
        static_cast<double>(T) / median, route_seconds * 1e3);

    if (!options.output.empty()) {
      io::SafetensorsWriter writer;
      writer.add("out", x.dtype, {T, H}, out_storage.data(), out_bytes);
      writer.add("topk_ids", DType::i32, {T, K}, ids);
      writer.add("topk_weights", DType::f32, {T, K}, weights);
      writer.set_metadata("model", options.model);
      writer.set_metadata("layer", std::to_string(info.layer));
      writer.set_metadata("kernel_set", active_kernel_set());
      writer.set_metadata("threads", std::to_string(context.threads()));
      writer.write(options.output);
      std::printf("wrote out [%lld, %lld] %s, topk_ids and topk_weights to %s\n",
                  static_cast<long long>(T), static_cast<long long>(H), dtype_name(x.dtype),
                  options.output.c_str());
    }

    if (options.compare) {
      std::vector<float> xf(static_cast<size_t>(T * H));
      for (int64_t i = 0; i < T * H; ++i)
        xf[static_cast<size_t>(i)] =
            detail::load_float(x.data, x.dtype, (i / H) * x.stride() + i % H);
      std::vector<double> ref;
      {
        Progress progress("w4a8moe layer: float reference");
        ref = io::float_reference(*source, xf, ids, weights, options.threads);
      }
      double err_sq = 0, ref_sq = 0, max_err = 0, max_ref = 0;
      for (int64_t i = 0; i < T * H; ++i) {
        const double got = detail::load_float(out.data, out.dtype, i);
        const double want = ref[static_cast<size_t>(i)];
        const double err = got - want;
        err_sq += err * err;
        ref_sq += want * want;
        max_err = std::max(max_err, std::fabs(err));
        max_ref = std::max(max_ref, std::fabs(want));
      }
      const double rel_rms = ref_sq > 0 ? std::sqrt(err_sq / ref_sq) : std::sqrt(err_sq);
      std::printf(
          "compare: relative RMS error %.3e, max abs error %.3e (largest |ref| %.3e) against the "
          "float reference (the int4 weights dequantized, activations not quantized)\n",
          rel_rms, max_err, max_ref);
      if (!(rel_rms <= kCompareBound)) {
        std::fprintf(stderr,
                     "w4a8moe layer: the relative RMS error %.3e against the float reference "
                     "exceeds %.0e: the result is wrong\n",
                     rel_rms, kCompareBound);
        return 1;
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "w4a8moe layer: %s\n", e.what());
    return 1;
  }
}

}  // namespace w4a8moe::cli
