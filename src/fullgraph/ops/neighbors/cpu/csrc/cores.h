// The cores a call gets when other processes share them, judged in C++ for the operators a
// compiled graph calls directly (nearest_small, small_nearest): threads.py's rule, its constants
// set from Python (native.py, judge_cores_by), over runs of calls of at least min_seconds of
// wall time together (JUDGED_RUN_SECONDS: a small call is ~0.1 ms, and the process's CPU time
// counts other threads' share only at scheduler ticks). While the cores are judged shared a call runs
// on one thread: torch's threads meet at the end of every parallel region, and one of them
// descheduled there costs the others its wait (2-core CPU, three busy processes beside:
// 2 x 64 x 300 D=16 k=4 in a compiled graph 1.55 ms on two threads).
#pragma once

#include <ATen/Parallel.h>

#include <chrono>
#include <ctime>
#include <mutex>

namespace fullgraph_cpu_cores {

struct Judge {
  std::mutex lock;
  double min_seconds = 2e-2, contended = 0.5, free = 0.9;  // threads.py's, until set
  int64_t free_calls = 3;
  bool shared = false;
  int64_t free_runs = 0;
  double wall = 0, cpu = 0;  // the run of calls so far
  bool serial = false;       // ... which ran on one thread
};

inline Judge& judge() {
  static Judge state;
  return state;
}

// One call's sample: wall and process CPU seconds, run on one thread or on ``threads``. Returns
// whether the cores are judged shared now.
inline bool sample(double wall, double cpu, bool serial, int64_t threads) {
  Judge& j = judge();
  std::lock_guard<std::mutex> guard(j.lock);
  if (wall <= 0) return j.shared;
  if (serial != j.serial) j.wall = j.cpu = 0, j.serial = serial;
  j.wall += wall;
  j.cpu += cpu;
  if (j.wall < j.min_seconds) return j.shared;
  const double share = j.cpu / j.wall;
  const int64_t used = serial ? 1 : threads;
  j.wall = j.cpu = 0;
  if (j.shared) {
    j.free_runs = share >= j.free ? j.free_runs + 1 : 0;
    if (j.free_runs >= j.free_calls) j.shared = false, j.free_runs = 0;
  } else if (used > 1 && share < j.contended * used) {
    j.shared = true, j.free_runs = 0;
  }
  return j.shared;
}

inline double process_seconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

inline double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ``Fitted call;`` at the top of an operator: the call on one thread while the cores are judged
// shared, and sampled. Calls within a fitted call (or a parallel region) are neither.
class Fitted {
 public:
  Fitted() : outermost_(depth()++ == 0 && !at::in_parallel_region()) {
    if (!outermost_) return;
    threads_ = at::get_num_threads();
    {
      Judge& j = judge();
      std::lock_guard<std::mutex> guard(j.lock);
      serial_ = j.shared || threads_ == 1;
    }
    // (as threads.fitted narrows torch's threads: its parallel regions then run in the caller)
    if (serial_ && threads_ > 1) at::set_num_threads(1);
    wall_ = wall_seconds();
    cpu_ = process_seconds();
  }
  ~Fitted() {
    --depth();
    if (!outermost_) return;
    const double cpu = process_seconds() - cpu_, wall = wall_seconds() - wall_;
    if (serial_ && threads_ > 1) at::set_num_threads(int(threads_));
    sample(wall, cpu, serial_, threads_);
  }
  Fitted(const Fitted&) = delete;
  Fitted& operator=(const Fitted&) = delete;

 private:
  static int& depth() {
    thread_local int calls = 0;
    return calls;
  }
  bool outermost_;
  bool serial_ = false;
  int64_t threads_ = 1;
  double wall_ = 0, cpu_ = 0;
};

}  // namespace fullgraph_cpu_cores
