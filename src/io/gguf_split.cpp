// The files of a GGUF model, split or not (gguf_split.hpp).
#include "io/gguf_split.hpp"

#include <cstdio>

#include "common/format.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io {

using detail::cat;

// A model split by llama.cpp's gguf-split: "<prefix>-00001-of-0000N.gguf" ... with metadata
// split.no (0-based) and split.count in every file; the first holds the model's metadata.
std::vector<GgufFile> open_gguf_model(const std::string& path) {
  std::vector<GgufFile> files;
  files.push_back(GgufFile::open(path));
  const std::optional<int64_t> count = files.front().get_int("split.count");
  if (!count || *count <= 1) return files;
  // "<prefix>-NNNNN-of-MMMMM.gguf": 20 characters after the prefix
  const auto digits = [&](size_t at) {
    int64_t v = 0;
    for (size_t i = at; i < at + 5; ++i) {
      if (path[i] < '0' || path[i] > '9') return int64_t{-1};
      v = v * 10 + (path[i] - '0');
    }
    return v;
  };
  const size_t n = path.size();
  const bool named = n > 20 && path[n - 20] == '-' && path.compare(n - 14, 4, "-of-") == 0 &&
                     path.compare(n - 5, 5, ".gguf") == 0 && digits(n - 19) >= 1 &&
                     digits(n - 10) == *count && digits(n - 19) <= *count;
  if (!named)
    throw Error(cat("GGUF file '", path, "': metadata 'split.count' says the model is split in ",
                    *count, " files, but the name does not end in -NNNNN-of-", *count, ".gguf"));
  const std::string prefix = path.substr(0, n - 20);
  const int64_t given_no = digits(n - 19) - 1;
  GgufFile given = std::move(files.front());
  files.clear();
  for (int64_t i = 0; i < *count; ++i) {
    char suffix[64];
    std::snprintf(suffix, sizeof suffix, "-%05lld-of-%05lld.gguf", static_cast<long long>(i + 1),
                  static_cast<long long>(*count));
    files.push_back(i == given_no ? std::move(given) : GgufFile::open(prefix + suffix));
    const GgufFile& f = files.back();
    const std::optional<int64_t> no = f.get_int("split.no");
    const std::optional<int64_t> total = f.get_int("split.count");
    if (no != i || total != *count)
      throw Error(cat("GGUF file '", f.path(), "': expected split ", i, " of ", *count,
                      " (metadata split.no and split.count), got split.no ",
                      no ? std::to_string(*no) : "(none)", " and split.count ",
                      total ? std::to_string(*total) : "(none)"));
  }
  return files;
}

}  // namespace w4a8moe::io
