// The kernels' own worker threads: `int8k::parallel_for` splits a range over the threads the engine was given.
//
// Why not at::parallel_for. It is a header template that is parallel only where the including file is built with
// OpenMP; this extension was built without it, so every kernel ran on one thread whatever engine.num_threads said.
// Built with -fopenmp instead, the kernels ran 1.8x faster on the thread that had loaded the model (a 1-row step
// 25.6 -> 14.1 ms, Qwen2.5-0.5B on 2 cores) but not on the engine's own thread (27.8 -> 24.8 ms): libgomp keeps a
// team per calling thread, and once the process holds more of its threads than there are cores it stops spinning
// and sleeps between parallel regions, and a step has ~170 of them. Spinning them all (OMP_WAIT_POLICY=ACTIVE)
// was worse (37.9 ms): the idle teams took the cores. One pool, shared by every caller, avoids both.
//
// Design note — one job at a time, chunks claimed from one word:
//   * The caller is a participant: it publishes a job (a range cut into chunks), wakes the workers, claims chunks
//     like them and returns when every chunk is done. A second caller while a job runs (the safety models' e5 on
//     another thread) does not queue: it runs its range itself, serially.
//   * Chunks are claimed from one 64-bit word holding the job's generation, its chunk count and the next chunk
//     (compare-and-swap), so a worker that wakes late can never take a chunk of a finished or later job; it reads
//     the job only after its claim succeeded, and the job cannot end before that chunk is done.
//   * About four chunks per thread: a worker the OS has preempted delays the job by at most the chunk it holds, and
//     the others take the rest. Which thread runs a chunk never changes a result (every kernel writes disjoint
//     outputs; the screened head merges its chunks' candidates under a lock, in any order).
//   * Between jobs a worker spins for SPIN_US (pausing, and yielding to any other runnable thread), then sleeps on a
//     condition variable; a decode step's jobs come microseconds apart, so a step pays no wake-ups.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <pthread.h>

namespace int8k {

class Pool;
inline Pool& pool();

class Pool {
 public:
  static constexpr int MAX_THREADS = 256;
  static constexpr int CHUNKS_PER_THREAD = 4;
  static constexpr int64_t SPIN_US = 2000;

  Pool() {
    // A forked child has none of the workers: it runs every job alone and never joins their threads.
    pthread_atfork(nullptr, nullptr, [] { pool().forget_workers(); });
  }
  ~Pool() { resize(1); }

  // Participants of a job, the caller included; 1 runs everything on the caller.
  void resize(int n) {
    n = std::clamp(n, 1, MAX_THREADS);
    std::lock_guard<std::mutex> job(busy_);
    if (n == static_cast<int>(workers_.size()) + 1) return;
    {
      std::lock_guard<std::mutex> lock(sleep_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    stop_.store(false);
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { work(); });
    threads_.store(n);
  }

  int threads() const { return threads_.load(std::memory_order_relaxed); }

  void forget_workers() {  // in a forked child only: the threads are gone, their handles must not be joined
    new (&workers_) std::vector<std::thread>();  // the parent's vector is abandoned, not destroyed
    new (&busy_) std::mutex();
    new (&sleep_) std::mutex();
    new (&wake_) std::condition_variable();
    sleeping_.store(0);
    threads_.store(1);
  }

  // Whether this thread is running a chunk (a parallel_for inside it runs serially).
  static bool& inside() {
    thread_local bool b = false;
    return b;
  }

  // `chunks_per_thread`: more for long, even jobs (a prompt chunk's GEMM), so that a thread slowed by another
  // process or left the last chunk does not leave the others waiting long; fewer costs less per job.
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f, int chunks_per_thread = CHUNKS_PER_THREAD) {
    if (begin >= end) return;
    grain = std::max<int64_t>(grain, 1);
    const int64_t items = end - begin, most = (items + grain - 1) / grain;
    if (threads() == 1 || most < 2 || inside() || !busy_.try_lock()) {  // serial: alone, small, nested or busy
      f(begin, end);
      return;
    }
    std::lock_guard<std::mutex> job(busy_, std::adopt_lock);
    const int n = threads();  // fixed while busy_ is held (resize takes it)
    const int64_t chunks = std::min<int64_t>(most, static_cast<int64_t>(n) * chunks_per_thread);
    Job j{&f, &call<F>, begin, end, (items + chunks - 1) / chunks};
    job_ = j;
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 40) + 1;
    // seq_cst store and load (and the sleeper's seq_cst increment): either it sees this job or we see it asleep
    ticket_.store(((gen & 0xFFFFFF) << 40) | (static_cast<uint64_t>(chunks) << 20), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    run_chunks();
    for (int spins = 1; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      _mm_pause();
      if ((spins & 63) == 0) std::this_thread::yield();  // a preempted worker holding a chunk may need this core
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  struct Job {
    const void* f;
    void (*call)(const void*, int64_t, int64_t);
    int64_t begin, end, per_chunk;
  };

  template <class F>
  static void call(const void* f, int64_t b, int64_t e) {
    (*static_cast<const F*>(f))(b, e);
  }

  // Claim and run chunks of the published job until none is left.
  void run_chunks() {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (true) {
      const uint64_t chunks = (t >> 20) & 0xFFFFF, next = t & 0xFFFFF;
      if (next >= chunks) return;
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      const Job j = job_;  // ours until our chunk is counted done
      const int64_t b = j.begin + static_cast<int64_t>(next) * j.per_chunk, e = std::min(j.end, b + j.per_chunk);
      inside() = true;
      try {
        if (b < e) j.call(j.f, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(sleep_);
        if (!error_) error_ = std::current_exception();
      }
      inside() = false;
      done_.fetch_add(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void work() {
    uint64_t seen = ticket_.load(std::memory_order_acquire) >> 40;
    while (true) {
      auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
      for (int spins = 0;; ++spins) {
        if (stop_) return;
        if ((ticket_.load(std::memory_order_acquire) >> 40) != seen) break;
        if ((spins & 63) == 63) {
          if (std::chrono::steady_clock::now() > until) {
            std::unique_lock<std::mutex> lock(sleep_);
            sleeping_.fetch_add(1, std::memory_order_seq_cst);
            wake_.wait(lock, [&] { return stop_ || (ticket_.load(std::memory_order_acquire) >> 40) != seen; });
            sleeping_.fetch_sub(1, std::memory_order_acq_rel);
            until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
          } else {
            std::this_thread::yield();  // lets a runnable thread (the token streamer, a classifier) have the core
          }
        }
        _mm_pause();
      }
      seen = ticket_.load(std::memory_order_acquire) >> 40;
      run_chunks();
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<int> threads_{1};
  std::atomic<uint64_t> ticket_{0};  // generation (24 bits) | chunks (20) | next chunk (20)
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::exception_ptr error_;
  Job job_{};
  std::atomic<bool> stop_{false};
};

inline Pool& pool() {
  static Pool p;
  return p;
}

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f,
                         int chunks_per_thread = Pool::CHUNKS_PER_THREAD) {
  pool().parallel_for(begin, end, grain, f, chunks_per_thread);
}

}  // namespace int8k
