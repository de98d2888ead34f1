// The files of a GGUF model: one file, or the parts llama.cpp's gguf-split writes
// ("<prefix>-00001-of-0000N.gguf" ..., metadata split.no (0-based) and split.count in every file;
// the first holds the model's metadata).
#pragma once

#include <string>
#include <vector>

#include "io/gguf.hpp"

namespace w4a8moe::io {

// The model `path` names (any of its parts), the metadata file first, then the other parts in
// order. Throws Error naming the file when a part is missing, misnamed or out of order.
std::vector<GgufFile> open_gguf_model(const std::string& path);

}  // namespace w4a8moe::io
