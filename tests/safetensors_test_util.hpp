// The fixture of the safetensors suites (test_safetensors.cpp, test_safetensors_hostile.cpp,
// test_case_file.cpp): a temporary folder, files written byte by byte, and the message of the
// Error that reading one raises, which must name the file.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "io/safetensors_file.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe::io::safetensors_test {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (std::filesystem::temp_directory_path() / "w4a8moe_st_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static void write_raw(const std::string& file, const std::vector<uint8_t>& bytes) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good());
  }

  // A file with the given header length field, header text and data bytes.
  static std::vector<uint8_t> make_bytes(uint64_t header_length, const std::string& header,
                                         size_t data_bytes) {
    std::vector<uint8_t> out;
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(header_length >> (8 * i)));
    out.insert(out.end(), header.begin(), header.end());
    for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<uint8_t>(i * 7 + 1));
    return out;
  }
  static std::vector<uint8_t> make_bytes(const std::string& header, size_t data_bytes) {
    return make_bytes(header.size(), header, data_bytes);
  }

  // The message of the Error that reading `bytes` raises; fails the test if it does not throw.
  std::string read_error(const std::vector<uint8_t>& bytes) {
    const std::string file = path("bad.safetensors");
    write_raw(file, bytes);
    return read_error_of(file);
  }
  static std::string read_error_of(const std::string& file) {
    try {
      SafetensorsFile::read(file);
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(file)) << "the message must name the file";
      return e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected w4a8moe::Error, got another exception: " << e.what();
      return e.what();
    }
    ADD_FAILURE() << "reading " << file << " did not throw";
    return "";
  }

  std::filesystem::path dir_;
};

}  // namespace w4a8moe::io::safetensors_test
