// w4a8moe layer: one MoE layer of a real checkpoint (a GGUF file or a compressed-tensors
// folder): load and pack it (streaming), route hidden states with the model's own router, run
// forward(), write `out`, and optionally compare with the float reference.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "io/safetensors_file.hpp"
#include "io/safetensors_writer.hpp"
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

// Prints how a source's three weight tensors became int4.
void print_conversions(const io::LayerSource& source) {
  for (const io::Conversion& c : source.conversions()) {
    if (c.exact) {
      std::printf("weights: %s: %s -> int4 exactly\n", c.tensor.c_str(), c.source.c_str());
    } else {
      std::printf(
          "weights: %s: %s -> int4 g%d (converted): relative RMS error %.3e, max abs error "
          "%.3e of the weights\n",
          c.tensor.c_str(), c.source.c_str(), source.info().group_size, c.relative_rms(),
          c.max_abs_err);
    }
  }
}

// A layer's routed experts, or its shared expert, loaded and packed.
struct Part {
  std::unique_ptr<io::LayerSource> source;
  io::Router router;
  io::PackedLayer packed;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Part load_part(const LayerOptions& options, io::LoadOptions load, bool shared) {
  load.shared_expert = shared;
  Part p;
  p.source = io::open_layer(options.model, options.layer, load);
  p.router = p.source->router();
  const io::LayerInfo& info = p.source->info();
  Progress progress(shared ? std::string("w4a8moe layer: packing the shared expert")
                           : "w4a8moe layer: packing " + std::to_string(info.experts) + " experts");
  p.packed = io::pack_layer(*p.source, options.threads, [&](double f) { progress.update(f); });
  return p;
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

    // Load and pack: the routed experts, and the shared expert when asked for and present.
    const auto load_start = std::chrono::steady_clock::now();
    Part routed = load_part(options, load, false);
    const io::LayerInfo& info = routed.source->info();
    const bool with_shared = options.shared_experts && info.has_shared_expert;
    Part shared;
    if (with_shared) shared = load_part(options, load, true);
    const double load_seconds = seconds_since(load_start);
    const int64_t H = info.hidden, E = info.experts, K = info.top_k;

    std::printf("model: %s (%s), layer %d: H %lld, I %lld, E %lld, top-k %lld, %s\n",
                options.model.c_str(), info.format.c_str(), info.layer, static_cast<long long>(H),
                static_cast<long long>(info.inter), static_cast<long long>(E),
                static_cast<long long>(K), activation_name(info.params.activation));
    std::printf("architecture: %s; routing: %s%s\n", info.model.c_str(),
                routing_text(info.routing, !routed.router.bias.empty(),
                             !routed.router.selection_bias.empty())
                    .c_str(),
                info.params.apply_router_weight_on_input ? "; router weight on the input" : "");
    print_conversions(*routed.source);
    if (with_shared) {
      const io::LayerInfo& si = shared.source->info();
      std::printf("shared expert: I %lld, %s, %s\n", static_cast<long long>(si.inter),
                  activation_name(si.params.activation),
                  si.shared_gate ? "output scaled by sigmoid(x . gate)" : "output added as is");
      print_conversions(*shared.source);
    }
    for (const std::string& note : info.notes) std::printf("note: %s\n", note.c_str());
    if (with_shared)
      for (const std::string& note : shared.source->info().notes)
        std::printf("note: shared expert: %s\n", note.c_str());
    if (with_shared) {
      std::printf("out: the routed experts plus the shared expert\n");
    } else if (info.has_shared_expert) {
      std::printf(
          "note: the file's shared expert is not included in `out` (routed experts only; "
          "--shared-experts adds it)\n");
    } else if (options.shared_experts) {
      std::printf("note: layer %d has no shared expert: `out` is its routed experts\n", info.layer);
    }
    const double packed_bytes =
        static_cast<double>(routed.packed.w13.size() + routed.packed.w2.size() +
                            (with_shared ? shared.packed.w13.size() + shared.packed.w2.size() : 0));
    std::printf("load: %.3f s (packed %.1f MiB for kernel set %s; peak resident memory %.1f MiB)\n",
                load_seconds, packed_bytes / (1024.0 * 1024.0), active_kernel_set().c_str(),
                peak_rss_mib());

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
    std::vector<float> xf(static_cast<size_t>(T * H));  // x in f32 (exact)
    for (int64_t i = 0; i < T * H; ++i)
      xf[static_cast<size_t>(i)] =
          detail::load_float(x.data, x.dtype, (i / H) * x.stride() + i % H);

    // Route (the shared expert: every token, weight 1 or its gate's sigmoid).
    const auto route_start = std::chrono::steady_clock::now();
    io::route_tokens(*routed.source, routed.router, x, routed.ids, routed.weights);
    if (with_shared) io::route_tokens(*shared.source, shared.router, x, shared.ids, shared.weights);
    const double route_seconds = seconds_since(route_start);

    // Run. With the shared expert, both parts run on x in f32 and their f32 sum is rounded once
    // to x's dtype; without it, forward() writes `out` in x's dtype directly.
    Context context(options.threads);
    const size_t out_bytes = static_cast<size_t>(T * H) * dtype_bytes(x.dtype);
    std::vector<uint64_t> out_storage(out_bytes / sizeof(uint64_t) + 1);
    const MutableTensorView out = MutableTensorView::of(out_storage.data(), x.dtype, {T, H});
    std::vector<float> routed_out, shared_out;
    const TensorView x_run = with_shared ? TensorView::of(xf.data(), DType::f32, {T, H}) : x;
    const auto run_part = [&](const Part& p, const MutableTensorView& dst) {
      const int64_t k = p.source->info().top_k;
      forward(context, x_run, TensorView::of(p.ids.data(), DType::i32, {T, k}),
              TensorView::of(p.weights.data(), DType::f32, {T, k}), p.packed.w13.bytes(),
              p.packed.w2.bytes(), p.source->info().params, dst);
    };
    const auto run_layer = [&] {
      if (!with_shared) {
        run_part(routed, out);
        return;
      }
      routed_out.resize(static_cast<size_t>(T * H));
      shared_out.resize(static_cast<size_t>(T * H));
      run_part(routed, MutableTensorView::of(routed_out.data(), DType::f32, {T, H}));
      run_part(shared, MutableTensorView::of(shared_out.data(), DType::f32, {T, H}));
      for (int64_t i = 0; i < T * H; ++i)
        detail::store_float(
            out.data, out.dtype, i,
            routed_out[static_cast<size_t>(i)] + shared_out[static_cast<size_t>(i)]);
    };
    run_layer();  // warm-up
    std::vector<double> times;
    for (int r = 0; r < options.repeat; ++r) {
      const auto start = std::chrono::steady_clock::now();
      run_layer();
      times.push_back(seconds_since(start));
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    std::printf(
        "forward: %lld tokens, %d threads: %.3f ms per forward (median of %d%s), %.1f tokens/s; "
        "routing %.3f ms\n",
        static_cast<long long>(T), context.threads(), median * 1e3, options.repeat,
        with_shared ? "; routed and shared experts" : "", static_cast<double>(T) / median,
        route_seconds * 1e3);

    if (!options.output.empty()) {
      io::SafetensorsWriter writer;
      writer.add("out", x.dtype, {T, H}, out_storage.data(), out_bytes);
      writer.add("topk_ids", DType::i32, {T, K}, routed.ids);
      writer.add("topk_weights", DType::f32, {T, K}, routed.weights);
      if (with_shared) writer.add("shared_weights", DType::f32, {T}, shared.weights);
      writer.set_metadata("model", options.model);
      writer.set_metadata("layer", std::to_string(info.layer));
      writer.set_metadata("kernel_set", active_kernel_set());
      writer.set_metadata("threads", std::to_string(context.threads()));
      writer.set_metadata("shared_expert", with_shared              ? "included"
                                           : info.has_shared_expert ? "not included"
                                                                    : "none in the layer");
      writer.write(options.output);
      std::printf("wrote out [%lld, %lld] %s, topk_ids and topk_weights%s to %s\n",
                  static_cast<long long>(T), static_cast<long long>(H), dtype_name(x.dtype),
                  with_shared ? ", shared_weights" : "", options.output.c_str());
    }

    if (options.compare) {
      std::vector<double> ref;
      {
        Progress progress("w4a8moe layer: float reference");
        ref = io::float_reference(*routed.source, xf, routed.ids, routed.weights, options.threads);
        if (with_shared) {
          const std::vector<double> s =
              io::float_reference(*shared.source, xf, shared.ids, shared.weights, options.threads);
          for (size_t i = 0; i < ref.size(); ++i) ref[i] += s[i];
        }
      }
      double err_sq = 0, ref_sq = 0, max_err = 0, max_ref = 0;
      for (int64_t i = 0; i < T * H; ++i) {
        const double got = static_cast<double>(detail::load_float(out.data, out.dtype, i));
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
          "float reference (the int4 weights dequantized, activations not quantized%s)\n",
          rel_rms, max_err, max_ref, with_shared ? "; shared expert included" : "");
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
