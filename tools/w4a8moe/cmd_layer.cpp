// w4a8moe layer: one MoE layer of a real checkpoint (a GGUF file or a compressed-tensors
// folder): load and pack it (streaming), route hidden states with the model's own router, run
// forward(), write `out`, and optionally compare with the float reference.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "io/checkpoint.hpp"
#include "io/safetensors_file.hpp"
#include "io/safetensors_writer.hpp"
#include "w4a8moe/commands.hpp"
#include "w4a8moe/forward_parts.hpp"
#include "w4a8moe/parallel.hpp"
#include "w4a8moe/progress.hpp"
#include "w4a8moe/routing.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::cli {

namespace {

// Above this relative RMS error against the float reference the result is wrong, not merely
// quantized (int8 activations cost a few 1e-3).
constexpr double kCompareBound = 5e-2;

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

// Prints how a source's three weight tensors (gate, up, down) became int4 (with or without zero
// points) or mxfp4.
void print_conversions(const io::LayerSource& source) {
  const std::vector<io::Conversion> conversions = source.conversions();
  for (size_t i = 0; i < conversions.size(); ++i) {
    const io::Conversion& c = conversions[i];
    const WeightFormat format = i < 2 ? source.info().w13_format : source.info().w2_format;
    if (c.exact) {
      std::printf("weights: %s: %s -> %s exactly\n", c.tensor.c_str(), c.source.c_str(),
                  format == WeightFormat::mxfp4             ? "mxfp4"
                  : format == WeightFormat::int4_zero_point ? "int4 with zero points"
                                                            : "int4");
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
  p.packed =
      io::pack_layer(*p.source, options.execution.threads, [&](double f) { progress.update(f); });
  return p;
}

// ---- the options, and the layer loaded ----

io::LoadOptions load_options(const LayerOptions& options) {
  if (options.execution.threads < 0)
    throw Error("--threads: expected 0 (all hardware threads) or more, got " +
                std::to_string(options.execution.threads));
  if (options.repeat < 1)
    throw Error("--repeat: expected at least 1, got " + std::to_string(options.repeat));
  if (options.input.empty() && options.tokens < 1)
    throw Error("--tokens: expected at least 1, got " + std::to_string(options.tokens));
  io::LoadOptions load;
  load.group_size = options.group;
  load.require_exact = options.exact;
  return load;
}

// The routed experts, and the shared expert when asked for and present, loaded and packed.
struct Layer {
  Part routed, shared;
  bool with_shared = false;
  double load_seconds = 0.0;
  const io::LayerInfo& info() const { return routed.source->info(); }
};

Layer load_layer(const LayerOptions& options, const Parallel& parallel) {
  io::LoadOptions load = load_options(options);
  Layer l;
  const auto load_start = std::chrono::steady_clock::now();
  if (parallel.on()) {  // this process's share of the routed experts, read alone
    if (options.shared_experts)
      throw Error(
          "--shared-experts: expected no shared expert with --expert-parallel (the "
          "processes hold routed experts only), got the option");
    const int64_t experts = io::open_layer(options.model, options.layer, load)->info().experts;
    const std::vector<int32_t> mine = parallel.local_experts(experts);
    load.experts = {mine.front(), static_cast<int64_t>(mine.size())};
  }
  l.routed = load_part(options, load, false);
  l.with_shared = options.shared_experts && l.info().has_shared_expert;
  if (l.with_shared) l.shared = load_part(options, load, true);
  l.load_seconds = seconds_since(load_start);
  return l;
}

// What the layer is, how its weights became int4, what `out` holds, and what loading cost.
void print_layer(const LayerOptions& options, const Layer& l) {
  const io::LayerInfo& info = l.info();
  std::printf("model: %s (%s), layer %d: H %lld, I %lld, E %lld, top-k %lld, %s\n",
              options.model.c_str(), info.format.c_str(), info.layer,
              static_cast<long long>(info.hidden), static_cast<long long>(info.inter),
              static_cast<long long>(info.experts), static_cast<long long>(info.top_k),
              activation_name(info.params.activation));
  std::printf("architecture: %s; routing: %s%s\n", info.model.c_str(),
              routing_text(info.routing, !l.routed.router.bias.empty(),
                           !l.routed.router.selection_bias.empty())
                  .c_str(),
              info.params.apply_router_weight_on_input ? "; router weight on the input" : "");
  print_conversions(*l.routed.source);
  if (l.with_shared) {
    const io::LayerInfo& si = l.shared.source->info();
    std::printf("shared expert: I %lld, %s, %s\n", static_cast<long long>(si.inter),
                activation_name(si.params.activation),
                si.shared_gate ? "output scaled by sigmoid(x . gate)" : "output added as is");
    print_conversions(*l.shared.source);
  }
  for (const std::string& note : info.notes) std::printf("note: %s\n", note.c_str());
  if (l.with_shared)
    for (const std::string& note : l.shared.source->info().notes)
      std::printf("note: shared expert: %s\n", note.c_str());
  if (l.with_shared) {
    std::printf("out: the routed experts plus the shared expert\n");
  } else if (info.has_shared_expert) {
    std::printf(
        "note: the file's shared expert is not included in `out` (routed experts only; "
        "--shared-experts adds it)\n");
  } else if (options.shared_experts) {
    std::printf("note: layer %d has no shared expert: `out` is its routed experts\n", info.layer);
  }
  const double packed_bytes = static_cast<double>(
      l.routed.packed.w13.size() + l.routed.packed.w2.size() +
      (l.with_shared ? l.shared.packed.w13.size() + l.shared.packed.w2.size() : 0));
  std::printf("load: %.3f s (packed %.1f MiB for kernel set %s; peak resident memory %.1f MiB)\n",
              l.load_seconds, packed_bytes / (1024.0 * 1024.0), active_kernel_set().c_str(),
              peak_rss_mib());
}

// ---- the hidden states ----

// x [T, H] as read from --input or drawn at random, and in f32 (exact).
struct HiddenStates {
  HiddenStates() = default;
  HiddenStates(const HiddenStates&) = delete;  // `x` points into `file` or `random`
  HiddenStates& operator=(const HiddenStates&) = delete;

  io::SafetensorsFile file;
  std::vector<float> random;
  TensorView x;
  std::vector<float> f32;
};

void read_input_x(const std::string& path, int64_t H, HiddenStates& hs) {
  hs.file = io::SafetensorsFile::read(path);
  if (!hs.file.contains("x"))
    throw Error("input file '" + path + "': tensor 'x' [T, H] is missing");
  const io::TensorEntry& e = hs.file.entry("x");
  if (!detail::is_float_dtype(e.dtype) || e.shape.size() != 2 || e.shape[1] != H || e.shape[0] < 1)
    throw Error("input file '" + path + "': tensor 'x' must be F32, BF16 or F16 [T, " +
                std::to_string(H) + "] with T >= 1, got " + io::safetensors_dtype_name(e.dtype) +
                " of rank " + std::to_string(e.shape.size()) +
                (e.shape.size() == 2
                     ? " [" + std::to_string(e.shape[0]) + ", " + std::to_string(e.shape[1]) + "]"
                     : std::string()));
  hs.x = hs.file.view("x");
}

void draw_random_x(int tokens, unsigned seed, int64_t H, HiddenStates& hs) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  hs.random.resize(static_cast<size_t>(tokens) * static_cast<size_t>(H));
  for (float& v : hs.random) v = normal(rng);
  hs.x = TensorView::of(hs.random.data(), DType::f32, {tokens, H});
}

void hidden_states(const LayerOptions& options, int64_t H, HiddenStates& hs) {
  if (!options.input.empty()) {
    read_input_x(options.input, H, hs);
  } else {
    draw_random_x(options.tokens, options.seed, H, hs);
  }
  const int64_t T = hs.x.shape[0];
  hs.f32.resize(static_cast<size_t>(T * H));
  for (int64_t i = 0; i < T * H; ++i)
    hs.f32[static_cast<size_t>(i)] =
        detail::load_float(hs.x.data, hs.x.dtype, (i / H) * hs.x.stride() + i % H);
}

// Routes x with the model's router (the shared expert: every token, weight 1 or its gate's
// sigmoid); returns the seconds it took.
double route(Layer& l, const TensorView& x) {
  const auto route_start = std::chrono::steady_clock::now();
  io::route_tokens(*l.routed.source, l.routed.router, x, l.routed.ids, l.routed.weights);
  if (l.with_shared)
    io::route_tokens(*l.shared.source, l.shared.router, x, l.shared.ids, l.shared.weights);
  return seconds_since(route_start);
}

// ---- the timed runs ----

// Under --expert-parallel: each process runs its share (its experts; with dispatch, its run of
// the tokens), timed as the slowest process; out whole on process 0.
double time_layer_parallel(const Layer& l, const HiddenStates& hs, int repeat, Context& context,
                           const MutableTensorView& out, Parallel& parallel) {
  const io::LayerInfo& info = l.info();
  const int64_t T = hs.x.shape[0], H = info.hidden, K = info.top_k;
  parallel.setup(info.experts, l.routed.packed.w13.bytes(), l.routed.packed.w2.bytes(), K,
                 info.params);
  const int64_t n = parallel.token_run(T).second;  // this process's tokens
  OutputTensor mine(out.dtype, n, H);
  const auto run = [&] {
    parallel.forward(context, parallel.rows_of(hs.x),
                     parallel.rows_of(TensorView::of(l.routed.ids.data(), DType::i32, {T, K})),
                     parallel.rows_of(TensorView::of(l.routed.weights.data(), DType::f32, {T, K})),
                     mine.view);
  };
  run();  // warm-up
  std::vector<double> times;
  for (int r = 0; r < repeat; ++r) {
    parallel.barrier();
    const auto start = std::chrono::steady_clock::now();
    run();
    times.push_back(parallel.max_over_processes(seconds_since(start)));
  }
  const std::vector<uint8_t> all =
      parallel.gather_rows({reinterpret_cast<const uint8_t*>(mine.storage.data()), mine.bytes});
  if (parallel.rank() == 0)
    std::memcpy(out.data, all.data(), static_cast<size_t>(T * H) * dtype_bytes(out.dtype));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// A warm-up and `repeat` timed runs of the layer into `out`; returns the median seconds. With
// the shared expert, both parts run on x in f32 and their f32 sum is rounded once to x's dtype;
// without it, forward() writes `out` in x's dtype directly.
double time_layer(const Layer& l, const HiddenStates& hs, int repeat, Context& context,
                  const MutableTensorView& out, Parallel& parallel) {
  const int64_t T = hs.x.shape[0], H = l.info().hidden;
  if (parallel.on()) return time_layer_parallel(l, hs, repeat, context, out, parallel);
  std::vector<float> routed_out, shared_out;
  const TensorView x_run = l.with_shared ? TensorView::of(hs.f32.data(), DType::f32, {T, H}) : hs.x;
  const auto run_part = [&](const Part& p, const MutableTensorView& dst) {
    const int64_t k = p.source->info().top_k;
    forward(context, x_run, TensorView::of(p.ids.data(), DType::i32, {T, k}),
            TensorView::of(p.weights.data(), DType::f32, {T, k}), p.packed.w13.bytes(),
            p.packed.w2.bytes(), p.source->info().params, dst);
  };
  const auto run_layer = [&] {
    if (!l.with_shared) {
      run_part(l.routed, out);
      return;
    }
    routed_out.resize(static_cast<size_t>(T * H));
    shared_out.resize(static_cast<size_t>(T * H));
    run_part(l.routed, MutableTensorView::of(routed_out.data(), DType::f32, {T, H}));
    run_part(l.shared, MutableTensorView::of(shared_out.data(), DType::f32, {T, H}));
    for (int64_t i = 0; i < T * H; ++i)
      detail::store_float(out.data, out.dtype, i,
                          routed_out[static_cast<size_t>(i)] + shared_out[static_cast<size_t>(i)]);
  };
  run_layer();  // warm-up
  std::vector<double> times;
  for (int r = 0; r < repeat; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run_layer();
    times.push_back(seconds_since(start));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// ---- the output file and the comparison ----

void write_layer_output(const LayerOptions& options, const Layer& l, const OutputTensor& out,
                        const Context& context) {
  const io::LayerInfo& info = l.info();
  const int64_t T = out.view.shape[0], H = out.view.shape[1], K = info.top_k;
  io::SafetensorsWriter writer;
  out.add_to(writer, "out");
  writer.add("topk_ids", DType::i32, {T, K}, l.routed.ids);
  writer.add("topk_weights", DType::f32, {T, K}, l.routed.weights);
  if (l.with_shared) writer.add("shared_weights", DType::f32, {T}, l.shared.weights);
  writer.set_metadata("model", options.model);
  writer.set_metadata("layer", std::to_string(info.layer));
  writer.set_metadata("kernel_set", active_kernel_set());
  writer.set_metadata("threads", std::to_string(context.threads()));
  writer.set_metadata("shared_expert", l.with_shared            ? "included"
                                       : info.has_shared_expert ? "not included"
                                                                : "none in the layer");
  writer.write(options.output);
  std::printf("wrote out [%lld, %lld] %s, topk_ids and topk_weights%s to %s\n",
              static_cast<long long>(T), static_cast<long long>(H), dtype_name(out.view.dtype),
              l.with_shared ? ", shared_weights" : "", options.output.c_str());
}

// The float reference of the layer on x in f32; prints the error of `out` against it and
// returns the exit code (1 above kCompareBound).
int compare_with_reference(const LayerOptions& options, const Layer& l,
                           const std::vector<float>& xf, const MutableTensorView& out) {
  const int threads = options.execution.threads;
  std::vector<double> ref;
  {
    Progress progress("w4a8moe layer: float reference");
    ref = io::float_reference(*l.routed.source, xf, l.routed.ids, l.routed.weights, threads);
    if (l.with_shared) {
      const std::vector<double> s =
          io::float_reference(*l.shared.source, xf, l.shared.ids, l.shared.weights, threads);
      for (size_t i = 0; i < ref.size(); ++i) ref[i] += s[i];
    }
  }
  double err_sq = 0, ref_sq = 0, max_err = 0, max_ref = 0;
  for (int64_t i = 0; i < out.shape[0] * out.shape[1]; ++i) {
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
      "float reference (the weights as loaded, dequantized; activations not quantized%s)\n",
      rel_rms, max_err, max_ref, l.with_shared ? "; shared expert included" : "");
  if (!(rel_rms <= kCompareBound)) {
    std::fprintf(stderr,
                 "w4a8moe layer: the relative RMS error %.3e against the float reference "
                 "exceeds %.0e: the result is wrong\n",
                 rel_rms, kCompareBound);
    return 1;
  }
  return 0;
}

}  // namespace

int layer_command(const LayerOptions& options) {
  Parallel parallel(options.execution, "exact");
  Layer l = load_layer(options, parallel);
  const bool report = parallel.rank() == 0;  // under --expert-parallel, process 0 reports
  if (report) print_layer(options, l);
  HiddenStates hs;
  hidden_states(options, l.info().hidden, hs);
  const double route_seconds = route(l, hs.x);

  Context context(options.execution.threads);
  configure_context(context, options.execution);
  const int64_t T = hs.x.shape[0];
  OutputTensor out(hs.x.dtype, T, l.info().hidden);
  const double median = time_layer(l, hs, options.repeat, context, out.view, parallel);
  if (!report) return 0;
  std::printf(
      "forward: %lld tokens, %d threads: %.3f ms per forward (median of %d%s), %.1f tokens/s; "
      "routing %.3f ms\n",
      static_cast<long long>(T), context.threads(), median * 1e3, options.repeat,
      l.with_shared ? "; routed and shared experts" : "", static_cast<double>(T) / median,
      route_seconds * 1e3);
  if (parallel.on())
    std::printf("expert-parallel %s over %d processes (%s results; the slowest process)\n",
                parallel.way().c_str(), parallel.ranks(), parallel.results().c_str());

  if (!options.output.empty()) write_layer_output(options, l, out, context);
  if (options.compare) return compare_with_reference(options, l, hs.f32, out.view);
  return 0;
}

}  // namespace w4a8moe::cli
