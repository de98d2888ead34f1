// A progress indicator on stderr for steps that take more than a second: silent for short
// steps; on a terminal a percentage updated in place, elsewhere one line at the start and end.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace w4a8moe::cli {

class Progress {
 public:
  explicit Progress(std::string label, bool enabled = true)
      : label_(std::move(label)),
        enabled_(enabled),
        tty_(isatty(2) != 0),
        start_(std::chrono::steady_clock::now()) {}
  ~Progress() { finish(); }

  void update(double fraction) {
    if (!enabled_ || finished_ || elapsed() < 1.0) return;
    if (tty_) {
      std::fprintf(stderr, "\r%s: %3d%%", label_.c_str(), static_cast<int>(fraction * 100.0));
    } else if (!shown_) {
      std::fprintf(stderr, "%s...\n", label_.c_str());
    }
    shown_ = true;
  }

  void finish() {
    if (finished_) return;
    finished_ = true;
    if (enabled_ && (shown_ || elapsed() >= 1.0))
      std::fprintf(stderr, "%s%s: done in %.1f s\n", tty_ && shown_ ? "\r" : "", label_.c_str(),
                   elapsed());
  }

  static void callback(double fraction, void* self) {
    static_cast<Progress*>(self)->update(fraction);
  }

 private:
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  std::string label_;
  bool enabled_, tty_, shown_ = false, finished_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace w4a8moe::cli
