// Every file of fuzz/corpus/<harness>/ through its fuzz harness: the seeds, and each
// input a fuzzer once crashed on (added there as a regression test). A harness aborts on a broken
// invariant; a sanitizer build reports memory errors. CTest runs this once per kernel set.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "io/safetensors_file.hpp"

int w4a8moe_fuzz_api(const uint8_t* data, size_t size);
int w4a8moe_fuzz_packed(const uint8_t* data, size_t size);
int w4a8moe_fuzz_packed_file(const uint8_t* data, size_t size);
int w4a8moe_fuzz_safetensors(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

struct Input {
  std::string harness;
  fs::path file;
};

using Harness = int (*)(const uint8_t*, size_t);

Harness harness(const std::string& name) {
  if (name == "api") return w4a8moe_fuzz_api;
  if (name == "packed") return w4a8moe_fuzz_packed;
  if (name == "packed_file") return w4a8moe_fuzz_packed_file;
  if (name == "safetensors") return w4a8moe_fuzz_safetensors;
  return nullptr;
}

std::vector<Input> corpus() {
  std::vector<Input> inputs;
  for (const char* name : {"api", "packed", "packed_file", "safetensors"}) {
    const fs::path dir = fs::path(W4A8MOE_FUZZ_CORPUS) / name;
    std::vector<fs::path> files;
    if (fs::is_directory(dir))
      for (const auto& entry : fs::directory_iterator(dir))
        if (entry.is_regular_file()) files.push_back(entry.path());
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) inputs.push_back({name, f});
  }
  return inputs;
}

void PrintTo(const Input& in, std::ostream* os) { *os << in.file.string(); }

class FuzzCorpus : public testing::TestWithParam<Input> {};

std::string input_name(const testing::TestParamInfo<Input>& info) {
  std::string name = info.param.harness + "_" + info.param.file.filename().string();
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

TEST_P(FuzzCorpus, ReplaysWithoutAFinding) {
  const Input& in = GetParam();
  std::ifstream f(in.file, std::ios::binary);
  ASSERT_TRUE(f) << in.file;
  const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(f),
                                   std::istreambuf_iterator<char>()};
  const Harness h = harness(in.harness);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h(bytes.data(), bytes.size()), 0) << in.file;
}

INSTANTIATE_TEST_SUITE_P(Files, FuzzCorpus, testing::ValuesIn(corpus()), input_name);

// Found by the safetensors fuzzer (corpus/safetensors/crash-a0ee2334...): a JSON number too
// large for a double made the reader throw nlohmann's out_of_range instead of an Error naming
// the file (`w4a8moe run` then printed nlohmann's text).
TEST(FuzzRegressions, SafetensorsHeaderNumberOutOfRangeIsAnError) {
  const fs::path file = fs::temp_directory_path() / "w4a8moe_number_overflow.safetensors";
  for (const std::string& json :
       {std::string("{\"x\":{\"dtype\":\"F32\",\"shape\":[1E400],\"data_offsets\":[0,4]}}"),
        std::string("{\"__metadata__\":{\"a\":\"b\"},\"y\":-1e999}")}) {
    std::string bytes(8, '\0');
    bytes[0] = static_cast<char>(json.size());
    bytes += json;
    std::ofstream(file, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    try {
      w4a8moe::io::SafetensorsFile::read(file.string());
      ADD_FAILURE() << "accepted " << json;
    } catch (const w4a8moe::Error& e) {
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
    }
  }
  fs::remove(file);
}

TEST(FuzzCorpusLayout, EveryHarnessHasSeeds) {
  for (const char* name : {"api", "packed", "packed_file", "safetensors"}) {
    const fs::path dir = fs::path(W4A8MOE_FUZZ_CORPUS) / name;
    ASSERT_TRUE(fs::is_directory(dir)) << dir;
    EXPECT_GE(std::distance(fs::directory_iterator(dir), fs::directory_iterator{}), 3) << dir;
  }
}

}  // namespace
