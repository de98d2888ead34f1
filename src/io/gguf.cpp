#include "io/gguf.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>

#include "common/format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;

constexpr int kMaxArrayDepth = 4;
constexpr uint32_t kMagic = 0x46554747u;  // "GGUF" read as a little-endian u32

[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw Error(cat("GGUF file '", path, "': ", problem));
}

// A name or string value from the file, cut short (and made printable) for a message.
std::string printable(std::string_view text) {
  constexpr size_t kMaxChars = 60;
  std::string out;
  for (const char c : text.substr(0, kMaxChars)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (text.size() > kMaxChars) out += cat("... (", text.size(), " bytes)");
  return out;
}

// One array element of a number type, as a double.
template <class T>
double number_at(const uint8_t* e) {
  T x;
  std::memcpy(&x, e, sizeof x);
  return static_cast<double>(x);
}

// Per value type, in the specification's numbering: its name, the bytes of one scalar (0:
// strings and arrays, whose size varies) and the reader of an array element (numbers only).
struct TypeInfo {
  const char* name;
  size_t bytes;
  double (*number)(const uint8_t*);
};
constexpr TypeInfo kTypes[] = {{"uint8", 1, number_at<uint8_t>},
                               {"int8", 1, number_at<int8_t>},
                               {"uint16", 2, number_at<uint16_t>},
                               {"int16", 2, number_at<int16_t>},
                               {"uint32", 4, number_at<uint32_t>},
                               {"int32", 4, number_at<int32_t>},
                               {"float32", 4, number_at<float>},
                               {"bool", 1, nullptr},
                               {"string", 0, nullptr},
                               {"array", 0, nullptr},
                               {"uint64", 8, number_at<uint64_t>},
                               {"int64", 8, number_at<int64_t>},
                               {"float64", 8, number_at<double>}};
static_assert(std::size(kTypes) == static_cast<size_t>(GgufType::f64) + 1);

const TypeInfo* type_info(GgufType t) {
  const auto i = static_cast<size_t>(t);
  return i < std::size(kTypes) ? &kTypes[i] : nullptr;
}

size_t scalar_bytes(GgufType t) {
  const TypeInfo* info = type_info(t);
  return info == nullptr ? 0 : info->bytes;
}

bool known_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::f64); }

// Reads the header region with every read checked against the file's end.
class Cursor {
 public:
  Cursor(const std::string& path, std::span<const uint8_t> bytes) : path_(path), bytes_(bytes) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return bytes_.size() - pos_; }

  void need(uint64_t n, const std::string& what) const {
    if (n > remaining())
      fail(path_, cat(what, " (", n, " bytes at byte ", pos_, ") runs past the end of the file (",
                      bytes_.size(), " bytes): the file is truncated or a length is wrong"));
  }
  template <class T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const std::string& what) {
    const uint64_t n = read<uint64_t>(cat("the length of ", what));
    need(n, what);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), static_cast<size_t>(n));
    pos_ += n;
    return s;
  }
  void skip(uint64_t n, const std::string& what) {
    need(n, what);
    pos_ += n;
  }
  // A scalar of number type t (kTypes' reader), as a double.
  double number(GgufType t, const std::string& what) {
    const TypeInfo& info = *type_info(t);
    need(info.bytes, what);
    const double v = info.number(bytes_.data() + pos_);
    pos_ += info.bytes;
    return v;
  }

 private:
  const std::string& path_;
  std::span<const uint8_t> bytes_;
  uint64_t pos_ = 0;
};

GgufType value_type(Cursor& c, const std::string& path, const std::string& what) {
  const uint32_t t = c.read<uint32_t>(cat("the value type of ", what));
  if (!known_type(t))
    fail(path, cat(what, " has an unknown value type ", t, " (GGUF defines 0 to 12)"));
  return static_cast<GgufType>(t);
}

// Skips (checking) `count` elements of type `t`.
void skip_elements(Cursor& c, const std::string& path, GgufType t, uint64_t count,
                   const std::string& what, int depth) {
  if (const size_t size = scalar_bytes(t); size > 0) {
    if (count > c.remaining() / size)
      fail(path, cat(what, " holds ", count, " elements of ", gguf_type_name(t),
                     ", more than the rest of the file (", c.remaining(), " bytes)"));
    c.skip(count * size, what);
    return;
  }
  // strings and arrays take at least 8 bytes each: a count beyond that cannot be real
  if (count > c.remaining() / 8)
    fail(path, cat(what, " holds ", count, " elements of ", gguf_type_name(t),
                   ", more than the rest of the file (", c.remaining(), " bytes) can hold"));
  for (uint64_t i = 0; i < count; ++i) {
    if (t == GgufType::string) {
      const uint64_t n = c.read<uint64_t>(cat("the length of element ", i, " of ", what));
      c.skip(n, cat("element ", i, " of ", what));
    } else {
      if (depth >= kMaxArrayDepth)
        fail(path, cat(what, " nests arrays more than ", kMaxArrayDepth, " deep"));
      const std::string inner = cat("element ", i, " of ", what);
      const GgufType et = value_type(c, path, inner);
      const uint64_t n = c.read<uint64_t>(cat("the element count of ", inner));
      skip_elements(c, path, et, n, inner, depth + 1);
    }
  }
}

GgufValue read_value(Cursor& c, const std::string& path, GgufType t, const std::string& what) {
  GgufValue v;
  v.type = t;
  switch (t) {
    case GgufType::u8:
    case GgufType::i8:
    case GgufType::u16:
    case GgufType::i16:
    case GgufType::u32:
    case GgufType::i32:  // a double holds every 32-bit integer exactly
      v.integer = static_cast<int64_t>(c.number(t, what));
      break;
    case GgufType::u64: {
      const uint64_t u = c.read<uint64_t>(what);
      v.unsigned_big = u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
      v.integer = static_cast<int64_t>(u);
      break;
    }
    case GgufType::i64:
      v.integer = c.read<int64_t>(what);
      break;
    case GgufType::f32:
    case GgufType::f64:
      v.real = c.number(t, what);
      break;
    case GgufType::boolean:
      v.integer = c.read<uint8_t>(what) != 0 ? 1 : 0;
      break;
    case GgufType::string:
      v.text = c.string(what);
      break;
    case GgufType::array: {
      v.element_type = value_type(c, path, cat("the elements of ", what));
      v.count = c.read<uint64_t>(cat("the element count of ", what));
      v.offset = c.pos();
      skip_elements(c, path, v.element_type, v.count, what, 1);
      break;
    }
  }
  return v;
}

uint64_t align_up(uint64_t v, uint64_t a, bool& overflow) {
  uint64_t r;
  overflow = __builtin_add_overflow(v, a - 1, &r);
  return r / a * a;
}

std::string ne_string(const GgufTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.n_dims; ++i) s += cat(i ? ", " : "", t.ne[static_cast<size_t>(i)]);
  return s + "]";
}

}  // namespace

const char* gguf_type_name(GgufType type) noexcept {
  const TypeInfo* info = type_info(type);
  return info == nullptr ? "?" : info->name;
}

bool GgufValue::is_integer() const noexcept {
  switch (type) {
    case GgufType::u8:
    case GgufType::i8:
    case GgufType::u16:
    case GgufType::i16:
    case GgufType::u32:
    case GgufType::i32:
    case GgufType::u64:
    case GgufType::i64:
      return true;
    default:
      return false;
  }
}

GgufFile GgufFile::open(const std::string& path) {
  GgufFile f;
  f.file_ = MappedFile::open(path, "GGUF file");
  const std::span<const uint8_t> bytes = f.file_.bytes();
  Cursor c(f.file_.path(), bytes);
  const std::string& p = f.file_.path();

  if (bytes.size() < 4)
    fail(p, cat("the file is ", bytes.size(), " bytes, too short for a header"));
  const uint32_t magic = c.read<uint32_t>("the magic");
  if (magic != kMagic)
    fail(p, cat("bad magic bytes (expected \"GGUF\", got \"",
                printable(std::string_view(reinterpret_cast<const char*>(bytes.data()), 4)),
                "\"): not a GGUF file"));
  f.version_ = c.read<uint32_t>("the version");
  if (f.version_ != 2 && f.version_ != 3)
    fail(p, cat("unsupported GGUF version ", f.version_, " (this reader takes versions 2 and 3",
                f.version_ > 0xffff ? "; a big-endian file?" : "", ")"));
  const uint64_t n_tensors = c.read<uint64_t>("the tensor count");
  const uint64_t n_kv = c.read<uint64_t>("the metadata count");
  // Each metadata pair takes at least 13 bytes (key length, type, 1-byte value); each tensor
  // info at least 32 (name length, n_dims, one dimension, type, offset).
  if (n_kv > c.remaining() / 13)
    fail(p, cat("metadata count ", n_kv, " cannot fit in the rest of the file (", c.remaining(),
                " bytes)"));
  if (n_tensors > c.remaining() / 32)
    fail(p, cat("tensor count ", n_tensors, " cannot fit in the rest of the file (", c.remaining(),
                " bytes)"));

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.string(cat("the key of metadata pair ", i));
    const std::string what = cat("metadata '", printable(key), "'");
    const GgufType t = value_type(c, p, what);
    GgufValue v = read_value(c, p, t, what);
    if (!f.kv_.emplace(std::move(key), std::move(v)).second) fail(p, cat("duplicate ", what));
  }
  if (const GgufValue* a = f.find("general.alignment")) {
    if (a->type != GgufType::u32)
      fail(p, cat("metadata 'general.alignment' must be a uint32, got ", gguf_type_name(a->type)));
    const auto align = static_cast<uint64_t>(a->integer);
    if (align == 0 || (align & (align - 1)) != 0)
      fail(p, cat("metadata 'general.alignment' must be a power of two, got ", align));
    f.alignment_ = align;
  }

  if (n_tensors > c.remaining() / 32)
    fail(p, cat("tensor count ", n_tensors, " cannot fit in the rest of the file (", c.remaining(),
                " bytes after the metadata)"));
  f.tensors_.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    t.name = c.string(cat("the name of tensor ", i));
    const std::string what = cat("tensor '", printable(t.name), "'");
    const uint32_t n_dims = c.read<uint32_t>(cat("the dimension count of ", what));
    if (n_dims < 1 || n_dims > kGgufMaxDims)
      fail(p, cat(what, " has ", n_dims, " dimensions (expected 1 to ", kGgufMaxDims, ")"));
    t.n_dims = static_cast<int>(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = c.read<uint64_t>(cat("dimension ", d, " of ", what));
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(p, cat(what, " has dimension ", d, " of ", ne, ", beyond 2^63 - 1"));
      t.ne[d] = static_cast<int64_t>(ne);
    }
    t.type = c.read<uint32_t>(cat("the type of ", what));
    t.offset = c.read<uint64_t>(cat("the data offset of ", what));
    const std::optional<GgmlTypeInfo> info = ggml_type_info(t.type);
    if (!info) fail(p, cat(what, " has ", ggml_type_label(t.type), ", which w4a8moe cannot read"));
    if (t.ne[0] % info->block_elems != 0)
      fail(p, cat(what, " of type ", info->name, " has rows of ", t.ne[0],
                  " elements, not a multiple of the type's block of ", info->block_elems));
    uint64_t total = static_cast<uint64_t>(t.ne[0] / info->block_elems);
    bool overflow = __builtin_mul_overflow(total, static_cast<uint64_t>(info->block_bytes), &total);
    uint64_t elements = static_cast<uint64_t>(t.ne[0]);
    for (int d = 1; d < kGgufMaxDims; ++d) {
      overflow = overflow || __builtin_mul_overflow(total, static_cast<uint64_t>(t.ne[d]), &total);
      overflow =
          overflow || __builtin_mul_overflow(elements, static_cast<uint64_t>(t.ne[d]), &elements);
    }
    if (overflow || elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(p, cat(what, " has shape ", ne_string(t), " whose size overflows 64 bits"));
    t.bytes = total;
    if (t.offset % f.alignment_ != 0)
      fail(p, cat(what, " has data offset ", t.offset, ", not a multiple of the alignment ",
                  f.alignment_));
    if (!f.by_name_.emplace(t.name, f.tensors_.size()).second) fail(p, cat("duplicate ", what));
    f.tensors_.push_back(std::move(t));
  }

  bool overflow = false;
  f.data_offset_ = align_up(c.pos(), f.alignment_, overflow);
  if (overflow || f.data_offset_ > bytes.size())
    fail(p, cat("the data section (at byte ", c.pos(), " aligned to ", f.alignment_,
                ") starts past the end of the file (", bytes.size(), " bytes)"));
  const uint64_t data_bytes = bytes.size() - f.data_offset_;
  std::vector<const GgufTensor*> by_offset;
  for (GgufTensor& t : f.tensors_) {
    if (t.offset > data_bytes || t.bytes > data_bytes - t.offset)
      fail(p, cat("tensor '", printable(t.name), "' (", ggml_type_label(t.type), " ", ne_string(t),
                  ", ", t.bytes, " bytes at data offset ", t.offset,
                  ") runs past the end of the file (data section of ", data_bytes,
                  " bytes): the file is truncated or the offset is wrong"));
    t.file_offset = f.data_offset_ + t.offset;
    if (t.bytes > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensor& prev = *by_offset[i - 1];
    const GgufTensor& cur = *by_offset[i];
    if (cur.offset < prev.offset + prev.bytes)
      fail(p, cat("tensor '", printable(cur.name), "' (data bytes ", cur.offset, " to ",
                  cur.offset + cur.bytes, ") overlaps tensor '", printable(prev.name), "' (",
                  prev.offset, " to ", prev.offset + prev.bytes, ")"));
  }
  return f;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  const auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

std::optional<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (!v->is_integer() || v->unsigned_big)
    fail(path(), cat("metadata '", key, "' must be an integer, got ",
                     v->unsigned_big ? "a uint64 beyond 2^63 - 1" : gguf_type_name(v->type)));
  return v->integer;
}

std::optional<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->is_float()) return v->real;
  if (v->is_integer() && !v->unsigned_big) return static_cast<double>(v->integer);
  fail(path(), cat("metadata '", key, "' must be a number, got ", gguf_type_name(v->type)));
}

std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufType::boolean)
    fail(path(), cat("metadata '", key, "' must be a bool, got ", gguf_type_name(v->type)));
  return v->integer != 0;
}

std::optional<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (v->type != GgufType::string)
    fail(path(), cat("metadata '", key, "' must be a string, got ", gguf_type_name(v->type)));
  return v->text;
}

std::optional<std::vector<double>> GgufFile::get_numbers(std::string_view key) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return std::nullopt;
  const size_t size = scalar_bytes(v->element_type);
  if (v->type != GgufType::array || size == 0 || v->element_type == GgufType::boolean)
    fail(path(),
         cat("metadata '", key, "' must be an array of numbers, got ",
             v->type == GgufType::array ? cat("an array of ", gguf_type_name(v->element_type))
                                        : std::string(gguf_type_name(v->type))));
  double (*const number)(const uint8_t*) = type_info(v->element_type)->number;
  std::vector<double> out(static_cast<size_t>(v->count));
  const uint8_t* base = file_.data() + v->offset;
  for (size_t i = 0; i < out.size(); ++i) out[i] = number(base + i * size);
  return out;
}

const GgufTensor* GgufFile::find_tensor(std::string_view name) const {
  const auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensor& GgufFile::tensor(std::string_view name) const {
  const GgufTensor* t = find_tensor(name);
  if (t == nullptr) fail(path(), cat("there is no tensor '", name, "'"));
  return *t;
}

}  // namespace w4a8moe::io
