// The safetensors writer.
#include "io/safetensors_writer.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>

#include "common/format.hpp"

namespace w4a8moe::io {

using detail::cat;
using nlohmann::json;

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

}  // namespace w4a8moe::io
