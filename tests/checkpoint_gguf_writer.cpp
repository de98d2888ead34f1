// The GGUF side of the checkpoint writers (checkpoint_writers.hpp): 16-bit floats by plain bit
// manipulation, the GGUF file writer and gguf-split, and the ggml block encodings written and
// decoded here from the formats' definitions.
#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <stdexcept>

#include "checkpoint_writers.hpp"

namespace ckpt_test {

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

}  // namespace ckpt_test
