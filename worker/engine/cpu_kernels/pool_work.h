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
//
// A helper that starts on its caller's core moves to another one first (leave_core). Linux puts a
// woken thread next to its waker when the machine's recent use is high (it then skips the search
// for an idle core), and the two stay there: each has run in the last half millisecond, which makes
// both too "cache hot" for the balancer to move. The helper and its caller then take turns on one
// core while the other sits idle, for tens of milliseconds at a time under `redjax serve` on two
// cores (perf sched: 9 % of a core in a serving run of the demo model, 3 % offline).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#ifdef __linux__
#include <sched.h>
#endif

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

// The core this thread runs on, or -1 where that is unknown.
inline int current_cpu() {
#ifdef __linux__
  return sched_getcpu();
#else
  return -1;
#endif
}

// Called by the helper numbered `nth` (from 0) of a caller on core `caller_cpu`: if this thread
// runs on that core too, it moves to the nth allowed core after it (two system calls: pin there,
// which migrates the running thread, then allow its old set again, which does not move it back).
inline void leave_core(int caller_cpu, int64_t nth) {
#ifdef __linux__
  if (caller_cpu < 0 || sched_getcpu() != caller_cpu) return;
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2) return;
  int target = caller_cpu;
  for (int64_t step = 0; step <= nth;) {
    target = (target + 1) % CPU_SETSIZE;
    if (target != caller_cpu && CPU_ISSET(target, &allowed)) ++step;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(target, &one);
  if (sched_setaffinity(0, sizeof one, &one) == 0) sched_setaffinity(0, sizeof allowed, &allowed);
#endif
}

// Runs fn(0) .. fn(items - 1) over the pool and the calling thread; returns when all are done.
// items must fit in 31 bits.
template <typename Fn>
void run_on_pool(xla::ffi::ThreadPool& pool, int64_t items, Fn fn) {
  if (items <= 0) return;
  auto work = std::make_shared<PoolWork<Fn>>(items, std::move(fn));
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items) - 1;
  const int caller_cpu = helpers > 0 ? current_cpu() : -1;
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([work, caller_cpu, i] {
      if (work->next.load(std::memory_order_relaxed) < work->items) leave_core(caller_cpu, i);
      work->run();
    });
  work->run();
  work->wait();
}

}  // namespace redjax
