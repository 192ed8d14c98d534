// How the kernel core hands out independent items (column groups, rows) to its threads, where a
// static split leaves one thread waiting for the other at the end of a call.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace kvserve {
namespace KVSERVE_LEVEL_NS {

// [0, n) cut into one contiguous run per thread, each run taken from its front a chunk at a time
// by its thread; a thread whose run is done takes chunks from the back of the run with the most
// left. So every thread streams its own part of a weight in the order it is stored (what a
// static split gives), and no thread waits at the end while another finishes: in a decode step
// the two cores of a host read memory at different speeds, and a static split of each of the
// step's ~150 projections left one core idle for 10-20% of it (libgomp's barrier in the
// profile). Which thread computes an item never changes its value.
class StealingRange {
 public:
  StealingRange(int64_t n, int threads, int64_t chunk) : threads_(threads), chunk_(std::max<int64_t>(1, chunk)) {
    runs_.reset(new Run[threads]);
    for (int t = 0; t < threads; ++t) {
      const uint64_t b = static_cast<uint64_t>(n * t / threads), e = static_cast<uint64_t>(n * (t + 1) / threads);
      runs_[t].v.store(b << 32 | e, std::memory_order_relaxed);
    }
  }

  // The next chunk [b, e) for thread t: its own run's front, else the fullest run's back; false
  // when nothing is left anywhere.
  bool next(int t, int64_t& b, int64_t& e) {
    if (take(runs_[t], true, b, e)) return true;
    for (;;) {
      int victim = -1;
      int64_t most = 0;
      for (int i = 0; i < threads_; ++i) {
        const uint64_t v = runs_[i].v.load(std::memory_order_relaxed);
        const int64_t left = static_cast<int64_t>(v & kMask) - static_cast<int64_t>(v >> 32);
        if (left > most) most = left, victim = i;
      }
      if (victim < 0) return false;
      if (take(runs_[victim], false, b, e)) return true;
    }
  }

 private:
  static constexpr uint64_t kMask = 0xffffffffu;
  struct alignas(64) Run {  // (begin << 32) | end, one cache line each
    std::atomic<uint64_t> v{0};
  };

  bool take(Run& run, bool front, int64_t& b, int64_t& e) {
    uint64_t v = run.v.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(v >> 32), hi = static_cast<int64_t>(v & kMask);
      if (lo >= hi) return false;
      const int64_t cut = front ? std::min(hi, lo + chunk_) : std::max(lo, hi - chunk_);
      const uint64_t nv = front ? (static_cast<uint64_t>(cut) << 32 | static_cast<uint64_t>(hi))
                                : (static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(cut));
      if (run.v.compare_exchange_weak(v, nv, std::memory_order_relaxed)) {
        b = front ? lo : cut;
        e = front ? cut : hi;
        return true;
      }
    }
  }

  int threads_;
  int64_t chunk_;
  std::unique_ptr<Run[]> runs_;
};

}  // namespace KVSERVE_LEVEL_NS
}  // namespace kvserve
