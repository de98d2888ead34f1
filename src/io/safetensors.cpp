#include "io/safetensors.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>
#include <nlohmann/json.hpp>
#include <system_error>
#include <utility>

#include "common/format.hpp"

namespace w4a8moe::io {

namespace {

using detail::cat;
using nlohmann::json;

constexpr size_t kBufferAlign = 64;

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"}, {DType::bf16, "BF16"}, {DType::f16, "F16"}, {DType::i8, "I8"},
    {DType::u8, "U8"},   {DType::i32, "I32"},   {DType::i64, "I64"},
};

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// A name or value from the file, cut short for a message.
std::string short_text(std::string_view text) {
  constexpr size_t kMaxChars = 60;
  return text.size() <= kMaxChars ? std::string(text)
                                  : cat(text.substr(0, kMaxChars), "... (", text.size(), " bytes)");
}

// A value for a message: short scalars and flat arrays as JSON text, other values described.
// (Never dump() a nested value: nlohmann's dump recurses, and a hostile header nests deeply.)
std::string json_excerpt(const json& value) {
  constexpr size_t kMaxChars = 40;
  if (value.is_string()) {
    std::string s = value.get<std::string>();
    if (s.size() > kMaxChars) s = s.substr(0, kMaxChars) + "...";
    return json(s).dump(-1, ' ', true, json::error_handler_t::replace);
  }
  if (value.is_array() && value.size() <= kMaxRank &&
      std::all_of(value.begin(), value.end(),
                  [](const json& v) { return v.is_number() || v.is_boolean() || v.is_null(); }))
    return value.dump();
  if (value.is_array()) return cat("an array of ", value.size(), " elements");
  if (value.is_object()) return cat("an object of ", value.size(), " members");
  return value.dump();  // a number, a boolean or null
}

// Thrown as "safetensors file '<path>': <problem>".
[[noreturn]] void fail(const std::string& path, const std::string& problem) {
  throw Error(cat("safetensors file '", path, "': ", problem));
}

// A non-negative JSON integer, or nullopt (floats, negatives, other types).
std::optional<uint64_t> as_count(const json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0)
    return static_cast<uint64_t>(value.get<int64_t>());
  return std::nullopt;
}

struct ParsedEntry {
  std::string name;
  TensorEntry entry;
  uint64_t begin = 0;
};

// Checks one tensor entry of the header against the data region's size.
ParsedEntry parse_entry(const std::string& path, const std::string& name, const json& value,
                        uint64_t data_bytes) {
  const std::string what = cat("tensor '", short_text(name), "'");
  if (!value.is_object())
    fail(path, cat(what, " must be a JSON object, got ", json_excerpt(value)));
  ParsedEntry out;
  out.name = name;

  const auto dtype_it = value.find("dtype");
  if (dtype_it == value.end()) fail(path, cat(what, " has no 'dtype'"));
  if (!dtype_it->is_string())
    fail(path, cat(what, " has a 'dtype' that is not a string: ", json_excerpt(*dtype_it)));
  const std::string& dtype_text = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = parse_safetensors_dtype(dtype_text);
  if (!dtype)
    fail(path, cat(what, " has unsupported dtype '", short_text(dtype_text),
                   "' (w4a8moe reads F32, BF16, F16, I8, U8, I32 and I64)"));
  out.entry.dtype = *dtype;

  const auto shape_it = value.find("shape");
  if (shape_it == value.end()) fail(path, cat(what, " has no 'shape'"));
  if (!shape_it->is_array())
    fail(path, cat(what, " has a 'shape' that is not an array: ", json_excerpt(*shape_it)));
  if (shape_it->size() > kMaxRank)
    fail(path, cat(what, " has rank ", shape_it->size(), ", more than the limit ", kMaxRank));
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& dim : *shape_it) {
    if (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<int64_t>() < 0)
      fail(path, cat(what, " has a negative dimension ", dim.get<int64_t>(), " in its shape ",
                     json_excerpt(*shape_it)));
    const std::optional<uint64_t> n = as_count(dim);
    if (!n)
      fail(path, cat(what, " has a shape dimension that is not an integer: ", json_excerpt(dim)));
    if (*n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail(path, cat(what, " has a shape dimension ", *n, " that is too large"));
    out.entry.shape.push_back(static_cast<int64_t>(*n));
    overflow = overflow || __builtin_mul_overflow(numel, *n, &numel);
  }
  uint64_t size_bytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, dtype_bytes(*dtype), &size_bytes);
  // A zero dimension makes the product 0 whatever overflowed before it.
  const bool has_zero =
      std::find(out.entry.shape.begin(), out.entry.shape.end(), 0) != out.entry.shape.end();
  if (has_zero) {
    size_bytes = 0;
  } else if (overflow || size_bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    fail(path, cat(what, " has shape ", shape_string(out.entry.shape),
                   " whose size in bytes overflows 64 bits"));
  }

  const auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end()) fail(path, cat(what, " has no 'data_offsets'"));
  if (!offsets_it->is_array() || offsets_it->size() != 2)
    fail(path,
         cat(what, " must have 'data_offsets' [begin, end], got ", json_excerpt(*offsets_it)));
  const std::optional<uint64_t> begin = as_count((*offsets_it)[0]);
  const std::optional<uint64_t> end = as_count((*offsets_it)[1]);
  if (!begin || !end)
    fail(path, cat(what, " has 'data_offsets' that are not non-negative integers: ",
                   json_excerpt(*offsets_it)));
  if (*begin > *end)
    fail(path, cat(what, " has data_offsets begin ", *begin, " after its end ", *end));
  if (*end > data_bytes)
    fail(path, cat(what, " has data_offsets end ", *end, " past the end of the data region (",
                   data_bytes, " bytes): the file is truncated or the offsets are wrong"));
  if (*end - *begin != size_bytes)
    fail(path, cat(what, " has data_offsets [", *begin, ", ", *end, "] holding ", *end - *begin,
                   " bytes, but shape ", shape_string(out.entry.shape), " of dtype ", dtype_text,
                   " needs ", size_bytes, " bytes"));
  out.entry.size_bytes = static_cast<size_t>(size_bytes);
  out.begin = *begin;
  return out;
}

Metadata parse_metadata(const std::string& path, const json& value) {
  Metadata out;
  if (value.is_null()) return out;
  if (!value.is_object())
    fail(path, cat("'__metadata__' must be an object of strings, got ", json_excerpt(value)));
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string())
      fail(path,
           cat("metadata '", short_text(key), "' must be a string, got ", json_excerpt(item)));
    out.emplace(key, item.get<std::string>());
  }
  return out;
}

uint8_t* aligned_alloc_bytes(size_t bytes) {
  return static_cast<uint8_t*>(
      ::operator new (std::max<size_t>(bytes, 1), std::align_val_t{kBufferAlign}));
}

// Strict number parsing for metadata values: the whole string, nothing else.
std::optional<int64_t> parse_int(std::string_view text) {
  int64_t value = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  const auto [ptr, ec] = std::from_chars(first, last, value);
  if (text.empty() || ec != std::errc() || ptr != last) return std::nullopt;
  return value;
}

std::optional<float> parse_float(std::string_view text) {
  float value = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  const auto [ptr, ec] = std::from_chars(first, last, value);
  if (text.empty() || ec != std::errc() || ptr != last || !std::isfinite(value))
    return std::nullopt;
  return value;
}

struct ParsedHeader {
  uint64_t data_begin = 0;  // file offset of the data region
  std::vector<ParsedEntry> entries;
  Metadata metadata;
};

using ReadExact = std::function<void(void* dst, uint64_t offset, uint64_t bytes, const char* what)>;

// Reads the header length and the JSON header through `read_exact` and checks every entry
// against the file (shared by the copying reader and the mapped one).
ParsedHeader parse_header(const std::string& path, uint64_t file_bytes,
                          const ReadExact& read_exact) {
  uint8_t length_bytes[8];
  read_exact(length_bytes, 0, 8, "the header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
  if (header_bytes < 2)
    fail(path, cat("header length ", header_bytes, " is too small for a JSON object"));
  if (header_bytes > kMaxHeaderBytes)
    fail(path,
         cat("header length ", header_bytes, " exceeds the limit of ", kMaxHeaderBytes, " bytes"));
  if (header_bytes > file_bytes - 8)
    fail(path, cat("header length ", header_bytes, " runs past the end of the file (", file_bytes,
                   " bytes)"));
  const uint64_t data_begin = 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - data_begin;

  std::string header_text(static_cast<size_t>(header_bytes), '\0');
  read_exact(header_text.data(), 8, header_bytes, "the JSON header");
  // nlohmann stops at a NUL byte as at the end of input: reject it, or the rest would be ignored.
  if (const size_t nul = header_text.find('\0'); nul != std::string::npos)
    fail(path,
         cat("the header is not valid JSON (a NUL byte at byte ", nul, " of ", header_bytes, ")"));
  json header;
  try {
    header = json::parse(header_text);
  } catch (const json::parse_error& e) {
    fail(path,
         cat("the header is not valid JSON (error at byte ", e.byte, " of ", header_bytes, ")"));
  } catch (const json::out_of_range&) {  // found by fuzzing: a number such as 1E400
    fail(path, "the header is not valid JSON (a number out of range)");
  }
  if (!header.is_object())
    fail(path, cat("the header is not a JSON object but ", json_excerpt(header)));

  ParsedHeader out;
  out.data_begin = data_begin;
  std::vector<ParsedEntry>& entries = out.entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      out.metadata = parse_metadata(path, value);
    } else {
      entries.push_back(parse_entry(path, key, value, data_bytes));
    }
  }
  // Tensors may not share bytes (as in the reference implementation): without this check a small
  // file could name the same bytes many times over and make the reader allocate without bound.
  std::vector<const ParsedEntry*> by_offset;
  for (const ParsedEntry& e : entries)
    if (e.entry.size_bytes > 0) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const ParsedEntry* a, const ParsedEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const ParsedEntry& prev = *by_offset[i - 1];
    const ParsedEntry& cur = *by_offset[i];
    if (cur.begin < prev.begin + prev.entry.size_bytes)
      fail(path, cat("tensor '", short_text(cur.name), "' (bytes ", cur.begin, " to ",
                     cur.begin + cur.entry.size_bytes, ") overlaps tensor '", short_text(prev.name),
                     "' (bytes ", prev.begin, " to ", prev.begin + prev.entry.size_bytes,
                     ") in the data region"));
  }
  return out;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) noexcept {
  for (const DTypeName& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  return "?";
}

std::optional<DType> parse_safetensors_dtype(std::string_view name) noexcept {
  for (const DTypeName& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Reader

void SafetensorsFile::AlignedFree::operator()(uint8_t* p) const noexcept {
  ::operator delete (p, std::align_val_t{kBufferAlign});
}

SafetensorsFile SafetensorsFile::read(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) fail(path, "the file does not exist or cannot be accessed");
  if (!fs::is_regular_file(status)) fail(path, "not a regular file");
  const uintmax_t file_bytes = fs::file_size(path, ec);
  if (ec) fail(path, cat("cannot read the file size (", ec.message(), ")"));
  if (file_bytes == 0) fail(path, "the file is empty");
  if (file_bytes < 8)
    fail(path, cat("the file is ", file_bytes, " bytes, shorter than the 8-byte header length"));

  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open the file for reading");
  const auto read_exact = [&](void* dst, uint64_t offset, uint64_t bytes, const char* what) {
    in.seekg(static_cast<std::streamoff>(offset));
    in.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
    if (!in || static_cast<uint64_t>(in.gcount()) != bytes)
      fail(path, cat("could not read ", what, " (", bytes, " bytes at offset ", offset, ")"));
  };

  ParsedHeader parsed = parse_header(path, file_bytes, read_exact);
  SafetensorsFile file;
  file.path_ = path;
  file.metadata_ = std::move(parsed.metadata);
  std::vector<ParsedEntry>& entries = parsed.entries;
  const uint64_t data_begin = parsed.data_begin;
  for (ParsedEntry& e : entries) {
    Tensor tensor;
    tensor.data.reset(aligned_alloc_bytes(e.entry.size_bytes));
    if (e.entry.size_bytes > 0)
      read_exact(tensor.data.get(), data_begin + e.begin, e.entry.size_bytes,
                 cat("the data of tensor '", short_text(e.name), "'").c_str());
    tensor.entry = std::move(e.entry);
    file.tensors_.emplace(std::move(e.name), std::move(tensor));
  }
  return file;
}

const SafetensorsFile::Tensor& SafetensorsFile::find(std::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path_, cat("there is no tensor '", name, "'"));
  return it->second;
}

bool SafetensorsFile::contains(std::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& item : tensors_) out.push_back(item.first);
  return out;
}

const TensorEntry& SafetensorsFile::entry(std::string_view name) const { return find(name).entry; }

std::span<const uint8_t> SafetensorsFile::bytes(std::string_view name) const {
  const Tensor& t = find(name);
  return {t.data.get(), t.entry.size_bytes};
}

TensorView SafetensorsFile::view(std::string_view name) const {
  const Tensor& t = find(name);
  const size_t rank = t.entry.shape.size();
  if (rank < 1 || rank > 3)
    fail(path_, cat("tensor '", name, "' has rank ", rank, " (shape ", shape_string(t.entry.shape),
                    "), but a view needs rank 1 to 3"));
  TensorView v;
  v.data = t.data.get();
  v.dtype = t.entry.dtype;
  v.rank = static_cast<int>(rank);
  std::copy(t.entry.shape.begin(), t.entry.shape.end(), v.shape.begin());
  v.row_stride = 0;
  return v;
}

// ---- memory-mapped reader (checkpoints) ------------------------------------------------------

MappedSafetensors MappedSafetensors::open(const std::string& path) {
  MappedSafetensors out;
  out.file_ = MappedFile::open(path, "safetensors file");
  const uint64_t file_bytes = out.file_.size();
  if (file_bytes == 0) fail(path, "the file is empty");
  if (file_bytes < 8)
    fail(path, cat("the file is ", file_bytes, " bytes, shorter than the 8-byte header length"));
  const uint8_t* base = out.file_.data();
  const auto read_exact = [&](void* dst, uint64_t offset, uint64_t bytes, const char* what) {
    if (offset > file_bytes || bytes > file_bytes - offset)
      fail(path, cat("could not read ", what, " (", bytes, " bytes at offset ", offset, ")"));
    std::memcpy(dst, base + offset, static_cast<size_t>(bytes));
  };
  ParsedHeader parsed = parse_header(path, file_bytes, read_exact);
  out.metadata_ = std::move(parsed.metadata);
  for (ParsedEntry& e : parsed.entries)
    out.tensors_.emplace(std::move(e.name),
                         Tensor{std::move(e.entry), parsed.data_begin + e.begin});
  return out;
}

const MappedSafetensors::Tensor& MappedSafetensors::find(std::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail(path(), cat("there is no tensor '", name, "'"));
  return it->second;
}

bool MappedSafetensors::contains(std::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

std::vector<std::string> MappedSafetensors::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& item : tensors_) out.push_back(item.first);
  return out;
}

const TensorEntry& MappedSafetensors::entry(std::string_view name) const {
  return find(name).entry;
}

std::span<const uint8_t> MappedSafetensors::bytes(std::string_view name) const {
  const Tensor& t = find(name);
  return file_.range(t.offset, t.entry.size_bytes);
}

void MappedSafetensors::release(std::string_view name) const {
  const Tensor& t = find(name);
  file_.release(t.offset, t.entry.size_bytes);
}

// ---------------------------------------------------------------------------------------------
// Writer

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t size_bytes) {
  if (name.empty()) throw Error("safetensors writer: the tensor name must not be empty");
  if (name == "__metadata__")
    throw Error("safetensors writer: the tensor name '__metadata__' is reserved");
  for (const Pending& p : tensors_)
    if (p.name == name)
      throw Error(cat("safetensors writer: a tensor named '", name, "' was already added"));
  if (shape.size() > kMaxRank)
    throw Error(cat("safetensors writer: tensor '", name, "' has rank ", shape.size(),
                    ", more than the limit ", kMaxRank));
  if (!parse_safetensors_dtype(safetensors_dtype_name(dtype)))
    throw Error(cat("safetensors writer: tensor '", name, "' has an unknown dtype code ",
                    static_cast<int>(dtype)));
  uint64_t expected = dtype_bytes(dtype);
  bool overflow = false;
  for (const int64_t d : shape) {
    if (d < 0)
      throw Error(cat("safetensors writer: tensor '", name, "' has a negative dimension in shape ",
                      shape_string(shape)));
    overflow = overflow || __builtin_mul_overflow(expected, static_cast<uint64_t>(d), &expected);
  }
  if (overflow || expected != size_bytes)
    throw Error(cat("safetensors writer: tensor '", name, "' of shape ", shape_string(shape),
                    " and dtype ", safetensors_dtype_name(dtype), " needs ",
                    overflow ? std::string("more than 2^64") : std::to_string(expected),
                    " bytes, got ", size_bytes));
  if (size_bytes > 0 && data == nullptr)
    throw Error(cat("safetensors writer: tensor '", name, "' has no data"));
  Pending p{std::move(name), dtype, std::move(shape), {}};
  if (size_bytes > 0) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    p.bytes.assign(bytes, bytes + size_bytes);
  }
  tensors_.push_back(std::move(p));
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  // Largest elements first, then by name: offsets stay multiples of the element size without
  // holes between tensors (readers such as the reference implementation reject holes).
  std::vector<const Pending*> order;
  for (const Pending& p : tensors_) order.push_back(&p);
  std::sort(order.begin(), order.end(), [](const Pending* a, const Pending* b) {
    const size_t ea = dtype_bytes(a->dtype), eb = dtype_bytes(b->dtype);
    return ea != eb ? ea > eb : a->name < b->name;
  });

  json header = json::object();
  if (!metadata_.empty()) {
    json meta = json::object();
    for (const auto& [key, value] : metadata_) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const Pending* p : order) {
    const uint64_t end = offset + p->bytes.size();
    header[p->name] = {{"dtype", safetensors_dtype_name(p->dtype)},
                       {"shape", p->shape},
                       {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + offset);
  const uint64_t header_bytes = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(header_bytes >> (8 * i)));
  out.insert(out.end(), text.begin(), text.end());
  for (const Pending* p : order) out.insert(out.end(), p->bytes.begin(), p->bytes.end());
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  namespace fs = std::filesystem;
  const std::vector<uint8_t> bytes = serialize();
  static std::atomic<unsigned> counter{0};
  const std::string temp = cat(path, ".tmp.", ::getpid(), ".", counter++);
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error(cat("safetensors writer: cannot create '", temp, "'"));
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      std::error_code ignored;
      fs::remove(temp, ignored);
      throw Error(cat("safetensors writer: cannot write ", bytes.size(), " bytes to '", temp, "'"));
    }
  }
  std::error_code ec;
  fs::rename(temp, path, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error(
        cat("safetensors writer: cannot rename '", temp, "' to '", path, "' (", ec.message(), ")"));
  }
}

// ---------------------------------------------------------------------------------------------
// Case loader

namespace {

[[noreturn]] void case_fail(const std::string& path, const std::string& problem) {
  throw Error(cat("case file '", path, "': ", problem));
}

bool is_float(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f16; }

// A view of a required (or, with `optional`, possibly absent) tensor, checked for rank and
// dtype class.
TensorView case_tensor(const SafetensorsFile& file, const char* name,
                       std::initializer_list<int> ranks, const char* dtypes_text,
                       bool (*dtype_ok)(DType), bool optional = false) {
  if (!file.contains(name)) {
    if (optional) return {};
    case_fail(file.path(), cat("tensor '", name, "' is missing"));
  }
  const TensorEntry& e = file.entry(name);
  const int rank = static_cast<int>(e.shape.size());
  if (std::find(ranks.begin(), ranks.end(), rank) == ranks.end()) {
    std::string expected;
    for (const int r : ranks) expected += (expected.empty() ? "" : " or ") + std::to_string(r);
    case_fail(file.path(), cat("tensor '", name, "' must have rank ", expected, ", got shape ",
                               shape_string(e.shape)));
  }
  if (!dtype_ok(e.dtype))
    case_fail(file.path(), cat("tensor '", name, "' must have dtype ", dtypes_text, ", got ",
                               safetensors_dtype_name(e.dtype)));
  return file.view(name);
}

const std::string* find_meta(const Metadata& meta, std::string_view key) {
  const auto it = meta.find(key);
  return it == meta.end() ? nullptr : &it->second;
}

}  // namespace

LoadedCase load_case(const std::string& path) {
  LoadedCase c;
  c.file = SafetensorsFile::read(path);
  const SafetensorsFile& f = c.file;

  const auto floats = [](DType d) { return is_float(d); };
  const auto ids = [](DType d) { return d == DType::i32 || d == DType::i64; };
  const auto int4 = [](DType d) { return d == DType::i8 || d == DType::u8; };
  constexpr const char* kFloats = "F32, BF16 or F16";
  constexpr const char* kInt4 = "I8 (values in [-8, 7]) or U8 (nibble-packed)";

  c.x = case_tensor(f, "x", {2}, kFloats, floats);
  c.topk_ids = case_tensor(f, "topk_ids", {2}, "I32 or I64", ids);
  c.topk_weights = case_tensor(f, "topk_weights", {2}, kFloats, floats);
  LogicalWeights& w = c.weights;
  w.w13 = case_tensor(f, "w13", {3}, kInt4, int4);
  w.w13_scale = case_tensor(f, "w13_scale", {2, 3}, kFloats, floats);
  w.w13_bias = case_tensor(f, "w13_bias", {2}, kFloats, floats, /*optional=*/true);
  w.w2 = case_tensor(f, "w2", {3}, kInt4, int4);
  w.w2_scale = case_tensor(f, "w2_scale", {2, 3}, kFloats, floats);
  w.w2_bias = case_tensor(f, "w2_bias", {2}, kFloats, floats, /*optional=*/true);

  const Metadata& meta = f.metadata();
  const std::string* group = find_meta(meta, "group_size");
  if (!group) case_fail(path, "metadata 'group_size' is missing (\"-1\" or a group size)");
  const std::optional<int64_t> g = parse_int(*group);
  if (!g || *g < std::numeric_limits<int>::min() || *g > std::numeric_limits<int>::max())
    case_fail(path,
              cat("metadata 'group_size' must be an integer, got '", short_text(*group), "'"));
  w.group_size = static_cast<int>(*g);

  const std::string* activation = find_meta(meta, "activation");
  if (!activation)
    case_fail(path,
              "metadata 'activation' is missing (silu, swigluoai, swiglustep, gelu or "
              "gelu_tanh)");
  try {
    c.params.activation = parse_activation(*activation);
  } catch (const Error&) {
    case_fail(path, cat("metadata 'activation' must be silu, swigluoai, swiglustep, gelu or "
                        "gelu_tanh, got '",
                        short_text(*activation), "'"));
  }

  for (const auto& [key, target] :
       {std::pair<const char*, float*>{"alpha", &c.params.alpha}, {"limit", &c.params.limit}}) {
    if (const std::string* text = find_meta(meta, key)) {
      const std::optional<float> v = parse_float(*text);
      if (!v)
        case_fail(path, cat("metadata '", key, "' must be a finite number, got '",
                            short_text(*text), "'"));
      *target = *v;
    }
  }
  if (const std::string* text = find_meta(meta, "apply_router_weight_on_input")) {
    if (*text != "true" && *text != "false")
      case_fail(path, cat("metadata 'apply_router_weight_on_input' must be 'true' or 'false', "
                          "got '",
                          short_text(*text), "'"));
    c.params.apply_router_weight_on_input = *text == "true";
  }
  if (const std::string* text = find_meta(meta, "gate_up_layout")) {
    if (*text == "halves") {
      w.gate_up_layout = GateUpLayout::halves;
    } else if (*text == "interleaved") {
      w.gate_up_layout = GateUpLayout::interleaved;
    } else {
      case_fail(path, cat("metadata 'gate_up_layout' must be 'halves' or 'interleaved', got '",
                          short_text(*text), "'"));
    }
  }
  return c;
}

}  // namespace w4a8moe::io
