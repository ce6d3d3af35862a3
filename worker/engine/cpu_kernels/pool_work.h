// Spreading one kernel call's work items over XLA's intra-op thread pool.
//
// The calling thread and up to num_threads - 1 pool tasks claim items from a shared counter, so a
// thread the OS takes off its core holds back at most the item it is on: the others take the
// rest. When nothing is left to claim, the caller waits for the items still running elsewhere. It
// spins for a short while (the common case: a few microseconds, the length of one item), then
// sleeps on the counter. Sleeping matters on a machine shared with other processes (the API,
// Redis, a load generator): a helper preempted by one of them sits in its core's run queue, and
// only an idle core pulls it over. A caller that spun instead would keep its core busy doing
// nothing while the helper waited for its turn (a few milliseconds of scheduler slice).
//
// A `fn` that takes two arguments is called as fn(item, next): `next` is the item this thread
// runs after `item` (claimed before `item` runs), or -1 if there is none, so an item can request
// the memory of the next one while it computes. Such a thread holds back at most two items.
//
// The state is shared-owned: a pool task that starts after the call returned finds the counter
// exhausted and touches nothing else (`fn` may hold pointers that are dead by then).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace redjax {

constexpr std::chrono::microseconds kSpinBeforeSleep{50};

template <typename Fn>
struct PoolWork {
  PoolWork(int64_t items, Fn fn) : items(items), fn(std::move(fn)) {}

  const int64_t items;
  Fn fn;  // fn(item) or fn(item, next): runs one item, on whichever thread claimed it
  std::atomic<int64_t> next{0};
  std::atomic<int32_t> done{0};  // a 32-bit word: waited on with a futex

  void run() {
    if constexpr (std::is_invocable_v<Fn&, int64_t, int64_t>) {
      for (int64_t i = claim(), j; i < items; i = j) {
        j = claim();
        fn(i, j < items ? j : int64_t{-1});
        finish();
      }
    } else {
      for (int64_t i; (i = claim()) < items;) {
        fn(i);
        finish();
      }
    }
  }

  int64_t claim() { return next.fetch_add(1, std::memory_order_relaxed); }
  void finish() {
    if (done.fetch_add(1, std::memory_order_release) + 1 == items) done.notify_all();
  }

  void wait() {
    const auto spin_until = std::chrono::steady_clock::now() + kSpinBeforeSleep;
    for (int32_t seen; (seen = done.load(std::memory_order_acquire)) < items;) {
      if (std::chrono::steady_clock::now() < spin_until)
        std::this_thread::yield();
      else
        done.wait(seen, std::memory_order_acquire);
    }
  }
};

// Units (rows, tokens) per work item for a kernel whose unit is `unit_elements` floats: at least
// `at_least`, and enough for kMinItemElements. A call with under two items' worth runs on its
// caller alone: waking a helper for a few microseconds of work costs more than it saves (demo
// model's decode, 64 rows: the rope kernel 2.8 us a call alone, 9.8 us with a helper).
constexpr int64_t kMinItemElements = 32768;

inline int64_t units_per_item(int64_t unit_elements, int64_t at_least) {
  return std::max<int64_t>(at_least, kMinItemElements / std::max<int64_t>(unit_elements, 1));
}

// Runs fn(0) .. fn(items - 1) over the pool and the calling thread; returns when all are done.
// items must fit in 31 bits.
template <typename Fn>
void run_on_pool(xla::ffi::ThreadPool& pool, int64_t items, Fn fn) {
  if (items <= 0) return;
  auto work = std::make_shared<PoolWork<Fn>>(items, std::move(fn));
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  work->wait();
}

}  // namespace redjax
