// Fuzz target: the public API's argument validation. Shapes from a table of sizes the library
// likes and hostile ones (zero, negative, at and past the limits, overflowing), dtypes including
// invalid codes, group sizes, row strides, ids in and out of range, misaligned and null pointers,
// through pack_w13/pack_w2, forward, reference_forward, quantize_weights, is_supported_config,
// infer_output, Context and the activation parsers. Input: a stream of choices (fuzz::Reader).
//
// Every buffer is allocated at exactly the size its view claims (AddressSanitizer sees a read
// past it); a view whose claimed size overflows gets 16 bytes, and the library must refuse it.
// Oracles besides memory safety: only w4a8moe::Error is thrown; a forward() that returns had all
// ids in range and gives the same bits on one and two threads; a configuration that
// is_supported_config() accepts packs and runs; results of pack and quantize_weights describe
// themselves consistently.
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "registry.hpp"

namespace {

using namespace w4a8moe;
using fuzz::Buffers;
using fuzz::finding;
using fuzz::Reader;

constexpr size_t kLimit = size_t{64} << 20;
// The packer's memory limit in fuzz_pack: packing works per byte of its (padded) output, which
// the 1 MiB input buffers do not bound (65536 experts of 1 x 1 pad to 24 MiB and took 3 to 6 s
// under the fuzz build; 64 MiB would take ~15 s). Larger packs are refused: still fuzzed.
constexpr size_t kPackLimit = size_t{8} << 20;

DType any_dtype(Reader& r) {
  const uint8_t b = r.u8();
  return static_cast<DType>(b < 240 ? b % 7 : b);
}

int group_size(Reader& r) {
  static constexpr int kGroups[] = {-1, 32, 64, 96, 128, 256, 0, -2, 16, 33, INT_MAX, INT_MIN};
  return kGroups[r.u8() % 12];
}

// Bytes to fill buffers with: int4 values, floats of order one, or raw fuzzer bytes.
std::vector<uint8_t> pattern(Reader& r, DType dtype, int64_t id_bound) {
  std::vector<uint8_t> out;
  const uint8_t mode = r.u8();
  if (mode >= 224) {  // raw
    const std::span<const uint8_t> raw = r.take(64);
    return {raw.begin(), raw.end()};
  }
  for (int i = 0; i < 48; ++i) {
    const auto v = static_cast<uint8_t>(r.u8() ^ (i * 29));
    switch (dtype) {
      case DType::i8:
        out.push_back(static_cast<uint8_t>(static_cast<int8_t>(v % 16) - 8));
        break;
      case DType::i32:
      case DType::i64: {
        const int64_t id = id_bound > 0 ? v % id_bound : v;
        for (size_t b = 0; b < dtype_bytes(dtype); ++b)
          out.push_back(static_cast<uint8_t>(static_cast<uint64_t>(id) >> (8 * b)));
        break;
      }
      case DType::f32: {
        const float f = (static_cast<float>(v) - 128.0f) / 64.0f;
        uint8_t b[4];
        std::memcpy(b, &f, 4);
        out.insert(out.end(), b, b + 4);
        break;
      }
      case DType::bf16:
        out.push_back(static_cast<uint8_t>(v & 0x80));
        out.push_back(static_cast<uint8_t>(0x3e + (v & 1) + (v & 0x80)));
        break;
      case DType::f16:
        out.push_back(v);
        out.push_back(static_cast<uint8_t>(0x38 + (v & 3) + (v & 0x80)));
        break;
      default:
        out.push_back(v);
    }
  }
  return out;
}

// A view near `want` (the dtype and shape a valid call would pass), sometimes changed, backed by
// an exactly sized buffer. `skip` is set when the claim is valid but too large to run quickly.
template <class View>
View fuzz_view(Reader& r, Buffers& buffers, DType want_dtype,
               std::initializer_list<int64_t> want_shape, bool& skip, int64_t id_bound = 0) {
  View v;
  v.dtype = r.u8() < 224 ? want_dtype : any_dtype(r);
  v.rank = r.u8() < 240 ? static_cast<int>(want_shape.size()) : r.u8() % 4;
  int k = 0;
  for (const int64_t d : want_shape) {
    if (k < 3) v.shape[static_cast<size_t>(k)] = r.dim_or(d);
    ++k;
  }
  if (v.rank > static_cast<int>(want_shape.size()))
    for (int i = static_cast<int>(want_shape.size()); i < v.rank; ++i)
      v.shape[static_cast<size_t>(i)] = r.dim();
  const uint8_t stride_mode = r.u8();
  if (stride_mode >= 232 && v.rank > 0) {
    const int64_t last = v.shape[static_cast<size_t>(v.rank - 1)];
    // (corpus/api/crash-e77267e0...: the harness itself once overflowed here, last = INT64_MAX)
    const bool padded = stride_mode < 248 && last <= INT64_MAX - 16;
    v.row_stride = padded ? last + (stride_mode - 232) : r.dim();
  }
  const int64_t claimed = fuzz::claimed_bytes(v.dtype, v.rank, v.shape, v.stride());
  const size_t misalign = r.u8() >= 224 ? r.u8() % 8 : 0;
  const std::vector<uint8_t> fill = pattern(r, v.dtype, id_bound);
  uint8_t* data = buffers.get(claimed, misalign, fill, skip);
  if (r.u8() == 255) data = nullptr;
  v.data = data;
  return v;
}

TensorView fuzz_tensor(Reader& r, Buffers& b, DType d, std::initializer_list<int64_t> s, bool& skip,
                       int64_t id_bound = 0) {
  return fuzz_view<TensorView>(r, b, d, s, skip, id_bound);
}

// ---- packed weights the forward calls use (valid, small) --------------------------------------

struct Layer {
  int64_t experts, hidden, inter;
  int group;
  bool bias;
  std::vector<int8_t> w13, w2;
  std::vector<float> s13, s2, b13, b2;
  PackedWeights p13, p2;

  LogicalWeights logical() const {
    LogicalWeights w;
    const int64_t E = experts, H = hidden, I = inter;
    w.w13 = TensorView::of(w13.data(), DType::i8, {E, 2 * I, H});
    w.w2 = TensorView::of(w2.data(), DType::i8, {E, H, I});
    if (group < 0) {
      w.w13_scale = TensorView::of(s13.data(), DType::f32, {E, 2 * I});
      w.w2_scale = TensorView::of(s2.data(), DType::f32, {E, H});
    } else {
      w.w13_scale = TensorView::of(s13.data(), DType::f32, {E, 2 * I, H / group});
      w.w2_scale = TensorView::of(s2.data(), DType::f32, {E, H, I / group});
    }
    if (bias) {
      w.w13_bias = TensorView::of(b13.data(), DType::f32, {E, 2 * I});
      w.w2_bias = TensorView::of(b2.data(), DType::f32, {E, H});
    }
    w.group_size = group;
    return w;
  }
};

std::unique_ptr<Layer> make_layer(int64_t E, int64_t H, int64_t I, int group, bool bias,
                                  const std::string& kernel_set) {
  auto l = std::make_unique<Layer>();
  l->experts = E;
  l->hidden = H;
  l->inter = I;
  l->group = group;
  l->bias = bias;
  const int64_t g13 = group < 0 ? 1 : H / group, g2 = group < 0 ? 1 : I / group;
  l->w13.resize(static_cast<size_t>(E * 2 * I * H));
  l->w2.resize(static_cast<size_t>(E * H * I));
  for (size_t i = 0; i < l->w13.size(); ++i) l->w13[i] = static_cast<int8_t>((i * 7 + 3) % 16 - 8);
  for (size_t i = 0; i < l->w2.size(); ++i) l->w2[i] = static_cast<int8_t>((i * 5 + 1) % 16 - 8);
  l->s13.assign(static_cast<size_t>(E * 2 * I * g13), 0.02f);
  l->s2.assign(static_cast<size_t>(E * H * g2), 0.03f);
  l->b13.assign(static_cast<size_t>(E * 2 * I), 0.1f);
  l->b2.assign(static_cast<size_t>(E * H), -0.2f);
  const LogicalWeights w = l->logical();
  PackOptions o;
  o.group_size = group;
  o.kernel_set = kernel_set;
  l->p13 = pack_w13(w.w13, w.w13_scale, w.w13_bias, o);
  l->p2 = pack_w2(w.w2, w.w2_scale, w.w2_bias, o);
  return l;
}

const Layer& layer(uint8_t which) {
  static const std::unique_ptr<Layer> layers[] = {
      make_layer(4, 64, 32, 32, false, ""),
      make_layer(3, 40, 24, -1, true, ""),
      make_layer(2, 128, 64, 64, true, ""),
      make_layer(3, 96, 32, 32, false, "scalar"),
  };
  return *layers[which % 4];
}

MoeParams fuzz_params(Reader& r) {
  MoeParams p;
  const uint8_t a = r.u8();
  p.activation = static_cast<Activation>(a < 240 ? a % 5 : static_cast<int>(r.u32()));
  if (r.u8() >= 240) p.alpha = r.f32();
  if (r.u8() >= 240) p.limit = r.f32();
  p.apply_router_weight_on_input = r.flag();
  return p;
}

bool ids_in_range(const TensorView& ids, int64_t experts) {
  const int64_t n = ids.shape[0] * ids.shape[1];
  for (int64_t i = 0; i < n; ++i) {
    int64_t e;
    if (ids.dtype == DType::i32) {
      int32_t v;
      std::memcpy(&v, static_cast<const uint8_t*>(ids.data) + 4 * i, 4);
      e = v;
    } else {
      std::memcpy(&e, static_cast<const uint8_t*>(ids.data) + 8 * i, 8);
    }
    if (e < 0 || e >= experts) return false;
  }
  return true;
}

Context& context(int threads) {
  static Context one(1), two(2);
  return threads == 1 ? one : two;
}

// ---- the operations ----------------------------------------------------------------------------

void fuzz_pack(Reader& r) {
  Buffers b;
  bool skip = false;
  const bool w13 = r.flag();
  const int64_t E = r.dim(), N = r.dim(), K = r.dim();
  const int g = group_size(r);
  const bool nibbles = r.u8() >= 192;
  const int64_t cols = nibbles ? K / 2 : K;
  const int64_t groups = g > 0 && K > 0 ? K / g : 1;
  const TensorView w = fuzz_tensor(r, b, nibbles ? DType::u8 : DType::i8, {E, N, cols}, skip);
  const TensorView s = g < 0 ? fuzz_tensor(r, b, DType::f32, {E, N}, skip)
                             : fuzz_tensor(r, b, DType::bf16, {E, N, groups}, skip);
  const TensorView bias = r.flag() ? fuzz_tensor(r, b, DType::f16, {E, N}, skip) : TensorView{};
  PackOptions o;
  o.group_size = g;
  const uint8_t layout = r.u8();
  o.gate_up_layout = static_cast<GateUpLayout>(layout < 240 ? layout % 2 : layout);
  const uint8_t storage = r.u8();
  o.scale_storage = static_cast<ScaleStorage>(storage < 240 ? storage % 2 : storage);
  // the active set three times in n, then each set of the registry's table, then an unknown name
  const std::span<const detail::KernelSet> sets = detail::kernel_table();
  const size_t pick = r.u8() % (sets.size() + 4);
  o.kernel_set = pick < 3 ? "" : pick - 3 < sets.size() ? sets[pick - 3].name : "bogus";
  o.memory_limit = kPackLimit;
  if (skip) return;
  const PackedWeights p = w13 ? pack_w13(w, s, bias, o) : pack_w2(w, s, bias, o);
  const PackedInfo info = inspect_packed(p.bytes());
  const int64_t given_cols = w.dtype == DType::u8 ? 2 * w.shape[2] : w.shape[2];
  if (info.experts != w.shape[0] || info.rows != w.shape[1] || info.cols != given_cols ||
      info.group_size != g || info.has_bias != !bias.empty() || info.total_bytes != p.size())
    finding("a packed buffer does not describe what was packed");
}

void fuzz_forward(Reader& r, bool reference) {
  const Layer& l = layer(r.u8());
  Buffers b;
  bool skip = false;
  const int64_t E = l.experts, H = l.hidden;
  const int64_t T = r.dim_or(1 + r.u8() % 9), K = r.dim_or(1 + r.u8() % E);
  const DType xd = static_cast<DType>(r.u8() % 3);
  const TensorView x = fuzz_tensor(r, b, xd, {T, H}, skip);
  const DType id_dtype = r.flag() ? DType::i64 : DType::i32;
  const int64_t id_bound = r.u8() < 240 ? E : 0;
  const TensorView ids = fuzz_tensor(r, b, id_dtype, {T, K}, skip, id_bound);
  const TensorView weights = fuzz_tensor(r, b, DType::f32, {T, K}, skip);
  MutableTensorView out = fuzz_view<MutableTensorView>(r, b, xd, {T, H}, skip);
  if (r.u8() == 254) out.data = const_cast<void*>(x.data);  // overlapping x: must be refused
  const MoeParams params = fuzz_params(r);
  if (skip) return;
  // Keep each run short: skip calls that would compute much (valid ones are slow under the
  // sanitizers; invalid ones of that size are covered by the huge-shape tests). The library
  // computes T' x K' pairs from the views (x.shape[0], ids.shape[1]), each dimension fuzzed on its
  // own (dim_or): views that agree on T' = 256, K' = 256 passed a bound on T x K alone and took
  // minutes (reference_forward) or 40 s (two forward() calls) under the fuzz build.
  const auto too_much = [&](int64_t tokens, int64_t top_k) {
    int64_t pairs = 0;
    const bool overflow = tokens > 0 && top_k > 0 && __builtin_mul_overflow(tokens, top_k, &pairs);
    return !overflow && pairs <= INT32_MAX &&
           pairs * l.inter * H > (reference ? 64 : 128) * 64 * 32;
  };
  if (too_much(T, K)) return;
  if (x.rank == 2 && ids.rank == 2 && ids.shape[0] == x.shape[0] &&
      too_much(x.shape[0], ids.shape[1]))
    return;
  if (reference) {
    LogicalWeights w = l.logical();
    bool w_skip = false;
    if (r.u8() >= 224) {  // perturb one logical tensor
      const int64_t I = l.inter;
      switch (r.u8() % 4) {
        case 0:
          w.w13 = fuzz_tensor(r, b, DType::i8, {E, 2 * I, H}, w_skip);
          break;
        case 1:
          w.w2_scale = fuzz_tensor(r, b, DType::f32, {E, H}, w_skip);
          break;
        case 2:
          w.w13_bias = fuzz_tensor(r, b, DType::f32, {E, 2 * I}, w_skip);
          break;
        default:
          w.group_size = group_size(r);
      }
    }
    if (w_skip) return;
    reference_forward(x, ids, weights, w, params, out);
    if (x.shape[0] > 0 && !ids_in_range(ids, E)) finding("reference_forward() accepted a bad id");
  } else {
    Context& ctx = context(2);
    ctx.set_memory_limit(r.u8() == 255 ? r.u32() : kLimit);
    forward(ctx, x, ids, weights, l.p13.bytes(), l.p2.bytes(), params, out);
    if (x.shape[0] == 0) return;
    // accepted: every id was in range, and one thread gives the same bits
    if (!ids_in_range(ids, E)) finding("forward() accepted an id out of range");
    const size_t out_bytes =
        static_cast<size_t>(fuzz::claimed_bytes(out.dtype, out.rank, out.shape, out.stride()));
    std::vector<uint8_t> first(static_cast<const uint8_t*>(out.data),
                               static_cast<const uint8_t*>(out.data) + out_bytes);
    context(1).set_memory_limit(kLimit);
    forward(context(1), x, ids, weights, l.p13.bytes(), l.p2.bytes(), params, out);
    if (std::memcmp(first.data(), out.data, out_bytes) != 0)
      finding("forward() gave different bits on one and on two threads");
  }
}

void fuzz_quantize(Reader& r) {
  Buffers b;
  bool skip = false;
  const int64_t E = r.dim(), N = r.dim(), K = r.dim();
  const TensorView w = fuzz_tensor(r, b, static_cast<DType>(r.u8() % 3), {E, N, K}, skip);
  const int g = group_size(r);
  const uint8_t rule = r.u8();
  if (skip) return;
  const QuantizedWeights q =
      quantize_weights(w, g, static_cast<QuantRule>(rule < 240 ? rule % 2 : rule));
  if (static_cast<int64_t>(q.values.size()) != w.shape[0] * w.shape[1] * w.shape[2])
    finding("quantize_weights: size");
  for (const int8_t v : q.values)
    if (v < -8 || v > 7) finding("quantize_weights: a value outside [-8, 7]");
}

void fuzz_supported(Reader& r) {
  MoeConfig c;
  c.x_dtype = any_dtype(r);
  c.hidden = r.dim();
  c.inter = r.dim();
  c.experts = r.dim();
  c.top_k = r.dim();
  c.group_size = r.u8() < 200 ? group_size(r) : r.dim();
  c.activation = r.u8() < 224 ? r.u8() % 5 : r.dim();
  const Support s = is_supported_config(c);
  if (s.supported != s.reason.empty()) finding("is_supported_config: a reason iff unsupported");
  if (!s.supported) return;
  const int64_t E = c.experts, H = c.hidden, I = c.inter, K = c.top_k;
  if (static_cast<double>(E) * 2.0 * static_cast<double>(I) * static_cast<double>(H) > 131072.0 ||
      K > 64 || E > 4096)
    return;  // too big to try quickly (each expert pads to a whole panel: 65536 experts of
             // H = I = 1 pack to ~48 MiB, 12 s under the fuzz build)
  // Supported: it must pack and run (zero weights, unit scales).
  const int g = static_cast<int>(c.group_size);
  std::vector<int8_t> w13(static_cast<size_t>(E * 2 * I * H)), w2(static_cast<size_t>(E * H * I));
  std::vector<float> s13(static_cast<size_t>(E * 2 * I * (g < 0 ? 1 : H / g)), 1.0f);
  std::vector<float> s2(static_cast<size_t>(E * H * (g < 0 ? 1 : I / g)), 1.0f);
  PackOptions o;
  o.group_size = g;
  try {
    const PackedWeights p13 =
        pack_w13(TensorView::of(w13.data(), DType::i8, {E, 2 * I, H}),
                 g < 0 ? TensorView::of(s13.data(), DType::f32, {E, 2 * I})
                       : TensorView::of(s13.data(), DType::f32, {E, 2 * I, H / g}),
                 {}, o);
    const PackedWeights p2 = pack_w2(TensorView::of(w2.data(), DType::i8, {E, H, I}),
                                     g < 0 ? TensorView::of(s2.data(), DType::f32, {E, H})
                                           : TensorView::of(s2.data(), DType::f32, {E, H, I / g}),
                                     {}, o);
    std::vector<float> x(static_cast<size_t>(H), 0.5f), out(static_cast<size_t>(H) * 2);
    std::vector<int32_t> ids(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) ids[static_cast<size_t>(k)] = static_cast<int32_t>(k % E);
    std::vector<float> weights(static_cast<size_t>(K), 0.5f);
    MoeParams params;
    params.activation = static_cast<Activation>(c.activation);
    context(2).set_memory_limit(kLimit);
    forward(context(2), TensorView::of(x.data(), c.x_dtype, {1, H}),
            TensorView::of(ids.data(), DType::i32, {1, K}),
            TensorView::of(weights.data(), DType::f32, {1, K}), p13.bytes(), p2.bytes(), params,
            MutableTensorView::of(out.data(), c.x_dtype, {1, H}));
  } catch (const Error& e) {
    finding(std::string("is_supported_config said yes, the library refused: ") + e.what());
  }
}

void fuzz_infer(Reader& r) {
  std::vector<int64_t> shapes[3];
  for (auto& s : shapes) {
    const int rank = r.u8() < 224 ? 2 : r.u8() % 5;
    for (int i = 0; i < rank; ++i) s.push_back(r.dim());
  }
  const DType d = any_dtype(r);
  const OutputSpec o = infer_output(shapes[0], d, shapes[1], shapes[2]);
  if (shapes[0].size() != 2 || o.shape[0] != shapes[0][0] || o.shape[1] != shapes[0][1] ||
      o.dtype != d || shapes[1].size() != 2 || shapes[1][0] != shapes[0][0] ||
      shapes[2] != shapes[1])
    finding("infer_output accepted inconsistent shapes");
}

void fuzz_misc(Reader& r) {
  switch (r.u8() % 3) {
    case 0: {
      static constexpr int kThreads[] = {-5, -1, 0, 1, 2, 3, 8, 4097, INT_MAX, INT_MIN};
      const Context c(kThreads[r.u8() % 10]);
      if (c.threads() < 1 || c.threads() > 4096) finding("Context: thread count out of range");
      break;
    }
    case 1: {
      const auto code = static_cast<int64_t>(r.u64());
      const Activation a = activation_from_code(code);
      if (static_cast<int64_t>(a) != code || !is_valid_activation_code(code))
        finding("activation code");
      break;
    }
    default: {
      const std::span<const uint8_t> raw = r.take(16);
      const std::string name(raw.begin(), raw.end());
      const Activation a = parse_activation(name);
      if (name != activation_name(a)) finding("parse_activation accepted another name");
    }
  }
}

}  // namespace

W4A8MOE_FUZZ_TARGET(api) {
  Reader r(data, size);
  try {
    switch (r.u8() % 8) {
      case 0:
        fuzz_pack(r);
        break;
      case 1:
      case 2:
        fuzz_forward(r, false);
        break;
      case 3:
        fuzz_forward(r, true);
        break;
      case 4:
        fuzz_quantize(r);
        break;
      case 5:
        fuzz_supported(r);
        break;
      case 6:
        fuzz_infer(r);
        break;
      default:
        fuzz_misc(r);
    }
  } catch (const Error&) {
  }
  return 0;
}
