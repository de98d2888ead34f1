// The w4a8moe program as a command, for the suites that test it end to end: its path (given by
// CMake as W4A8MOE_CLI_PATH, null when the program is not part of the build), shell quoting, a
// run that captures the exit code, stdout and stderr, and a fixture with a temporary folder.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace moe_test {

#ifdef W4A8MOE_CLI_PATH
inline constexpr const char* kCliPath = W4A8MOE_CLI_PATH;
#else
inline constexpr const char* kCliPath = nullptr;
#endif

struct ProgramResult {
  int exit_code = -1;  // -1 - signal number when killed by a signal
  std::string out, err;
};

// `s` in single quotes for /bin/sh.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (const char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

inline std::string read_text_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs `env` (a prefix such as "W4A8MOE_ISA=scalar ", or empty), the program and `args`, with
// stdin from /dev/null and stdout and stderr captured through files in `dir`.
inline ProgramResult run_program(const std::vector<std::string>& args, const std::string& dir,
                                 const std::string& env = "") {
  // append() rather than operator+ on temporaries: GCC 12 reports a false -Wrestrict there.
  std::string command = env;
  command.append(shell_quote(kCliPath));
  for (const std::string& a : args) command.append(" ").append(shell_quote(a));
  const std::string out_file = dir + "/stdout.txt", err_file = dir + "/stderr.txt";
  command.append(" >").append(shell_quote(out_file)).append(" 2>").append(shell_quote(err_file));
  command.append(" </dev/null");
  const int status = std::system(command.c_str());
  ProgramResult r;
  if (status != -1 && WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (status != -1 && WIFSIGNALED(status)) {
    r.exit_code = -1 - WTERMSIG(status);
  }
  r.out = read_text_file(out_file);
  r.err = read_text_file(err_file);
  return r;
}

// A test of the program: skipped when the program is not part of the build, with a temporary
// folder dir_ (removed afterwards) that holds its files and the captured output of run().
class ProgramTest : public testing::Test {
 protected:
  void SetUp() override {
    if (kCliPath == nullptr) GTEST_SKIP() << "the w4a8moe program is not part of this build";
    std::string pattern =
        (std::filesystem::temp_directory_path() / "w4a8moe_program_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // `env` is a prefix such as "W4A8MOE_ISA=scalar " (or empty).
  ProgramResult run(const std::vector<std::string>& args, const std::string& env = "") {
    return run_program(args, dir_.string(), env);
  }

  std::filesystem::path dir_;
};

}  // namespace moe_test
