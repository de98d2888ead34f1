// ContextPool: idle Contexts leased to concurrent callers of forward().
#include <pthread.h>

#include <iterator>
#include <utility>

#include "w4a8moe/w4a8moe.hpp"

namespace w4a8moe {

ContextPool& ContextPool::instance() {
  static ContextPool* pool = [] {
    auto* p = new ContextPool();
    // The mutex is held across fork(), so the child never sees it locked by a thread it lacks.
    pthread_atfork([] { ContextPool::instance().mutex_.lock(); },
                   [] { ContextPool::instance().mutex_.unlock(); },
                   [] { ContextPool::instance().forget_after_fork(); });
    return p;
  }();
  return *pool;
}

ContextPool::Lease::~Lease() {
  if (context_) pool_->give_back(std::move(context_));
}

ContextPool::Lease ContextPool::lease(int threads) {
  std::unique_ptr<Context> found;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
      if (threads == 0 || (*it)->threads() == threads) {
        found = std::move(*it);
        idle_.erase(std::next(it).base());
        break;
      }
    }
  }
  if (!found) found = std::make_unique<Context>(threads);
  return Lease(*this, std::move(found));
}

size_t ContextPool::idle() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return idle_.size();
}

void ContextPool::give_back(std::unique_ptr<Context> context) noexcept {
  std::unique_ptr<Context> evicted;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.push_back(std::move(context));
  if (idle_.size() > kMaxIdle) {
    evicted = std::move(idle_.front());
    idle_.erase(idle_.begin());
  }
}

// In the child of a fork (the mutex held since before fork()): the Contexts' worker threads do
// not exist here, so the Contexts are forgotten (leaked), never destroyed.
void ContextPool::forget_after_fork() noexcept {
  for (auto& c : idle_) static_cast<void>(c.release());
  idle_.clear();
  mutex_.unlock();
}

}  // namespace w4a8moe
