#include "checkpoint_writers.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>

#include "io/safetensors_writer.hpp"

using nlohmann::json;
using w4a8moe::DType;

namespace {
// Appends src to dst. (vector::insert trips a false -Wnonnull in aarch64 GCC 12 under -Werror.)
void append_bytes(std::vector<uint8_t>& dst, const std::vector<uint8_t>& src) {
  if (src.empty()) return;
  const size_t at = dst.size();
  dst.resize(at + src.size());
  std::memcpy(dst.data() + at, src.data(), src.size());
}
}  // namespace

namespace ckpt_test {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// 16-bit floats (plain bit manipulation, round to nearest even; finite normal inputs)

uint16_t bf16_bits(float v) {
  uint32_t u = std::bit_cast<uint32_t>(v);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

float from_f16(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  double v;
  if (exp == 0) {
    v = std::ldexp(man, -24);
  } else if (exp == 31) {
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(1024 + man, exp - 25);
  }
  return static_cast<float>(sign ? -v : v);
}

uint16_t f16_bits(float v) {
  // the nearest f16 by search over the 65536 codes' order (slow but obviously right; test only)
  if (std::isnan(v)) return 0x7e00;
  const bool neg = std::signbit(v);
  const double a = std::fabs(static_cast<double>(v));
  uint16_t lo = 0, hi = 0x7c00;  // 0 .. inf
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    if (static_cast<double>(from_f16(mid)) <= a)
      lo = mid;
    else
      hi = mid;
  }
  const double dl = a - static_cast<double>(from_f16(lo)),
               dh = static_cast<double>(from_f16(hi)) - a;
  uint16_t r = (dl < dh || (dl == dh && (lo & 1) == 0)) ? lo : hi;
  if (hi == 0x7c00 && a < 65520.0) r = lo;
  return static_cast<uint16_t>(r | (neg ? 0x8000 : 0));
}

// ---------------------------------------------------------------------------------------------
// GGUF

void GgufWriter::kv_raw(const std::string& key, uint32_t type, const std::vector<uint8_t>& value) {
  kvs_.push_back({key, type, value});
}
void GgufWriter::kv_u32(const std::string& key, uint32_t v) { kv_scalar(key, kU32, v); }
void GgufWriter::kv_i32(const std::string& key, int32_t v) { kv_scalar(key, kI32, v); }
void GgufWriter::kv_u64(const std::string& key, uint64_t v) { kv_scalar(key, kU64, v); }
void GgufWriter::kv_f32(const std::string& key, float v) { kv_scalar(key, kF32, v); }
void GgufWriter::kv_bool(const std::string& key, bool v) {
  kv_scalar(key, kBool, static_cast<uint8_t>(v ? 1 : 0));
}
void GgufWriter::kv_string(const std::string& key, const std::string& v) {
  Bytes b;
  b.str(v);
  kv_raw(key, kString, b.data);
}
void GgufWriter::kv_strings(const std::string& key, const std::vector<std::string>& v) {
  Bytes b;
  b.put<uint32_t>(kString);
  b.put<uint64_t>(v.size());
  for (const std::string& s : v) b.str(s);
  kv_raw(key, kArray, b.data);
}

void GgufWriter::tensor(const std::string& name, uint32_t type, std::vector<int64_t> ne,
                        std::vector<uint8_t> data) {
  tensors_.push_back({name, type, std::move(ne), std::move(data)});
}

std::vector<uint8_t> GgufWriter::serialize(Layout* layout) const {
  Layout l;
  Bytes b;
  b.put<uint32_t>(0x46554747u);
  b.put<uint32_t>(version);
  l.tensor_count = b.size();
  b.put<uint64_t>(tensors_.size());
  l.kv_count = b.size();
  b.put<uint64_t>(kvs_.size());
  for (const Kv& kv : kvs_) {
    b.str(kv.key);
    b.put<uint32_t>(kv.type);
    append_bytes(b.data, kv.value);
  }
  const auto align = [&](uint64_t v) { return (v + alignment - 1) / alignment * alignment; };
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const Tensor& t : tensors_) {
    l.info_begin.push_back(b.size());
    b.str(t.name);
    b.put<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (const int64_t d : t.ne) b.put<uint64_t>(static_cast<uint64_t>(d));
    l.type_field.push_back(b.size());
    b.put<uint32_t>(t.type);
    l.offset_field.push_back(b.size());
    offsets.push_back(offset);
    b.put<uint64_t>(offset);
    offset = align(offset + t.data.size());
  }
  b.data.resize(align(b.size()), 0);
  l.data_begin = b.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    b.data.resize(l.data_begin + offsets[i], 0);
    l.data_at.push_back(b.size());
    append_bytes(b.data, tensors_[i].data);
  }
  b.data.resize(l.data_begin + offset, 0);
  if (layout) *layout = l;
  return b.data;
}

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void GgufWriter::write(const std::string& path) const { write_file(path, serialize()); }

std::vector<GgufWriter> GgufWriter::split(int count) const {
  std::vector<GgufWriter> out(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    GgufWriter& w = out[static_cast<size_t>(i)];
    w.version = version;
    w.alignment = alignment;
    if (i == 0) w.kvs_ = kvs_;
    Bytes no, n, total;
    no.put<uint16_t>(static_cast<uint16_t>(i));
    n.put<uint16_t>(static_cast<uint16_t>(count));
    total.put<int32_t>(static_cast<int32_t>(tensors_.size()));
    w.kv_raw("split.no", kU16, no.data);
    w.kv_raw("split.count", kU16, n.data);
    w.kv_raw("split.tensors.count", kI32, total.data);
  }
  for (size_t t = 0; t < tensors_.size(); ++t)
    out[t % static_cast<size_t>(count)].tensors_.push_back(tensors_[t]);
  return out;
}

namespace {

// ggml blocks of 32 values that start with the f16 scale d: per block, d's bytes and then what
// `quants` appends.
template <class Quants>
std::vector<uint8_t> encode_blocks(size_t values, const std::vector<uint16_t>& d, Quants quants) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < values / 32; ++b) {
    out.push_back(static_cast<uint8_t>(d[b] & 0xff));
    out.push_back(static_cast<uint8_t>(d[b] >> 8));
    quants(b, out);
  }
  return out;
}

}  // namespace

std::vector<uint8_t> encode_q4_0(const std::vector<uint8_t>& q, const std::vector<uint16_t>& d) {
  return encode_blocks(q.size(), d, [&](size_t b, std::vector<uint8_t>& out) {
    for (size_t j = 0; j < 16; ++j)
      out.push_back(static_cast<uint8_t>(q[32 * b + j] | (q[32 * b + 16 + j] << 4)));
  });
}

std::vector<uint8_t> encode_q8_0(const std::vector<int8_t>& q, const std::vector<uint16_t>& d) {
  return encode_blocks(q.size(), d, [&](size_t b, std::vector<uint8_t>& out) {
    for (size_t j = 0; j < 32; ++j) out.push_back(static_cast<uint8_t>(q[32 * b + j]));
  });
}

std::vector<uint8_t> encode_f32(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

namespace {

// 16-bit values, little-endian, each from bits(x).
std::vector<uint8_t> encode_16(const std::vector<float>& v, uint16_t (*bits)(float)) {
  std::vector<uint8_t> out;
  for (const float x : v) {
    const uint16_t h = bits(x);
    out.push_back(static_cast<uint8_t>(h & 0xff));
    out.push_back(static_cast<uint8_t>(h >> 8));
  }
  return out;
}

}  // namespace

std::vector<uint8_t> encode_f16(const std::vector<float>& v) { return encode_16(v, f16_bits); }

std::vector<uint8_t> encode_bf16(const std::vector<float>& v) { return encode_16(v, bf16_bits); }

namespace {

struct BlockType {
  uint32_t type;
  int64_t elems, bytes;
};
constexpr BlockType kBlockTypes[] = {
    {kTQ4_0, 32, 18},   {kTQ4_1, 32, 20},   {kTQ5_0, 32, 22},   {kTQ8_0, 32, 34},
    {kTQ4_K, 256, 144}, {kTQ5_K, 256, 176}, {kTQ6_K, 256, 210}, {kTMXFP4, 32, 17},
};
BlockType block_type(uint32_t type) {
  for (const BlockType& b : kBlockTypes)
    if (b.type == type) return b;
  throw std::invalid_argument("not a block type of the tests");
}

void put_half(uint8_t* p, float v) {
  const uint16_t h = f16_bits(v);
  p[0] = static_cast<uint8_t>(h & 0xff);
  p[1] = static_cast<uint8_t>(h >> 8);
}
double half_at(const uint8_t* p) {
  return static_cast<double>(from_f16(static_cast<uint16_t>(p[0] | (p[1] << 8))));
}

// The 6-bit scale (what = 0) or min (what = 1) of sub-block j of a K-quant block, from the
// 12 scale bytes: j < 4 in the low 6 bits of bytes j / j + 4; j >= 4 the low nibble of byte j + 4
// (scale) or its high nibble (min), with the top 2 bits in bytes j - 4 / j.
int k_scale(const uint8_t* s, int j, int what) {
  if (j < 4) return s[j + 4 * what] & 63;
  const int low = what == 0 ? (s[j + 4] & 15) : (s[j + 4] >> 4);
  const int high = s[j - 4 * (1 - what)] >> 6;
  return low | (high << 4);
}

}  // namespace

double e2m1_value(int code) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (code & 8 ? -1.0 : 1.0) * mag[code & 7];
}

std::vector<uint8_t> random_blocks(uint32_t type, int64_t elements, uint64_t seed) {
  const BlockType bt = block_type(type);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  std::vector<uint8_t> out(static_cast<size_t>(elements / bt.elems * bt.bytes));
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  for (int64_t blk = 0; blk < elements / bt.elems; ++blk) {
    uint8_t* p = out.data() + blk * bt.bytes;
    switch (type) {
      case kTQ4_0:
      case kTQ5_0:
      case kTQ8_0:
        put_half(p, u(rng) * 0.01f);
        break;
      case kTQ4_1:
        put_half(p, u(rng) * 0.01f);
        put_half(p + 2, -u(rng) * 0.05f);
        break;
      case kTQ4_K:
      case kTQ5_K:
        put_half(p, u(rng) * 0.001f);
        put_half(p + 2, u(rng) * 0.001f);
        break;
      case kTQ6_K:
        put_half(p + 208, u(rng) * 0.0005f);
        break;
      case kTMXFP4:
        p[0] = static_cast<uint8_t>(118 + rng() % 6);
        break;
      default:
        break;
    }
  }
  return out;
}

std::vector<float> decode_blocks(uint32_t type, const std::vector<uint8_t>& bytes,
                                 int64_t elements) {
  const BlockType bt = block_type(type);
  std::vector<float> out(static_cast<size_t>(elements));
  for (int64_t i = 0; i < elements; ++i) {
    const uint8_t* p = bytes.data() + (i / bt.elems) * bt.bytes;
    const int j = static_cast<int>(i % bt.elems);
    double v = 0;
    switch (type) {
      case kTQ4_0:
        v = (((p[2 + j % 16] >> (j < 16 ? 0 : 4)) & 15) - 8) * half_at(p);
        break;
      case kTQ4_1:
        v = ((p[4 + j % 16] >> (j < 16 ? 0 : 4)) & 15) * half_at(p) + half_at(p + 2);
        break;
      case kTQ5_0: {
        const uint32_t qh = p[2] | (p[3] << 8) | (p[4] << 16) | (static_cast<uint32_t>(p[5]) << 24);
        const int low = (p[6 + j % 16] >> (j < 16 ? 0 : 4)) & 15;
        v = ((low | static_cast<int>(((qh >> j) & 1) << 4)) - 16) * half_at(p);
        break;
      }
      case kTQ8_0:
        v = static_cast<int8_t>(p[2 + j]) * half_at(p);
        break;
      case kTQ4_K:
      case kTQ5_K: {
        const bool five = type == kTQ5_K;
        const int sub = j / 32, chunk = j / 64, half = sub % 2, l = j % 32;
        const uint8_t* qs = p + (five ? 48 : 16);
        int q = (qs[chunk * 32 + l] >> (4 * half)) & 15;
        if (five && ((p[16 + l] >> sub) & 1)) q += 16;
        v = half_at(p) * k_scale(p + 4, sub, 0) * q - half_at(p + 2) * k_scale(p + 4, sub, 1);
        break;
      }
      case kTQ6_K: {
        const int n = j / 128, r = j % 128, quarter = r / 32, l = r % 32;
        const uint8_t ql = p[n * 64 + l + (quarter % 2) * 32];
        const int low = quarter < 2 ? (ql & 15) : (ql >> 4);
        const int high = (p[128 + n * 32 + l] >> (2 * quarter)) & 3;
        const int scale = static_cast<int8_t>(p[192 + n * 8 + l / 16 + 2 * quarter]);
        v = half_at(p + 208) * scale * ((low | (high << 4)) - 32);
        break;
      }
      case kTMXFP4:
        v = std::ldexp(e2m1_value((p[1 + j % 16] >> (j < 16 ? 0 : 4)) & 15), p[0] - 127);
        break;
      default:
        break;
    }
    out[static_cast<size_t>(i)] = static_cast<float>(v);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// compressed-tensors

std::vector<int32_t> pack_int4_words(const std::vector<int8_t>& values, int64_t rows,
                                     int64_t cols) {
  const int64_t words = (cols + 7) / 8;
  std::vector<int32_t> out(static_cast<size_t>(rows * words), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t u = static_cast<uint32_t>(values[static_cast<size_t>(r * cols + c)] + 8);
      uint32_t& w = reinterpret_cast<uint32_t&>(out[static_cast<size_t>(r * words + c / 8)]);
      w |= u << (4 * (c % 8));
    }
  return out;
}

void CtWriter::write(const std::string& folder) const {
  fs::create_directories(folder);
  {
    std::ofstream out(fs::path(folder) / "config.json");
    out << config.dump(2);
  }
  std::vector<w4a8moe::io::SafetensorsWriter> writers(static_cast<size_t>(shards));
  nlohmann::json map = nlohmann::json::object();
  size_t i = 0;
  const auto file_name = [&](int k) {
    if (shards == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", k + 1, shards);
    return std::string(buf);
  };
  for (const auto& [name, t] : tensors) {
    const int k = static_cast<int>(i++ % static_cast<size_t>(shards));
    writers[static_cast<size_t>(k)].add(name, t.dtype, t.shape, t.bytes.data(), t.bytes.size());
    map[name] = file_name(k);
  }
  for (int k = 0; k < shards; ++k)
    writers[static_cast<size_t>(k)].write((fs::path(folder) / file_name(k)).string());
  if (shards > 1) {
    std::ofstream out(fs::path(folder) / "model.safetensors.index.json");
    out << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump(2);
  }
}

// ---------------------------------------------------------------------------------------------
// Models

Moe make_moe(int64_t H, int64_t I, int64_t E, int64_t K, uint64_t seed) {
  Moe m;
  m.H = H;
  m.I = I;
  m.E = E;
  m.K = K;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> s(1.5, 3.5);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto scale = [&](int64_t k) {
    return from_bf16(
        bf16_bits(static_cast<float>(s(rng) / (8.0 * std::sqrt(static_cast<double>(k))))));
  };
  // int4 values from a cheap generator (splitmix64, 16 values per draw): large models stay quick
  uint64_t state = seed;
  const auto fill = [&](std::vector<int8_t>& values) {
    uint64_t bits = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      if (i % 16 == 0) {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        bits = z ^ (z >> 31);
      }
      values[i] = static_cast<int8_t>(static_cast<int>(bits & 15) - 8);
      bits >>= 4;
    }
  };
  m.w13.resize(static_cast<size_t>(E * 2 * I * H));
  fill(m.w13);
  m.w13_s.resize(static_cast<size_t>(E * 2 * I * (H / m.group)));
  for (float& v : m.w13_s) v = scale(H);
  m.w2.resize(static_cast<size_t>(E * H * I));
  fill(m.w2);
  m.w2_s.resize(static_cast<size_t>(E * H * (I / m.group)));
  for (float& v : m.w2_s) v = scale(I);
  m.router.resize(static_cast<size_t>(E * H));
  for (float& v : m.router)
    v = static_cast<float>(normal(rng) * 1.5 / std::sqrt(static_cast<double>(H)));
  return m;
}

std::vector<int8_t> rows_of(const Moe& m, int which, int64_t e) {
  const int64_t rows = which == 2 ? m.H : m.I, cols = which == 2 ? m.I : m.H;
  const std::vector<int8_t>& src = which == 2 ? m.w2 : m.w13;
  const int64_t first = which == 2 ? e * m.H : e * 2 * m.I + (which == 1 ? m.I : 0);
  return std::vector<int8_t>(src.begin() + first * cols, src.begin() + (first + rows) * cols);
}

std::vector<float> scales_of(const Moe& m, int which, int64_t e) {
  const int64_t rows = which == 2 ? m.H : m.I, cols = which == 2 ? m.I : m.H;
  const int64_t groups = cols / m.group;
  const std::vector<float>& src = which == 2 ? m.w2_s : m.w13_s;
  const int64_t first = which == 2 ? e * m.H : e * 2 * m.I + (which == 1 ? m.I : 0);
  return std::vector<float>(src.begin() + first * groups, src.begin() + (first + rows) * groups);
}

std::vector<int8_t> zero_points_of(const Moe& m, int which, int64_t e) {
  const int64_t rows = which == 2 ? m.H : m.I;
  const std::vector<int8_t>& src = which == 2 ? m.w2_z : m.w13_z;
  const int64_t groups = static_cast<int64_t>(src.size()) / (m.E * (which == 2 ? m.H : 2 * m.I));
  const int64_t first = which == 2 ? e * m.H : e * 2 * m.I + (which == 1 ? m.I : 0);
  return std::vector<int8_t>(src.begin() + first * groups, src.begin() + (first + rows) * groups);
}

std::vector<uint8_t> q4_0_tensor(const Moe& m, int which) {
  std::vector<uint8_t> out;
  for (int64_t e = 0; e < m.E; ++e) {
    const std::vector<int8_t> v = rows_of(m, which, e);
    const std::vector<float> s = scales_of(m, which, e);
    std::vector<uint8_t> q(v.size());
    for (size_t i = 0; i < v.size(); ++i) q[i] = static_cast<uint8_t>(v[i] + 8);
    std::vector<uint16_t> d(s.size());
    for (size_t i = 0; i < s.size(); ++i) d[i] = f16_bits(s[i]);
    const std::vector<uint8_t> blocks = encode_q4_0(q, d);
    append_bytes(out, blocks);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Model files

namespace {

// Expert tensor `which` of layer m as `type`; records the values the file holds.
std::vector<uint8_t> expert_tensor(const Moe& m, int which, uint32_t type, uint64_t seed,
                                   std::vector<float>& values) {
  const int64_t rows = which == 2 ? m.H : m.I, cols = which == 2 ? m.I : m.H;
  const int64_t n = m.E * rows * cols;
  if (type == kTQ4_0) return q4_0_tensor(m, which);
  if (type == kTF32 || type == kTF16 || type == kTBF16) {
    // uniform in [-sqrt(3), sqrt(3)) (unit variance) from a cheap generator: the large files of
    // the streaming test stay quick to make
    uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
    values.resize(static_cast<size_t>(n));
    const float scale = 0.25f / std::sqrt(static_cast<float>(cols));
    for (float& v : values) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>(state >> 40) * 0x1p-24f;  // [0, 1)
      v = (u * 2.0f - 1.0f) * 1.7320508f * scale;
    }
    if (type == kTF32) return encode_f32(values);
    for (float& v : values) v = type == kTF16 ? from_f16(f16_bits(v)) : from_bf16(bf16_bits(v));
    return type == kTF16 ? encode_f16(values) : encode_bf16(values);
  }
  if (type == kTIQ2_XXS) return std::vector<uint8_t>(static_cast<size_t>(n / 256 * 66), 0);
  std::vector<uint8_t> bytes = random_blocks(type, n, seed);
  values = decode_blocks(type, bytes, n);
  return bytes;
}

}  // namespace

GgufModel make_gguf(const GgufSpec& s) {
  GgufModel g;
  GgufWriter& w = g.writer;
  const std::string a = s.arch;
  w.kv_string("general.architecture", a);
  w.kv_string("general.name", "w4a8moe test model");
  w.kv_u32(a + ".block_count", static_cast<uint32_t>(s.layers));
  w.kv_u32(a + ".expert_count",
           static_cast<uint32_t>(s.expert_count_meta != 0 ? s.expert_count_meta : s.E));
  w.kv_u32(a + ".expert_used_count", static_cast<uint32_t>(s.K));
  w.kv_u32(a + ".embedding_length", static_cast<uint32_t>(s.H));
  w.kv_u32(a + ".expert_feed_forward_length", static_cast<uint32_t>(s.I));
  w.kv_strings("tokenizer.ggml.tokens", {"<s>", "</s>", "hello", ""});
  for (int l = 0; l < s.layers; ++l) {
    Moe m = make_moe(s.H, s.I, s.E, s.K, 100 + static_cast<uint64_t>(l));
    const std::string blk = "blk." + std::to_string(l) + ".";
    w.tensor(blk + "ffn_gate_inp.weight", kTF32, {s.H, s.E}, encode_f32(m.router));
    std::mt19937_64 rng(7 + static_cast<uint64_t>(l));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (s.router_bias) {
      for (int64_t e = 0; e < s.E; ++e) m.router_bias.push_back(normal(rng) * 0.5f);
      w.tensor(blk + "ffn_gate_inp.bias", kTF32, {s.E}, encode_f32(m.router_bias));
    }
    if (s.selection_bias) {
      for (int64_t e = 0; e < s.E; ++e) m.selection_bias.push_back(normal(rng) * 0.1f);
      w.tensor(blk + "exp_probs_b.bias", kTF32, {s.E}, encode_f32(m.selection_bias));
    }
    static const char* const names[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (int which = 0; which < 3; ++which) {
      std::vector<float> values;
      const std::vector<int64_t> ne =
          which == 2 ? std::vector<int64_t>{s.I, s.H, s.E} : std::vector<int64_t>{s.H, s.I, s.E};
      w.tensor(
          blk + names[which] + ".weight", s.types[which], ne,
          expert_tensor(m, which, s.types[which],
                        1000 * static_cast<uint64_t>(l) + static_cast<uint64_t>(which), values));
      g.floats[which].push_back(values);
    }
    if (s.expert_bias) {
      std::vector<float> b13, b2;
      for (int64_t i = 0; i < s.E * 2 * s.I; ++i) b13.push_back(normal(rng) * 0.5f);
      for (int64_t i = 0; i < s.E * s.H; ++i) b2.push_back(normal(rng) * 0.5f);
      std::vector<float> gate, up;
      for (int64_t e = 0; e < s.E; ++e)
        for (int64_t r = 0; r < 2 * s.I; ++r)
          (r < s.I ? gate : up).push_back(b13[static_cast<size_t>(e * 2 * s.I + r)]);
      w.tensor(blk + "ffn_gate_exps.bias", kTF32, {s.I, s.E}, encode_f32(gate));
      w.tensor(blk + "ffn_up_exps.bias", kTF32, {s.I, s.E}, encode_f32(up));
      w.tensor(blk + "ffn_down_exps.bias", kTF32, {s.H, s.E}, encode_f32(b2));
      m.b13 = b13;
      m.b2 = b2;
    }
    if (s.shared_expert) {
      const int64_t Is = s.Is != 0 ? s.Is : 2 * s.I;
      Moe sh = make_moe(s.H, Is, 1, 1, 300 + static_cast<uint64_t>(l));
      static const char* const shexp[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
      for (int which = 0; which < 3; ++which) {
        std::vector<float> values;
        const std::vector<int64_t> ne =
            which == 2 ? std::vector<int64_t>{Is, s.H} : std::vector<int64_t>{s.H, Is};
        w.tensor(
            blk + shexp[which] + ".weight", s.shared_types[which], ne,
            expert_tensor(sh, which, s.shared_types[which],
                          5000 + 1000 * static_cast<uint64_t>(l) + static_cast<uint64_t>(which),
                          values));
        g.shared_floats[which].push_back(values);
      }
      if (s.shared_gate)
        w.tensor(blk + "ffn_gate_inp_shexp.weight", kTF32, {s.H}, encode_f32(sh.router));
      g.shared.push_back(std::move(sh));
    }
    g.layers.push_back(std::move(m));
  }
  if (s.shared_expert)
    w.kv_u32(a + ".expert_shared_feed_forward_length",
             static_cast<uint32_t>(s.Is != 0 ? s.Is : 2 * s.I));
  return g;
}

std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_bits(v[i]);
  return out;
}

// One module's GPTQ or AWQ tensors from int4 values v [rows, cols] in [-8, 7], scales and zero
// points (in [-8, 7]; symmetric: all 0) [rows, groups], packed as AutoGPTQ's and AutoAWQ's
// pack() write them: GPTQ qweight [cols/8, rows] eight inputs a word (input 8i + j in bits 4j),
// AWQ qweight [cols, rows/8] eight outputs a word in the order 0 2 4 6 1 3 5 7 (bits 4i hold
// output 8w + order[i]); qzeros [groups, rows/8] packed like the outputs, GPTQ's "gptq" format
// storing zero - 1; scales F16 [groups, rows]; GPTQ's g_idx [cols] as given (act-order), else
// k / group size.
void add_gptq_module(CtWriter& w, const std::string& p, bool awq, bool zeros_minus_one,
                     const std::vector<int8_t>& v, const std::vector<float>& sc,
                     const std::vector<int8_t>& z, int64_t rows, int64_t cols, int64_t groups,
                     const std::vector<int32_t>& g_idx_given) {
  constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  const auto u = [](int8_t x) { return static_cast<uint32_t>(x + 8); };
  std::vector<uint32_t> qweight(static_cast<size_t>(rows * cols / 8), 0);
  if (!awq) {
    for (int64_t i = 0; i < cols / 8; ++i)
      for (int64_t n = 0; n < rows; ++n)
        for (int j = 0; j < 8; ++j)
          qweight[static_cast<size_t>(i * rows + n)] |=
              u(v[static_cast<size_t>(n * cols + 8 * i + j)]) << (4 * j);
  } else {
    for (int64_t k = 0; k < cols; ++k)
      for (int64_t c = 0; c < rows / 8; ++c)
        for (int i = 0; i < 8; ++i)
          qweight[static_cast<size_t>(k * (rows / 8) + c)] |=
              u(v[static_cast<size_t>((8 * c + kAwqOrder[i]) * cols + k)]) << (4 * i);
  }
  std::vector<uint32_t> qzeros(static_cast<size_t>(groups * rows / 8), 0);
  for (int64_t b = 0; b < groups; ++b)
    for (int64_t c = 0; c < rows / 8; ++c)
      for (int i = 0; i < 8; ++i) {
        const int64_t n = 8 * c + (awq ? kAwqOrder[i] : i);
        const uint32_t stored =
            u(z[static_cast<size_t>(n * groups + b)]) - (zeros_minus_one ? 1 : 0);
        qzeros[static_cast<size_t>(b * (rows / 8) + c)] |= (stored & 15u) << (4 * i);
      }
  std::vector<uint16_t> scales(static_cast<size_t>(groups * rows));
  for (int64_t b = 0; b < groups; ++b)
    for (int64_t n = 0; n < rows; ++n)
      scales[static_cast<size_t>(b * rows + n)] = f16_bits(sc[static_cast<size_t>(n * groups + b)]);
  w.add(p + "qweight", DType::i32,
        awq ? std::vector<int64_t>{cols, rows / 8} : std::vector<int64_t>{cols / 8, rows}, qweight);
  w.add(p + "qzeros", DType::i32, {groups, rows / 8}, qzeros);
  w.add(p + "scales", DType::f16, {groups, rows}, scales);
  if (!awq) {
    std::vector<int32_t> g_idx = g_idx_given;
    if (g_idx.empty())
      for (int64_t k = 0; k < cols; ++k) g_idx.push_back(static_cast<int32_t>(k / (cols / groups)));
    w.add(p + "g_idx", DType::i32, {cols}, g_idx);
  }
}

namespace {

// Values of unit-ish variance scaled by `scale`, exact in `dtype` (bf16, f16 or f32).
std::vector<float> random_dense(int64_t n, float scale, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& x : w) {
    x = normal(rng) * scale;
    if (dtype == DType::bf16) x = from_bf16(bf16_bits(x));
    if (dtype == DType::f16) x = from_f16(f16_bits(x));
  }
  return w;
}

void add_dense(CtWriter& writer, const std::string& name, DType dtype, std::vector<int64_t> shape,
               const std::vector<float>& values) {
  if (dtype == DType::f32) {
    writer.add(name, dtype, std::move(shape), values);
  } else {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i)
      bits[i] = dtype == DType::bf16 ? bf16_bits(values[i]) : f16_bits(values[i]);
    writer.add(name, dtype, std::move(shape), bits);
  }
}

// The experts of layer m fused as transformers' GptOssExperts / Llama4TextExperts hold them:
// gate_up_proj [E, H, 2I] (x @ W; column 2j / 2j + 1 for gpt-oss, j / I + j for Llama-4),
// down_proj [E, I, H], as bf16 or MXFP4 blocks and scales [E, out, in/32, (16)].
void write_fused(CtModel& c, const CtSpec& s, Moe& m, const std::string& block,
                 std::mt19937_64& rng) {
  const int64_t H = s.H, I = s.I, E = s.E;
  const bool interleaved = s.model_type == "gpt_oss";
  const auto column = [&](int which, int64_t r) {
    return which == 2 ? r : interleaved ? 2 * r + which : which * I + r;
  };
  const std::string experts = block + "experts.";
  if (s.fused == "bf16") {
    std::vector<float> gate_up(static_cast<size_t>(E * H * 2 * I)),
        down(static_cast<size_t>(E * I * H));
    for (int64_t e = 0; e < E; ++e)
      for (int which = 0; which < 3; ++which) {
        const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
        const std::vector<float> w =
            random_dense(rows * cols, 1.5f / std::sqrt(static_cast<float>(cols)), DType::bf16, rng);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t k = 0; k < cols; ++k) {
            const float v = w[static_cast<size_t>(r * cols + k)];
            if (which == 2)
              down[static_cast<size_t>((e * I + k) * H + r)] = v;
            else
              gate_up[static_cast<size_t>((e * H + k) * 2 * I + column(which, r))] = v;
          }
        c.dense.push_back(w);
      }
    add_dense(c.writer, experts + "gate_up_proj", DType::bf16, {E, H, 2 * I}, gate_up);
    add_dense(c.writer, experts + "down_proj", DType::bf16, {E, I, H}, down);
  } else {
    // MXFP4: per output row, blocks of 32 inputs: 16 bytes (element 2b low nibble, 2b + 1 high)
    // and a scale byte (2^(scale - 127)), around 0.5 / sqrt(in) per element
    std::vector<uint8_t> blocks[2], scales[2];
    blocks[0].resize(static_cast<size_t>(E * 2 * I * H / 2));
    scales[0].resize(static_cast<size_t>(E * 2 * I * H / 32));
    blocks[1].resize(static_cast<size_t>(E * H * I / 2));
    scales[1].resize(static_cast<size_t>(E * H * I / 32));
    for (int64_t e = 0; e < E; ++e)
      for (int which = 0; which < 3; ++which) {
        const int64_t rows = which == 2 ? H : I, cols = which == 2 ? I : H;
        const int64_t outs = which == 2 ? H : 2 * I, G = cols / 32;
        const int base =
            127 +
            static_cast<int>(std::lround(std::log2(0.5 / std::sqrt(static_cast<double>(cols)))));
        std::vector<uint8_t>& bl = blocks[which == 2 ? 1 : 0];
        std::vector<uint8_t>& sc = scales[which == 2 ? 1 : 0];
        std::vector<float> w(static_cast<size_t>(rows * cols));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = e * outs + column(which, r);
          for (int64_t g = 0; g < G; ++g) {
            const int scale = base - 1 + static_cast<int>(rng() % 3);
            sc[static_cast<size_t>(row * G + g)] = static_cast<uint8_t>(scale);
            for (int64_t b = 0; b < 16; ++b) {
              const int lo = static_cast<int>(rng() % 16), hi = static_cast<int>(rng() % 16);
              bl[static_cast<size_t>((row * G + g) * 16 + b)] = static_cast<uint8_t>(lo | hi << 4);
              w[static_cast<size_t>(r * cols + g * 32 + 2 * b)] =
                  static_cast<float>(std::ldexp(e2m1_value(lo), scale - 127));
              w[static_cast<size_t>(r * cols + g * 32 + 2 * b + 1)] =
                  static_cast<float>(std::ldexp(e2m1_value(hi), scale - 127));
            }
          }
        }
        c.dense.push_back(w);
      }
    c.writer.add(experts + "gate_up_proj_blocks", DType::u8, {E, 2 * I, H / 32, 16}, blocks[0]);
    c.writer.add(experts + "gate_up_proj_scales", DType::u8, {E, 2 * I, H / 32}, scales[0]);
    c.writer.add(experts + "down_proj_blocks", DType::u8, {E, H, I / 32, 16}, blocks[1]);
    c.writer.add(experts + "down_proj_scales", DType::u8, {E, H, I / 32}, scales[1]);
  }
  if (s.expert_bias) {
    const std::vector<float> b13 = random_dense(E * 2 * I, 0.5f, DType::bf16, rng);
    const std::vector<float> b2 = random_dense(E * H, 0.5f, DType::bf16, rng);
    std::vector<float> gate_up_bias(b13.size());
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < 2 * I; ++r)  // b13 rows: gate then up
        gate_up_bias[static_cast<size_t>(e * 2 * I + column(r < I ? 0 : 1, r % I))] =
            b13[static_cast<size_t>(e * 2 * I + r)];
    add_dense(c.writer, experts + "gate_up_proj_bias", DType::bf16, {E, 2 * I}, gate_up_bias);
    add_dense(c.writer, experts + "down_proj_bias", DType::bf16, {E, H}, b2);
    m.b13 = b13;
    m.b2 = b2;
  }
}

}  // namespace

CtModel make_ct(const CtSpec& s) {
  CtModel c;
  const bool llama4 = s.model_type == "llama4", gpt_oss = s.model_type == "gpt_oss";
  json cfg = json::object();
  cfg["model_type"] = llama4 ? "llama4_text" : s.model_type;
  cfg["hidden_size"] = s.H;
  cfg["num_experts_per_tok"] = s.K;
  cfg["num_hidden_layers"] = s.layers;
  cfg["hidden_act"] = "silu";
  const int64_t Is = s.Is != 0 ? s.Is : 2 * s.I;
  if (s.model_type == "mixtral" || s.model_type == "olmoe" || gpt_oss || llama4) {
    cfg["intermediate_size"] = s.I;
  } else {
    cfg["moe_intermediate_size"] = s.I;
    cfg["intermediate_size"] = 4 * s.I;  // the dense layers' size: must not be taken
  }
  if (s.model_type == "mixtral" || gpt_oss || llama4) {
    cfg["num_local_experts"] = s.E;
  } else if (s.model_type.rfind("deepseek", 0) == 0) {
    cfg["n_routed_experts"] = s.E;
  } else {
    cfg["num_experts"] = s.E;
  }
  if (gpt_oss) cfg["swiglu_limit"] = 7.0;
  if (s.shared == "shared_experts") cfg["n_shared_experts"] = Is / s.I;
  if (s.shared == "shared_expert" && !llama4) cfg["shared_expert_intermediate_size"] = Is;
  if (s.model_type == "qwen3_moe") cfg["norm_topk_prob"] = true;
  const bool dense = s.scheme == "bf16" || s.scheme == "f16" || s.scheme == "f32";
  if (s.fused == "mxfp4") {
    cfg["quantization_config"] = {{"quant_method", "mxfp4"},
                                  {"modules_to_not_convert", {"model.layers.*.self_attn"}}};
  } else if (s.scheme == "gptq") {
    cfg["quantization_config"] = {{"quant_method", "gptq"},
                                  {"bits", 4},
                                  {"group_size", s.strategy == "group" ? 32 : -1},
                                  {"desc_act", s.act_order},
                                  {"sym", !s.asymmetric},
                                  {"static_groups", false},
                                  {"true_sequential", true},
                                  {"damp_percent", 0.01},
                                  {"checkpoint_format", s.gptq_format}};
  } else if (s.scheme == "awq") {
    cfg["quantization_config"] = {{"quant_method", "awq"},
                                  {"bits", 4},
                                  {"group_size", s.strategy == "group" ? 32 : -1},
                                  {"zero_point", true},
                                  {"version", "gemm"},
                                  {"modules_to_not_convert", nullptr}};
  } else if (!dense) {
    json weights = {{"num_bits", 4},
                    {"type", "int"},
                    {"symmetric", !s.asymmetric},
                    {"strategy", s.strategy},
                    {"dynamic", false},
                    {"actorder", s.act_order ? json("group") : json(nullptr)}};
    weights["group_size"] = s.strategy == "group" ? json(32) : json(nullptr);
    cfg["quantization_config"] = {
        {"quant_method", "compressed-tensors"},
        {"format", s.scheme == "packed" ? "pack-quantized" : "int-quantized"},
        {"config_groups",
         {{"group_0",
           {{"targets", {"Linear"}},
            {"weights", weights},
            {"input_activations",
             {{"num_bits", 8},
              {"type", "int"},
              {"symmetric", false},
              {"dynamic", true},
              {"strategy", "token"}}}}}}},
        {"ignore", {"lm_head", "re:.*mlp.gate$"}}};
  }
  if (llama4) {  // the multimodal config: the language model's keys in text_config
    json root = {{"model_type", "llama4"}, {"text_config", cfg}};
    if (cfg.contains("quantization_config")) {
      root["quantization_config"] = cfg["quantization_config"];
      root["text_config"].erase("quantization_config");
    }
    c.writer.config = root;
  } else {
    c.writer.config = cfg;
  }
  c.writer.shards = s.shards;
  const char* const hf[3] = {"gate_proj", "up_proj", "down_proj"};
  const char* const mx[3] = {"w1", "w3", "w2"};
  for (int l = 0; l < s.layers; ++l) {
    Moe m = make_moe(s.H, s.I, s.E, s.K, 500 + static_cast<uint64_t>(l));
    Moe sh = make_moe(s.H, Is, 1, 1, 800 + static_cast<uint64_t>(l));
    if (s.strategy == "channel") {  // one scale per row: the first group's
      for (Moe* t : {&m, &sh}) {
        std::vector<float> r13, r2;
        for (size_t r = 0; r < t->w13_s.size(); r += static_cast<size_t>(t->H / 32))
          r13.push_back(t->w13_s[r]);
        for (size_t r = 0; r < t->w2_s.size(); r += static_cast<size_t>(t->I / 32))
          r2.push_back(t->w2_s[r]);
        t->w13_s = r13;
        t->w2_s = r2;
      }
    }
    if (s.asymmetric || s.scheme == "awq") {  // zero points over [-8, 7], the extremes included
      // ("gptq" stores zero - 1 in four bits: a zero of 0, -8 here, does not fit)
      const int lowest = s.scheme == "gptq" && s.gptq_format == "gptq" ? -7 : -8;
      std::mt19937_64 zrng(700 + static_cast<uint64_t>(l));
      std::uniform_int_distribution<int> z(lowest, 7);
      for (Moe* t : {&m, &sh}) {
        t->w13_z.resize(t->w13_s.size());
        t->w2_z.resize(t->w2_s.size());
        for (std::vector<int8_t>* v : {&t->w13_z, &t->w2_z})
          for (size_t i = 0; i < v->size(); ++i)
            (*v)[i] = static_cast<int8_t>(i < 2 ? (i == 0 ? lowest : 7) : z(zrng));
      }
    }
    if (s.act_order) {  // GPTQ's: a random order of the inputs, g consecutive ones per group
      std::mt19937_64 orng(900 + static_cast<uint64_t>(l));
      for (Moe* t : {&m, &sh})
        for (auto [g_idx, cols] : {std::pair{&t->g13, t->H}, std::pair{&t->g2, t->I}}) {
          g_idx->resize(static_cast<size_t>(t->E * cols));
          std::vector<int32_t> perm(static_cast<size_t>(cols));
          for (int64_t e = 0; e < t->E; ++e) {
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), orng);
            for (int64_t i = 0; i < cols; ++i)
              (*g_idx)[static_cast<size_t>(e * cols + perm[static_cast<size_t>(i)])] =
                  static_cast<int32_t>(i / 32);
          }
        }
    }
    const std::string block = (llama4 ? "language_model.model.layers." : "model.layers.") +
                              std::to_string(l) +
                              (s.mixtral_names ? ".block_sparse_moe."
                               : llama4        ? ".feed_forward."
                                               : ".mlp.");
    const std::string router = block + (gpt_oss || llama4 ? "router." : "gate.");
    for (float& v : m.router) v = from_bf16(bf16_bits(v));
    c.writer.add(router + "weight", DType::bf16, {s.E, s.H}, bf16_of(m.router));
    std::mt19937_64 rng(9 + static_cast<uint64_t>(l));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (s.model_type == "deepseek_v3") {
      for (int64_t e = 0; e < s.E; ++e) m.selection_bias.push_back(normal(rng) * 0.1f);
      c.writer.add(block + "gate.e_score_correction_bias", DType::f32, {s.E}, m.selection_bias);
    }
    if (s.router_bias) {
      m.router_bias = random_dense(s.E, 0.5f, DType::bf16, rng);
      add_dense(c.writer, router + "bias", DType::bf16, {s.E}, m.router_bias);
    }
    // One module (an expert's or the shared expert's projection) in the checkpoint's scheme.
    const auto write_module = [&](const std::string& p, const Moe& t, int64_t e, int which,
                                  const std::string& scheme, std::vector<std::vector<float>>& out) {
      const int64_t rows = which == 2 ? t.H : t.I, cols = which == 2 ? t.I : t.H;
      const std::vector<int8_t> v = rows_of(t, which, e);
      if (scheme == "bf16" || scheme == "f16" || scheme == "f32") {
        const DType d = scheme == "f16" ? DType::f16 : scheme == "f32" ? DType::f32 : DType::bf16;
        const std::vector<float> w =
            random_dense(rows * cols, 1.5f / std::sqrt(static_cast<float>(cols)), d, rng);
        add_dense(c.writer, p + "weight", d, {rows, cols}, w);
        out.push_back(w);
        return;
      }
      std::vector<float> sc;
      if (s.strategy == "channel") {
        const std::vector<float>& src = which == 2 ? t.w2_s : t.w13_s;
        const int64_t first = which == 2 ? e * t.H : e * 2 * t.I + (which == 1 ? t.I : 0);
        sc.assign(src.begin() + first, src.begin() + first + rows);
      } else {
        sc = scales_of(t, which, e);
      }
      if (scheme == "gptq" || scheme == "awq") {
        const int64_t groups = s.strategy == "channel" ? 1 : cols / 32;
        const std::vector<int8_t> z =
            t.w13_z.empty() ? std::vector<int8_t>(static_cast<size_t>(rows * groups), 0)
                            : zero_points_of(t, which, e);
        std::vector<int32_t> g_idx;
        if (s.act_order) {
          const std::vector<int32_t>& all = which == 2 ? t.g2 : t.g13;
          g_idx.assign(all.begin() + e * cols, all.begin() + (e + 1) * cols);
        }
        add_gptq_module(c.writer, p, scheme == "awq", scheme == "gptq" && s.gptq_format == "gptq",
                        v, sc, z, rows, cols, groups, g_idx);
        return;
      }
      if (scheme == "packed") {
        c.writer.add(p + "weight_packed", DType::i32, {rows, cols / 8},
                     pack_int4_words(v, rows, cols));
        c.writer.add(p + "weight_shape", DType::i64, {2}, std::vector<int64_t>{rows, cols});
      } else {
        c.writer.add(p + "weight", DType::i8, {rows, cols}, v);
      }
      const std::vector<int64_t> sshape = s.strategy == "channel"
                                              ? std::vector<int64_t>{rows, 1}
                                              : std::vector<int64_t>{rows, cols / 32};
      c.writer.add(p + "weight_scale", DType::bf16, sshape, bf16_of(sc));
      if (s.act_order) {  // compressed-tensors' weight_g_idx: GPTQ's g_idx
        const std::vector<int32_t>& all = which == 2 ? t.g2 : t.g13;
        c.writer.add(p + "weight_g_idx", DType::i32, {cols},
                     std::vector<int32_t>(all.begin() + e * cols, all.begin() + (e + 1) * cols));
      }
      if (s.asymmetric) {
        const std::vector<int8_t> z = zero_points_of(t, which, e);
        const int64_t groups = sshape[1];
        if (scheme == "packed") {  // pack_to_int32 along dim 0: eight rows a word
          std::vector<int32_t> words(static_cast<size_t>((rows + 7) / 8 * groups), 0);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < groups; ++g) {
              const auto u = static_cast<uint32_t>(z[static_cast<size_t>(r * groups + g)] + 8);
              reinterpret_cast<uint32_t&>(words[static_cast<size_t>((r / 8) * groups + g)]) |=
                  u << (4 * (r % 8));
            }
          c.writer.add(p + "weight_zero_point", DType::i32, {(rows + 7) / 8, groups}, words);
        } else {
          c.writer.add(p + "weight_zero_point", DType::i8, sshape, z);
        }
      }
    };
    if (!s.fused.empty()) {
      write_fused(c, s, m, block, rng);
    } else {
      for (int64_t e = 0; e < s.E; ++e)
        for (int which = 0; which < 3; ++which)
          write_module(block + "experts." + std::to_string(e) + "." +
                           (s.mixtral_names ? mx : hf)[which] + ".",
                       m, e, which, s.scheme, c.dense);
    }
    if (!s.shared.empty()) {
      for (int which = 0; which < 3; ++which)
        write_module(block + s.shared + "." + hf[which] + ".", sh, 0, which,
                     s.fused.empty() ? s.scheme : "bf16", c.shared_dense);
      if (s.shared_gate) {
        for (float& v : sh.router) v = from_bf16(bf16_bits(v));
        c.writer.add(block + "shared_expert_gate.weight", DType::bf16, {1, s.H},
                     bf16_of(sh.router));
      }
    }
    c.layers.push_back(std::move(m));
    c.shared.push_back(std::move(sh));
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Routing reference

void route_reference(const std::vector<float>& logits, int64_t T, int64_t E, int64_t K,
                     const std::vector<float>& selection_bias, const RouteSpec& spec,
                     std::vector<int64_t>& ids, std::vector<double>& weights) {
  ids.assign(static_cast<size_t>(T * K), 0);
  weights.assign(static_cast<size_t>(T * K), 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> l(static_cast<size_t>(E)), score(static_cast<size_t>(E)), sel;
    for (int64_t e = 0; e < E; ++e)
      l[static_cast<size_t>(e)] = static_cast<double>(logits[static_cast<size_t>(t * E + e)]);
    if (spec.gating == "softmax") {
      double mx = -inf, sum = 0;
      for (const double v : l) mx = std::max(mx, v);
      for (size_t e = 0; e < l.size(); ++e) sum += (score[e] = std::exp(l[e] - mx));
      for (double& v : score) v /= sum;
    } else if (spec.gating == "sigmoid") {
      for (size_t e = 0; e < l.size(); ++e) score[e] = 1.0 / (1.0 + std::exp(-l[e]));
    } else {
      score = l;
    }
    sel = score;
    if (!selection_bias.empty())
      for (size_t e = 0; e < sel.size(); ++e) sel[e] += static_cast<double>(selection_bias[e]);
    // NaN -> below everything
    for (double& v : sel)
      if (std::isnan(v)) v = -inf;
    if (spec.groups > 1) {
      const int64_t per = E / spec.groups;
      std::vector<std::pair<double, int64_t>> gs;
      for (int64_t g = 0; g < spec.groups; ++g) {
        std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.begin(), v.end(), std::greater<>());
        gs.push_back({spec.top2 ? v[0] + v[1] : v[0], g});
      }
      std::stable_sort(gs.begin(), gs.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<bool> keep(static_cast<size_t>(spec.groups), false);
      for (int64_t i = 0; i < spec.groups_used; ++i)
        keep[static_cast<size_t>(gs[static_cast<size_t>(i)].second)] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[static_cast<size_t>(e / per)]) sel[static_cast<size_t>(e)] = -inf;
    }
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return sel[static_cast<size_t>(a)] > sel[static_cast<size_t>(b)];
    });
    std::vector<double> w(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k)
      w[static_cast<size_t>(k)] = score[static_cast<size_t>(order[static_cast<size_t>(k)])];
    if (spec.gating == "softmax_topk") {
      double mx = -inf, sum = 0;
      for (const double v : w) mx = std::max(mx, v);
      for (double& v : w) sum += (v = std::exp(v - mx));
      for (double& v : w) v /= sum;
    }
    if (spec.renormalize) {
      double sum = 0;
      for (const double v : w) sum += v;
      for (double& v : w) v /= sum;
    }
    for (int64_t k = 0; k < K; ++k) {
      ids[static_cast<size_t>(t * K + k)] = order[static_cast<size_t>(k)];
      weights[static_cast<size_t>(t * K + k)] = w[static_cast<size_t>(k)] * spec.scaling;
    }
  }
}

std::vector<double> logits_reference(const std::vector<float>& x, const std::vector<float>& router,
                                     const std::vector<float>& bias, int64_t T, int64_t H,
                                     int64_t E) {
  std::vector<double> out(static_cast<size_t>(T * E));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < E; ++e) {
      double acc = bias.empty() ? 0.0 : static_cast<double>(bias[static_cast<size_t>(e)]);
      for (int64_t h = 0; h < H; ++h)
        acc += static_cast<double>(x[static_cast<size_t>(t * H + h)]) *
               static_cast<double>(router[static_cast<size_t>(e * H + h)]);
      out[static_cast<size_t>(t * E + e)] = acc;
    }
  return out;
}

}  // namespace ckpt_test
