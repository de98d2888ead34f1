// The same bits for any thread count, for repeated calls, and no scratch growth in steady state;
// the pool of contexts for concurrent callers; the driver's task claims.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "api/task_claims.hpp"
#include "test_util.hpp"
#include "w4a8moe/w4a8moe.hpp"

namespace {

using moe_test::Case;
using moe_test::CaseSpec;
using moe_test::DType;

struct ThreadCase {
  std::string name;
  CaseSpec spec;
};

std::vector<ThreadCase> thread_cases() {
  const CaseSpec decode{
      .tokens = 1, .hidden = 512, .inter = 256, .experts = 8, .group_size = 128, .seed = 71};

  CaseSpec prefill = decode;
  prefill.tokens = 200;
  prefill.routing = moe_test::Routing::skewed;
  prefill.x_dtype = DType::bf16;
  prefill.seed = 72;

  CaseSpec prefill_cw = prefill;
  prefill_cw.group_size = -1;
  prefill_cw.hidden = 200;
  prefill_cw.inter = 72;
  prefill_cw.bias = true;
  prefill_cw.apply_router_weight_on_input = true;
  prefill_cw.routing = moe_test::Routing::repeated;
  prefill_cw.x_dtype = DType::f16;
  prefill_cw.seed = 73;

  CaseSpec many_experts = decode;
  many_experts.tokens = 37;
  many_experts.experts = 16;
  many_experts.top_k = 16;
  many_experts.routing = moe_test::Routing::all_experts;
  many_experts.activation = w4a8moe::Activation::swigluoai;
  many_experts.seed = 74;
  return {{"decode_T1", decode},
          {"prefill_T200_skewed_bf16", prefill},
          {"prefill_T200_channelwise_odd_f16", prefill_cw},
          {"T37_top_k_16_of_16", many_experts}};
}

// With the active kernel set (CTest runs the suite once per set).
class Threads : public testing::TestWithParam<ThreadCase> {
 protected:
  const CaseSpec& spec() const { return GetParam().spec; }
  // The case, and its weights packed for the active kernel set.
  const Case case_ = moe_test::make_case(spec());
  const moe_test::PackedPair packed_ = moe_test::pack(case_);
};

std::string thread_test_name(const testing::TestParamInfo<ThreadCase>& info) {
  return info.param.name;
}

void PrintTo(const ThreadCase& c, std::ostream* os) { *os << moe_test::describe(c.spec); }

INSTANTIATE_TEST_SUITE_P(Cases, Threads, testing::ValuesIn(thread_cases()), thread_test_name);

TEST_P(Threads, SameBitsForAnyThreadCount) {
  SCOPED_TRACE(moe_test::describe(spec()));
  w4a8moe::Context one(1);
  const moe_test::Output expected = moe_test::run_forward(case_, packed_, one);
  for (const int threads : {2, 3, 7}) {
    w4a8moe::Context context(threads);
    EXPECT_EQ(context.threads(), threads);
    const moe_test::Output got = moe_test::run_forward(case_, packed_, context);
    EXPECT_TRUE(got.bytes == expected.bytes) << threads << " threads differ from 1 thread";
  }
}

// A caller's pool of `threads` std::threads, as an Executor: parallel_for(n, task) hands task i
// to thread i % threads, so with fewer threads than tasks some run one after another.
class CallerPool {
 public:
  explicit CallerPool(int threads) : threads_(threads) {}
  w4a8moe::Executor executor(int tasks) {
    return {tasks, [this](int n, const std::function<void(int)>& task) {
              ++calls;
              std::vector<std::thread> started;
              for (int t = 1; t < threads_; ++t)
                started.emplace_back([&, t] {
                  for (int i = t; i < n; i += threads_) task(i);
                });
              for (int i = 0; i < n; i += threads_) task(i);
              for (auto& th : started) th.join();
            }};
  }
  int calls = 0;

 private:
  int threads_;
};

TEST_P(Threads, SameBitsOnACallersExecutorOfAnySize) {
  SCOPED_TRACE(moe_test::describe(spec()));
  w4a8moe::Context one(1);
  const moe_test::Output expected = moe_test::run_forward(case_, packed_, one);
  // pools of 1, 2 and 7 threads, each with as many tasks as threads, and a pool of 1 thread
  // running 4 tasks one after another (a serial executor)
  for (const auto& [threads, tasks] :
       {std::pair{1, 1}, std::pair{2, 2}, std::pair{7, 7}, std::pair{1, 4}, std::pair{2, 3}}) {
    CallerPool pool(threads);
    w4a8moe::Context context(pool.executor(tasks));
    EXPECT_TRUE(context.on_executor());
    EXPECT_EQ(context.threads(), tasks);
    const moe_test::Output got = moe_test::run_forward(case_, packed_, context);
    EXPECT_TRUE(got.bytes == expected.bytes)
        << threads << " caller threads, " << tasks << " tasks differ from 1 thread";
    EXPECT_GE(pool.calls, 1);
  }
}

TEST(ThreadsExecutor, ExecutorErrorsAreErrorsOfTheCall) {
  const CaseSpec spec{.tokens = 5, .group_size = 64, .seed = 95};
  const Case c = moe_test::make_case(spec);
  const moe_test::PackedPair packed = moe_test::pack(c);
  auto run = [&](w4a8moe::Executor e) {
    w4a8moe::Context context(std::move(e));
    moe_test::run_forward(c, packed, context);
  };
  // throws before running anything, and after running every task
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        run({2, [](int, const std::function<void(int)>&) { throw std::runtime_error("no"); }});
      },
      {"executor", "parallel_for threw", "no"}));
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        run({2, [](int n, const std::function<void(int)>& task) {
               for (int i = 0; i < n; ++i) task(i);
               throw 7;
             }});
      },
      {"executor", "unknown type"}));
  // runs none, one of two, or one task twice
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        run({2, [](int, const std::function<void(int)>&) {}});
      },
      {"executor", "run all 2 tasks", "ran 0"}));
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        run({2, [](int, const std::function<void(int)>& task) { task(0); }});
      },
      {"executor", "ran 1"}));
  EXPECT_TRUE(moe_test::throws_error(
      [&] {
        run({2, [](int, const std::function<void(int)>& task) {
               task(0);
               task(0);
               task(1);
             }});
      },
      {"executor", "index 0"}));
  // and a good call on the same Context afterwards gives the right bits
  w4a8moe::Context reference(1);
  const moe_test::Output expected = moe_test::run_forward(c, packed, reference);
  bool fail = true;
  w4a8moe::Context context(w4a8moe::Executor{2, [&](int n, const std::function<void(int)>& task) {
                                               if (fail) throw std::runtime_error("once");
                                               for (int i = 0; i < n; ++i) task(i);
                                             }});
  EXPECT_TRUE(moe_test::throws_error([&] { moe_test::run_forward(c, packed, context); },
                                     {"executor", "once"}));
  fail = false;
  EXPECT_TRUE(moe_test::run_forward(c, packed, context).bytes == expected.bytes);
}

TEST(ThreadsExecutor, ChunkedCallsGiveTheSameBits) {
  // a memory limit splits the call into chunks: one executor run each
  const Case c = moe_test::make_case(
      {.tokens = 400, .hidden = 512, .inter = 256, .experts = 8, .group_size = 64, .seed = 97});
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context reference(1);
  const moe_test::Output expected = moe_test::run_forward(c, packed, reference);
  CallerPool pool(2);
  w4a8moe::Context context(pool.executor(3));
  moe_test::run_forward(c, packed, context);
  const int one_chunk = pool.calls;
  context.set_memory_limit(context.scratch_bytes() * 2 / 3);
  EXPECT_TRUE(moe_test::run_forward(c, packed, context).bytes == expected.bytes);
  EXPECT_GT(pool.calls - one_chunk, 1) << "the limit should have chunked the call";
}

TEST(ThreadsExecutor, BadExecutorsAreRefused) {
  EXPECT_TRUE(moe_test::throws_error(
      [] {
        w4a8moe::Context c(w4a8moe::Executor{0, [](int, const std::function<void(int)>&) {}});
      },
      {"executor.threads", "[1, 4096]", "got 0"}));
  EXPECT_TRUE(moe_test::throws_error(
      [] {
        w4a8moe::Context c(w4a8moe::Executor{2, {}});
      },
      {"executor.parallel_for", "empty"}));
}

TEST(ThreadsContext, SpinWaitIsBounded) {
  using std::chrono::microseconds;
  w4a8moe::Context context(2);
  EXPECT_EQ(context.spin_wait(), w4a8moe::Context::kDefaultSpinWait);
  context.set_spin_wait(microseconds{0});
  EXPECT_EQ(context.spin_wait(), microseconds{0});
  context.set_spin_wait(w4a8moe::Context::kMaxSpinWait);
  EXPECT_EQ(context.spin_wait(), w4a8moe::Context::kMaxSpinWait);
  EXPECT_TRUE(moe_test::throws_error([&] { context.set_spin_wait(microseconds{-1}); },
                                     {"spin_wait", "0 to 100000 microseconds", "got -1"}));
  EXPECT_TRUE(moe_test::throws_error([&] { context.set_spin_wait(microseconds{100001}); },
                                     {"spin_wait", "got 100001"}));
  EXPECT_EQ(context.spin_wait(), w4a8moe::Context::kMaxSpinWait);  // unchanged by the refusals
  // every wait policy gives the same bits, with calls that find the workers asleep
  const Case c = moe_test::make_case({.tokens = 3, .group_size = 64, .seed = 96});
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context reference(1);
  const moe_test::Output expected = moe_test::run_forward(c, packed, reference);
  for (const microseconds wait : {microseconds{0}, microseconds{50}, microseconds{5000}}) {
    context.set_spin_wait(wait);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(moe_test::run_forward(c, packed, context).bytes == expected.bytes);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // polling ends, or not
    }
  }
}

TEST_P(Threads, RepeatedCallsGiveTheSameBitsWithoutScratchGrowth) {
  SCOPED_TRACE(moe_test::describe(spec()));
  w4a8moe::Context context(2);
  const moe_test::Output first = moe_test::run_forward(case_, packed_, context);
  const size_t scratch = context.scratch_bytes();
  for (int i = 0; i < 3; ++i) {
    const moe_test::Output again = moe_test::run_forward(case_, packed_, context);
    EXPECT_TRUE(again.bytes == first.bytes) << "call " << i + 2 << " differs from the first";
    EXPECT_EQ(context.scratch_bytes(), scratch) << "call " << i + 2;
  }
}

TEST(ThreadsContext, SmallerCallsReuseTheScratch) {
  const CaseSpec big{
      .tokens = 64, .hidden = 512, .inter = 256, .experts = 8, .group_size = 64, .seed = 90};
  CaseSpec small = big;
  small.tokens = 3;
  const Case b = moe_test::make_case(big), s = moe_test::make_case(small);
  // The small case's x and routing against the big case's weights (only T differs).
  const moe_test::PackedPair packed = moe_test::pack(b);
  w4a8moe::Context context(2);
  const moe_test::Output first_big = moe_test::run_forward(b, packed, context);
  const size_t scratch = context.scratch_bytes();
  EXPECT_GT(scratch, 0u);
  moe_test::run_forward(s, packed, context);
  EXPECT_EQ(context.scratch_bytes(), scratch) << "a smaller call grew the scratch";
  const moe_test::Output second_big = moe_test::run_forward(b, packed, context);
  EXPECT_EQ(context.scratch_bytes(), scratch);
  EXPECT_TRUE(second_big.bytes == first_big.bytes);
}

TEST(ThreadsContext, ContextsMayRunConcurrently) {
  // Each Context is single-threaded in use, but contexts on several threads must not interfere
  // (no hidden global state in the forward pass), whether owned or leased from a ContextPool.
  const CaseSpec spec{.tokens = 40, .group_size = 64, .seed = 91};  // H 256, I 128, E 4, K 2
  const Case c = moe_test::make_case(spec);
  const moe_test::PackedPair packed = moe_test::pack(c);
  w4a8moe::Context reference_context(1);
  const moe_test::Output expected = moe_test::run_forward(c, packed, reference_context);
  // Threads 0 and 1 own a Context each; threads 2 to 4 lease one from the process's
  // ContextPool for every call, as an embedder serving concurrent requests does.
  std::vector<moe_test::Output> outs(5);
  w4a8moe::ContextPool& pool = w4a8moe::ContextPool::instance();
  {
    std::vector<std::thread> workers;
    for (int i = 0; i < 5; ++i)
      workers.emplace_back([&, i] {
        std::optional<w4a8moe::Context> own;
        if (i < 2) own.emplace(2);
        for (int r = 0; r < 5; ++r) {
          if (own) {
            outs[static_cast<size_t>(i)] = moe_test::run_forward(c, packed, *own);
          } else {
            auto lease = pool.lease(2);
            outs[static_cast<size_t>(i)] = moe_test::run_forward(c, packed, lease.context());
          }
        }
      });
    for (std::thread& w : workers) w.join();
  }
  for (const moe_test::Output& o : outs) EXPECT_TRUE(o.bytes == expected.bytes);
  EXPECT_LE(pool.idle(), w4a8moe::ContextPool::kMaxIdle);
}

// ---- ContextPool ------------------------------------------------------------------------------

TEST(ContextPoolTest, ASteadyStreamOfCallsReusesOneContext) {
  w4a8moe::ContextPool pool;
  const w4a8moe::Context* first = nullptr;
  {
    auto lease = pool.lease(2);
    first = &lease.context();
    EXPECT_EQ(lease.context().threads(), 2);
  }
  EXPECT_EQ(pool.idle(), 1u);
  {
    auto lease = pool.lease(2);
    EXPECT_EQ(&lease.context(), first);
    EXPECT_EQ(pool.idle(), 0u);
  }
  {
    auto lease = pool.lease(0);  // any idle context
    EXPECT_EQ(&lease.context(), first);
  }
  {
    auto lease = pool.lease(1);  // another thread count: a new context
    EXPECT_NE(&lease.context(), first);
    EXPECT_EQ(lease.context().threads(), 1);
  }
  EXPECT_EQ(pool.idle(), 2u);
}

TEST(ContextPoolTest, ConcurrentLeasesGetTheirOwnContexts) {
  w4a8moe::ContextPool pool;
  std::vector<w4a8moe::ContextPool::Lease> leases;
  for (size_t i = 0; i < w4a8moe::ContextPool::kMaxIdle + 2; ++i) leases.push_back(pool.lease(1));
  for (size_t i = 0; i < leases.size(); ++i)
    for (size_t j = 0; j < i; ++j) EXPECT_NE(&leases[i].context(), &leases[j].context());
  EXPECT_EQ(pool.idle(), 0u);
  leases.clear();  // the oldest idle ones beyond kMaxIdle are destroyed
  EXPECT_EQ(pool.idle(), w4a8moe::ContextPool::kMaxIdle);
}

// ---- the driver's task claims ----

std::vector<int64_t> claim_all(w4a8moe::detail::TaskClaims& claims, int thread) {
  std::vector<int64_t> got;
  for (int64_t t = claims.claim(thread); t >= 0; t = claims.claim(thread)) got.push_back(t);
  return got;
}

TEST(TaskClaims, AThreadTakesItsSegmentFromTheFrontThenTheOthersFromTheBack) {
  w4a8moe::detail::TaskClaims claims(3);
  claims.reset(10);  // segments [0, 3), [3, 6), [6, 10)
  EXPECT_EQ(claim_all(claims, 0), (std::vector<int64_t>{0, 1, 2, 5, 4, 3, 9, 8, 7, 6}));
  claims.reset(10);
  EXPECT_EQ(claims.claim(1), 3);
  EXPECT_EQ(claims.claim(2), 6);
  EXPECT_EQ(claim_all(claims, 0), (std::vector<int64_t>{0, 1, 2, 5, 4, 9, 8, 7}));
  EXPECT_EQ(claims.claim(1), -1);
}

TEST(TaskClaims, FewerTasksThanThreadsAndNone) {
  w4a8moe::detail::TaskClaims claims(4);
  claims.reset(0);
  EXPECT_EQ(claims.claim(0), -1);
  EXPECT_EQ(claims.claim(3), -1);
  claims.reset(2);  // segments [0, 0), [0, 1), [1, 1), [1, 2)
  EXPECT_EQ(claim_all(claims, 2), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(claims.claim(1), -1);
  w4a8moe::detail::TaskClaims one(1);
  one.reset(3);
  EXPECT_EQ(claim_all(one, 0), (std::vector<int64_t>{0, 1, 2}));
}

TEST(TaskClaims, ConcurrentThreadsTakeEveryTaskExactlyOnce) {
  constexpr int kThreads = 6;
  constexpr int64_t kTasks = 20011;
  w4a8moe::detail::TaskClaims claims(kThreads);
  for (int round = 0; round < 3; ++round) {
    claims.reset(kTasks);
    std::vector<std::vector<int64_t>> got(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] { got[static_cast<size_t>(t)] = claim_all(claims, t); });
    for (auto& th : threads) th.join();
    std::vector<int> seen(kTasks, 0);
    for (const auto& g : got)
      for (const int64_t task : g) {
        ASSERT_GE(task, 0);
        ASSERT_LT(task, kTasks);
        ++seen[static_cast<size_t>(task)];
      }
    for (int64_t task = 0; task < kTasks; ++task)
      ASSERT_EQ(seen[static_cast<size_t>(task)], 1) << "task " << task << ", round " << round;
  }
}

}  // namespace
