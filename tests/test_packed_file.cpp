// Packed weight files: save_packed() and PackedFile. A saved file gives forward() the
// same bits as the buffers it was saved from; a crash while writing never leaves a partial file
// under the final name; every kind of damage, a foreign version or a layout this CPU cannot run
// is refused with a message naming the file; copies are immune to later changes of the file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/xxhash64.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

namespace fs = std::filesystem;
using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::throws_error;
using w4a8moe::PackedFile;
using w4a8moe::PackedFileOptions;

// The file header's fields this test rewrites (the format is documented in packed_file.cpp).
constexpr size_t kFileVersionAt = 8, kFormatVersionAt = 16, kLayoutAt = 20, kFileBytesAt = 24,
                 kW2OffsetAt = 48, kExpertsAt = 64, kChecksumKindAt = 92, kMetaFlagsAt = 104,
                 kActivationAt = 108, kTopKAt = 128, kReservedAt = 136, kHeaderChecksumAt = 248,
                 kHeaderBytes = 4096;

CaseSpec file_spec() {
  return {.tokens = 9, .inter = 96, .experts = 5, .group_size = 32, .bias = true, .seed = 601};
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

template <class T>
void put(std::vector<uint8_t>& bytes, size_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof value);
}

// Rewrites the header checksum after a field was changed, so the deeper checks are reached.
void reseal(std::vector<uint8_t>& bytes) {
  put(bytes, kHeaderChecksumAt, w4a8moe::detail::Xxh64::of(bytes.data(), kHeaderChecksumAt));
}

class PackedFileTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "w4a8moe_packed_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    case_ = moe_test::make_case(file_spec());
    packed_ = moe_test::pack(case_);
    path_ = (dir_ / "layer.w4a8").string();
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }

  void save(const std::string& path) const {
    w4a8moe::PackedFileMeta meta;
    meta.has_params = true;
    meta.params = case_.params();
    meta.top_k = file_spec().top_k;
    w4a8moe::save_packed(path, packed_.w13.bytes(), packed_.w2.bytes(), meta);
  }

  moe_test::Output run(std::span<const uint8_t> w13, std::span<const uint8_t> w2) const {
    w4a8moe::Context context(2);
    moe_test::Output out = moe_test::make_output(case_);
    w4a8moe::forward(context, case_.x_view(), case_.ids_view(), case_.topk_weights_view(), w13, w2,
                     case_.params(), out.view());
    return out;
  }

  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_))
      names.push_back(entry.path().filename().string());
    return names;
  }

  // Writes `bytes` as a file and expects PackedFile::open to refuse it with the path and every
  // fragment in the message.
  void expect_refused(const std::vector<uint8_t>& bytes,
                      std::initializer_list<std::string_view> fragments,
                      const PackedFileOptions& options = {}) {
    const std::string bad = (dir_ / "bad.w4a8").string();
    write_bytes(bad, bytes);
    std::vector<std::string_view> all(fragments);
    all.push_back(bad);
    const auto f = [&] { PackedFile::open(bad, options); };
    std::string text;
    try {
      f();
      ADD_FAILURE() << "accepted; expected an error with '" << *fragments.begin() << "'";
      return;
    } catch (const w4a8moe::Error& e) {
      text = e.what();
    }
    for (const std::string_view frag : all)
      EXPECT_NE(text.find(frag), std::string::npos) << "message: " << text << "\nmissing: " << frag;
  }

  fs::path dir_;
  Case case_;
  moe_test::PackedPair packed_;
  std::string path_;
};

TEST(Xxh64, KnownVectorsAndStreaming) {
  // Values of the reference implementation (libxxhash 0.8.1, XXH64 with seed 0).
  std::vector<uint8_t> ramp(256), mixed(1000);
  for (size_t i = 0; i < ramp.size(); ++i) ramp[i] = static_cast<uint8_t>(i);
  for (size_t i = 0; i < mixed.size(); ++i) mixed[i] = static_cast<uint8_t>((i * 7 + 3) % 256);
  using w4a8moe::detail::Xxh64;
  EXPECT_EQ(Xxh64::of(nullptr, 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(Xxh64::of("a", 1), 0xd24ec4f1a98c6e5bull);
  EXPECT_EQ(Xxh64::of("abc", 3), 0x44bc2cf5ad770999ull);
  EXPECT_EQ(Xxh64::of(ramp.data(), 31), 0xc346d2b59b4d8ee1ull);
  EXPECT_EQ(Xxh64::of(ramp.data(), 32), 0xcbf59c5116ff32b4ull);
  EXPECT_EQ(Xxh64::of(ramp.data(), 100), 0x6ac1e58032166597ull);
  EXPECT_EQ(Xxh64::of(mixed.data(), mixed.size()), 0x5f235fa033f1a3fbull);
  for (const size_t piece : {1u, 3u, 7u, 31u, 32u, 33u, 100u}) {
    Xxh64 h;
    for (size_t at = 0; at < mixed.size(); at += piece)
      h.update(mixed.data() + at, std::min(piece, mixed.size() - at));
    EXPECT_EQ(h.digest(), 0x5f235fa033f1a3fbull) << "pieces of " << piece;
  }
}

TEST_F(PackedFileTest, RoundTripGivesTheSameBits) {
  save(path_);
  const moe_test::Output expected = run(packed_.w13.bytes(), packed_.w2.bytes());
  for (const bool copy : {false, true}) {
    SCOPED_TRACE(copy ? "copied" : "mapped");
    PackedFileOptions options;
    options.copy = copy;
    const PackedFile file = PackedFile::open(path_, options);
    ASSERT_EQ(file.w13().size(), packed_.w13.size());
    ASSERT_EQ(file.w2().size(), packed_.w2.size());
    EXPECT_EQ(std::memcmp(file.w13().data(), packed_.w13.bytes().data(), file.w13().size()), 0);
    EXPECT_EQ(std::memcmp(file.w2().data(), packed_.w2.bytes().data(), file.w2().size()), 0);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(file.w13().data()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(file.w2().data()) % 64, 0u);
    const w4a8moe::PackedFileInfo& info = file.info();
    EXPECT_EQ(info.file_version, w4a8moe::kPackedFileVersion);
    EXPECT_EQ(info.experts, 5);
    EXPECT_EQ(info.hidden, 256);
    EXPECT_EQ(info.inter, 96);
    EXPECT_EQ(info.group_size, 32);
    EXPECT_EQ(info.w13.layout, packed_.w13.info().layout);
    EXPECT_TRUE(info.w13.has_bias && info.w2.has_bias);
    EXPECT_TRUE(info.checksum_verified);
    EXPECT_EQ(info.mapped, !copy);
    EXPECT_EQ(info.file_bytes, fs::file_size(path_));
    EXPECT_TRUE(info.meta.has_params);
    EXPECT_EQ(info.meta.top_k, 2);
    EXPECT_EQ(info.meta.params.activation, case_.params().activation);
    EXPECT_EQ(run(file.w13(), file.w2()).bytes, expected.bytes);
  }
  EXPECT_EQ(files(), std::vector<std::string>{"layer.w4a8"}) << "a temporary file was left";
}

TEST_F(PackedFileTest, MovedFromAndEmptyFilesHaveNoBuffers) {
  save(path_);
  PackedFile a = PackedFile::open(path_);
  PackedFile b = std::move(a);
  EXPECT_FALSE(b.w13().empty());
  EXPECT_EQ(b.path(), path_);
  const PackedFile empty;
  EXPECT_TRUE(empty.w13().empty());
  EXPECT_TRUE(empty.w2().empty());
  EXPECT_EQ(empty.info().experts, 0);
}

TEST_F(PackedFileTest, SaveChecksTheBuffersAndLeavesTheOldFile) {
  save(path_);
  const std::vector<uint8_t> before = read_bytes(path_);
  EXPECT_TRUE(
      throws_error([&] { w4a8moe::save_packed(path_, packed_.w2.bytes(), packed_.w13.bytes()); },
                   {"w13_packed", "w2"}));
  std::vector<uint8_t> truncated(packed_.w2.bytes().begin(), packed_.w2.bytes().end() - 1);
  EXPECT_TRUE(throws_error([&] { w4a8moe::save_packed(path_, packed_.w13.bytes(), truncated); },
                           {"w2_packed"}));
  w4a8moe::PackedFileMeta meta;
  meta.top_k = 6;  // more than the 5 experts
  EXPECT_TRUE(throws_error(
      [&] { w4a8moe::save_packed(path_, packed_.w13.bytes(), packed_.w2.bytes(), meta); },
      {"top_k", "6"}));
  EXPECT_TRUE(throws_error(
      [&] {
        w4a8moe::save_packed((dir_ / "no_such_dir" / "x.w4a8").string(), packed_.w13.bytes(),
                             packed_.w2.bytes());
      },
      {"no_such_dir"}));
  EXPECT_EQ(read_bytes(path_), before);
  EXPECT_EQ(files(), std::vector<std::string>{"layer.w4a8"});
}

// A crash in the middle of writing: the process is killed by SIGXFSZ when the file reaches the
// size limit set in the child. The final name keeps the previous complete file, and nothing else
// is left in the directory.
TEST_F(PackedFileTest, CrashWhileWritingLeavesTheOldFileWhole) {
  save(path_);
  const std::vector<uint8_t> before = read_bytes(path_);
  for (const bool ignore_signal : {false, true}) {
    SCOPED_TRACE(ignore_signal ? "write fails with EFBIG" : "killed by SIGXFSZ");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      if (ignore_signal) ::signal(SIGXFSZ, SIG_IGN);
      const rlimit limit{8192, 8192};  // the header and part of w13
      ::setrlimit(RLIMIT_FSIZE, &limit);
      try {
        w4a8moe::save_packed(path_, packed_.w13.bytes(), packed_.w2.bytes());
      } catch (const w4a8moe::Error& e) {
        const bool named = std::string(e.what()).find("cannot write") != std::string::npos;
        ::_exit(named ? 42 : 43);
      }
      ::_exit(0);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (ignore_signal) {
      ASSERT_TRUE(WIFEXITED(status));
      EXPECT_EQ(WEXITSTATUS(status), 42) << "expected an Error saying 'cannot write'";
    } else {
      ASSERT_TRUE(WIFSIGNALED(status));
      EXPECT_EQ(WTERMSIG(status), SIGXFSZ);
    }
    EXPECT_EQ(read_bytes(path_), before);
    EXPECT_NO_THROW(PackedFile::open(path_));
    EXPECT_EQ(files(), std::vector<std::string>{"layer.w4a8"});
  }
}

TEST_F(PackedFileTest, ReplacingTheFileKeepsOpenMappingsIntact) {
  save(path_);
  const PackedFile old_file = PackedFile::open(path_);
  const moe_test::Output expected = run(old_file.w13(), old_file.w2());
  CaseSpec other = file_spec();
  other.seed = 602;
  const moe_test::PackedPair other_packed = moe_test::pack(moe_test::make_case(other));
  w4a8moe::save_packed(path_, other_packed.w13.bytes(), other_packed.w2.bytes());
  EXPECT_EQ(run(old_file.w13(), old_file.w2()).bytes, expected.bytes);
  const PackedFile new_file = PackedFile::open(path_);
  EXPECT_NE(run(new_file.w13(), new_file.w2()).bytes, expected.bytes);
}

TEST_F(PackedFileTest, CopiesAreImmuneToChangesOfTheFile) {
  save(path_);
  PackedFileOptions options;
  options.copy = true;
  const PackedFile file = PackedFile::open(path_, options);
  const moe_test::Output expected = run(file.w13(), file.w2());
  std::vector<uint8_t> garbage = read_bytes(path_);
  for (size_t i = kHeaderBytes; i < garbage.size(); ++i) garbage[i] ^= 0x5a;
  {  // in place, as a careless writer would
    std::fstream f(path_, std::ios::binary | std::ios::in | std::ios::out);
    f.write(reinterpret_cast<const char*>(garbage.data()),
            static_cast<std::streamsize>(garbage.size()));
  }
  EXPECT_EQ(run(file.w13(), file.w2()).bytes, expected.bytes);
  fs::resize_file(path_, 100);
  EXPECT_EQ(run(file.w13(), file.w2()).bytes, expected.bytes);
  EXPECT_TRUE(throws_error([&] { PackedFile::open(path_); }, {"100 bytes", path_}));
}

TEST_F(PackedFileTest, CopyRespectsItsMemoryLimit) {
  save(path_);
  PackedFileOptions options;
  options.copy = true;
  options.memory_limit = 4096;
  EXPECT_TRUE(throws_error([&] { PackedFile::open(path_, options); },
                           {"memory limit", "4096", std::to_string(fs::file_size(path_))}));
  options.memory_limit = fs::file_size(path_);
  EXPECT_NO_THROW(PackedFile::open(path_, options));
}

TEST_F(PackedFileTest, DamageIsRefusedWithTheFileName) {
  save(path_);
  const std::vector<uint8_t> good = read_bytes(path_);
  auto with = [&](const std::function<void(std::vector<uint8_t>&)>& change) {
    std::vector<uint8_t> b = good;
    change(b);
    return b;
  };
  // The good file with one header field set and the header checksum made to agree.
  auto with_field = [&](size_t at, auto value) {
    return with([&](auto& b) {
      put(b, at, value);
      reseal(b);
    });
  };
  expect_refused({}, {"0 bytes"});
  expect_refused(std::vector<uint8_t>(good.begin(), good.begin() + 4095), {"4095 bytes"});
  expect_refused(std::vector<uint8_t>(good.begin(), good.end() - 1),
                 {std::to_string(good.size() - 1), "truncated"});
  expect_refused(with([](auto& b) { b.push_back(0); }), {"appended"});
  expect_refused(with([](auto& b) { b[0] = 'X'; }), {"magic"});
  expect_refused(with([](auto& b) { b[200] ^= 1; }), {"header", "checksum"});
  expect_refused(with([](auto& b) { b[5000] ^= 1; }), {"payload checksum"});
  expect_refused(with([](auto& b) { b.back() ^= 0x80; }), {"payload checksum"});
  expect_refused(with([](auto& b) { b[300] = 1; }), {"padding"});
  expect_refused(with_field(kFileVersionAt, uint32_t{2}),
                 {"file version 1", "version 2", "w4a8moe pack"});
  expect_refused(with_field(kFormatVersionAt, uint32_t{77}), {"packed format version", "77"});
  expect_refused(with_field(kLayoutAt, uint32_t{99}), {"layout", "99"});
  expect_refused(with_field(kFileBytesAt, uint64_t{1ull << 62}), {"header says"});
  expect_refused(with_field(kW2OffsetAt, uint64_t{1ull << 63}), {"offsets"});
  expect_refused(with_field(kExpertsAt, uint64_t{4}), {"does not match its buffers"});
  expect_refused(with_field(kChecksumKindAt, uint32_t{2}), {"checksum kind"});
  expect_refused(with_field(kMetaFlagsAt, uint32_t{6}), {"flags"});
  expect_refused(with_field(kActivationAt, int32_t{9}), {"activation code 9"});
  expect_refused(with_field(kTopKAt, int64_t{-1}), {"top-k"});
  expect_refused(with([](auto& b) {
                   b[kReservedAt + 3] = 1;
                   reseal(b);
                 }),
                 {"reserved"});
  // Damage inside a buffer's own header, with the payload checksum made to agree (as if the
  // file had been written that way): the buffer check still refuses it.
  expect_refused(with([](auto& b) {
                   b[kHeaderBytes + 20] ^= 1;  // w13's role field
                   const uint64_t sum =
                       w4a8moe::detail::Xxh64::of(b.data() + kHeaderBytes, b.size() - kHeaderBytes);
                   put(b, 96, sum);
                   reseal(b);
                 }),
                 {"w13"});
  const std::string dir = dir_.string();
  EXPECT_TRUE(throws_error([&] { PackedFile::open(dir); }, {"regular file", dir}));
  EXPECT_TRUE(throws_error([&] { PackedFile::open(dir + "/missing.w4a8"); }, {"cannot open"}));
}

TEST_F(PackedFileTest, SkippingTheChecksumStillChecksTheHeaders) {
  save(path_);
  std::vector<uint8_t> bytes = read_bytes(path_);
  bytes[6000] ^= 1;  // in w13's weights
  const std::string damaged = (dir_ / "damaged.w4a8").string();
  write_bytes(damaged, bytes);
  PackedFileOptions options;
  options.verify_checksum = false;
  const PackedFile file = PackedFile::open(damaged, options);  // documented: not detected
  EXPECT_FALSE(file.info().checksum_verified);
  bytes = read_bytes(path_);
  bytes[kHeaderBytes + 30] ^= 1;  // w13's header
  write_bytes(damaged, bytes);
  EXPECT_TRUE(throws_error([&] { PackedFile::open(damaged, options); }, {"w13", damaged}));
}

TEST_F(PackedFileTest, LayoutThisCpuCannotRunIsRefused) {
  const std::vector<std::string> sets = w4a8moe::available_kernel_sets();
  if (sets.size() < 2 || w4a8moe::active_kernel_set() == "scalar")
    GTEST_SKIP() << "needs a kernel set above scalar (this run: " << w4a8moe::active_kernel_set()
                 << ")";
  save(path_);  // packed for the active set, whose layout differs from scalar's
  const std::string cap = w4a8moe::active_kernel_set();
  w4a8moe::set_isa_cap("scalar");
  std::string message;
  try {
    PackedFile::open(path_);
  } catch (const w4a8moe::Error& e) {
    message = e.what();
  }
  w4a8moe::set_isa_cap(cap);
  EXPECT_NE(message.find(path_), std::string::npos) << message;
  EXPECT_NE(message.find("cannot run"), std::string::npos) << message;
  EXPECT_NE(message.find("w4a8moe pack"), std::string::npos) << message;
  EXPECT_NO_THROW(PackedFile::open(path_));
}

}  // namespace
