// ---- threads ------------------------------------------------------------------------------
//
// Two ways to split a call's outputs over torch.get_num_threads() threads, chosen at run time
// by `rows_pool(mode)` (both compute every output with the same arithmetic, so results are
// bit for bit the same either way):
//  - default: torch's OpenMP team (at::parallel_for, static shares). Best where the cores
//    are the process's own.
//  - the work-sharing pool below: about as fast on cores of its own, and several times
//    faster than OpenMP where other processes busy the cores, because nothing waits for an
//    unscheduled thread (docs/kernels.md, "threads", has the measurements).
//
// Chunks of a call run on torch.get_num_threads() threads: the calling thread and resident
// workers each claim the chunks of their own contiguous share first, then what is left of
// the others' (atomic counters), and the call returns once every claimed chunk is done.
// Which thread computes a chunk never changes its arithmetic. Unlike an OpenMP team
// (at::parallel_for) nothing waits for a thread that has not started: on a machine whose
// cores other processes also use, a worker the OS has not scheduled claims nothing and the
// caller computes its chunks, where an OpenMP barrier waits (with default spinning) for
// every thread of the team, and one descheduled thread stalls the whole call.
// Workers spin ~1 ms for the next call (a step's products follow one another within
// microseconds), then sleep on a condition variable. A call made while another thread's call
// holds the pool, or inside a parallel region, or in a forked child (no workers there: it
// claims every chunk itself), runs on the calling thread alone.
namespace {

std::atomic<bool> g_use_pool{false};  // rows_pool(): false = OpenMP (at::parallel_for)
inline bool use_pool() { return g_use_pool.load(std::memory_order_relaxed); }

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: its detached workers may outlive exit
    return *pool;
  }

  // f(c) for every chunk c in [0, n), each on one thread
  template <typename F>
  void run(int64_t n, const F& f) {
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
    std::unique_lock<std::mutex> owner(submit_, std::try_to_lock);
    if (threads <= 1 || !owner.owns_lock() || at::in_parallel_region()) {
      for (int64_t c = 0; c < n; ++c) f(c);
      return;
    }
    start_workers(static_cast<int>(threads) - 1);
    auto job = std::make_shared<Job>();
    job->n = n;
    job->helpers = static_cast<int>(threads) - 1;
    job->fn = [&f](int64_t c) { f(c); };
    job->mxcsr = _mm_getcsr();  // the caller's denormal modes on every thread
    job->shares.reset(new Share[threads]);
    for (int64_t t = 0; t < threads; ++t) {
      job->shares[t].next.store(t * n / threads, std::memory_order_relaxed);
      job->shares[t].end = (t + 1) * n / threads;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      current_ = job;
      seq_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work(*job, 0);
    // chunks claimed by workers: a worker holding one is running it (or preempted in it)
    for (int spins = 0; job->done.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) _mm_pause();
      else sched_yield();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    current_.reset();  // a late worker finds no job; one holding `job` claims only c >= n
  }

 private:
  struct alignas(64) Share {  // the chunks [next, end) a thread takes first; others take the rest
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  struct Job {
    int64_t n = 0;
    int helpers = 0;
    unsigned mxcsr = 0;
    std::function<void(int64_t)> fn;
    std::unique_ptr<Share[]> shares;
    std::atomic<int64_t> done{0};
  };

  // thread t (0: the caller) takes its own contiguous share of the chunks first (each
  // thread streams its own part of the weights, as a static split would), then what is left
  // of the others' shares: a thread that has not started leaves its share to the others
  static void work(Job& job, int t) {
    const int T = job.helpers + 1;
    for (int i = 0; i < T; ++i) {
      Share& share = job.shares[(t + i) % T];
      for (int64_t c; (c = share.next.fetch_add(1, std::memory_order_relaxed)) < share.end;) {
        job.fn(c);
        job.done.fetch_add(1, std::memory_order_release);
      }
    }
  }

  void start_workers(int count) {  // with submit_ held
    while (static_cast<int>(workers_) < count) {
      const int id = static_cast<int>(workers_++);
      std::thread([this, id] { worker(id); }).detach();
    }
  }

  void worker(int id) {
    uint64_t seen = seq_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(1000);
      for (int i = 0; seq_.load(std::memory_order_acquire) == seen; ++i) {
        _mm_pause();
        if ((i & 255) == 255) {
          if (std::chrono::steady_clock::now() > until) break;
          if (i >= 2048) sched_yield();  // a thread waiting for this core (torch's own) runs first
        }
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return seq_.load(std::memory_order_acquire) != seen; });
        seen = seq_.load(std::memory_order_acquire);
        job = current_;
      }
      if (job && id < job->helpers) {
        _mm_setcsr(job->mxcsr);
        work(*job, id + 1);
      }
    }
  }

  std::mutex submit_;  // one call at a time uses the workers
  std::mutex mutex_;   // current_ and the wake-ups
  std::condition_variable wake_;
  std::shared_ptr<Job> current_;
  std::atomic<uint64_t> seq_{0};
  size_t workers_ = 0;
};

// f(o0, o1) over [0, O) in chunks of whole 12-row groups (every tile height divides 12),
// about 8 chunks per thread so that a slow thread's share is taken by the others
template <typename F>
void for_outputs(int64_t O, const F& f) {
  if (!use_pool()) {  // the default: torch's OpenMP team, outputs split in static shares
    at::parallel_for(0, O, 64, f);
    return;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(12, (O + 8 * threads * 12 - 1) / (8 * threads * 12) * 12);
  const int64_t n = (O + chunk - 1) / chunk;
  Pool::get().run(n, [&](int64_t c) { f(c * chunk, std::min(O, (c + 1) * chunk)); });
}

}  // namespace

// mode 1: the work-sharing pool, 0: OpenMP (the default), -1: no change; returns the previous
// mode (1 or 0). Results are bit-identical in both modes.
int64_t rows_pool(int64_t mode);
int64_t rows_pool(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "rows_pool: mode must be -1 (query), 0 (OpenMP) or 1 (pool), got ", mode);
  const bool before = g_use_pool.load();
  if (mode >= 0) g_use_pool.store(mode == 1);
  return before ? 1 : 0;
}
