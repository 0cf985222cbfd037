// CPU kernel of copy_rows: dst[dst_rows[i]] = src[src_rows[i]], whole rows, one memcpy each.
// What a tiered table's moves between its cache and its backing store are (tiered_tables.py):
// `dst.index_copy_(0, rows, src)` walks its rows element by element (4-5x the time of
// copy_rows at dlrm-small scale: benchmarks/results/tier_copy_rows.md), and
// `index_copy_(index_select(...))` makes an intermediate besides. Rows may be strided (a
// field of a records buffer: rows of record_bytes), their elements contiguous.
//
// And of guarded_copy_rows: the same copy where src or dst may be a file mapping (a file-backed
// tiered table's backing files, torchrec_ext/modules/tier_store.py). A page of a mapping that
// cannot be read (a disk I/O error, or the file truncated by another process) raises SIGBUS in
// the thread touching it; inside a guarded copy that SIGBUS ends the copy and the op returns the
// faulting address (the Python side raises OSError naming the file and the offset:
// torchrec_ext/modules/tier_guard.py).
//
// The handler (install_sigbus_guard_once: SA_SIGINFO | SA_ONSTACK) looks at a thread-local
// pointer to the guard of the copy running in its thread. A SIGBUS the kernel raised for an
// address within the guard's tensors jumps back (siglongjmp) to the copy's start, which returns
// the address. Any other SIGBUS (no guard active, sent by kill(), another address) goes to the
// handler installed before this one, or, when that was the default action (or SIG_IGN, for a
// fault's SIGBUS: the kernel does not let a fault's SIGBUS be ignored), restores the default and
// raises the signal again: the process dies by SIGBUS as it would have without the guard.
// The guarded loop takes no lock and allocates nothing (it may be left mid-way by the jump).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace torchrec_ext {

void install_sigbus_guard_once();

namespace {

// Bytes of one row of t (1-D: one element; 2-D: its columns, which must be contiguous).
int64_t row_bytes(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "copy_rows: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 1 || t.dim() == 2, "copy_rows: ", name, " must be 1-D or 2-D (rows), got ",
              t.dim(), "-D");
  if (t.dim() == 1) {
    return static_cast<int64_t>(t.element_size());
  }
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, "copy_rows: the elements of each row of ", name,
              " must be contiguous, got strides ", t.strides());
  return t.size(1) * static_cast<int64_t>(t.element_size());
}

constexpr int64_t kAhead = 8;
constexpr int64_t kLineBytes = 64;

inline void prefetch_lines(const char* row, int64_t bytes, bool write) {
  for (int64_t at = 0; at < bytes; at += kLineBytes) {
    if (write) {
      __builtin_prefetch(row + at, 1);
    } else {
      __builtin_prefetch(row + at, 0);
    }
  }
}

int64_t row_stride_bytes(const at::Tensor& t) {
  return t.stride(0) * static_cast<int64_t>(t.element_size());
}

// The rows' numbers (int64 [n], each in [0, bound)), checked before anything is written.
const int64_t* checked_rows(const at::Tensor& rows, int64_t bound, const char* name) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                  rows.is_contiguous(),
              "copy_rows: ", name, " must be a contiguous CPU int64 1-D tensor, got ",
              rows.scalar_type(), " ", rows.sizes(), " on ", rows.device());
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < bound, "copy_rows: ", name, "[", i, "] = ", r[i],
                " is out of range: the tensor has ", bound, " rows");
  }
  return r;
}

// What a copy does: rows, strides and the memory each side spans, every row number checked.
struct Plan {
  char* dst;
  const char* src;
  const int64_t* dst_rows;  // nullptr: row i
  const int64_t* src_rows;
  int64_t dst_stride;  // bytes between rows
  int64_t src_stride;
  int64_t width;  // bytes of a row
  int64_t n;
  uintptr_t lo[2];  // the memory of dst, then src
  uintptr_t hi[2];
};

void span(const at::Tensor& t, int64_t width, uintptr_t& lo, uintptr_t& hi) {
  lo = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  hi = t.size(0) == 0 ? lo
                      : lo + static_cast<uintptr_t>((t.size(0) - 1) * row_stride_bytes(t) + width);
}

Plan checked_plan(const at::Tensor& dst, const std::optional<at::Tensor>& dst_rows,
                  const at::Tensor& src, const std::optional<at::Tensor>& src_rows) {
  const int64_t width = row_bytes(dst, "dst");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(),
              "copy_rows: src and dst must have one dtype, got ", src.scalar_type(), " and ",
              dst.scalar_type());
  TORCH_CHECK(row_bytes(src, "src") == width,
              "copy_rows: src and dst rows must be the same size, got ", src.sizes(), " and ",
              dst.sizes());
  TORCH_CHECK(!dst.storage().is_alias_of(src.storage()),
              "copy_rows: src and dst must not share memory");
  TORCH_CHECK(!src_rows || !dst_rows || src_rows->numel() == dst_rows->numel(),
              "copy_rows: dst_rows and src_rows must have one length, got ",
              dst_rows ? dst_rows->numel() : 0, " and ", src_rows ? src_rows->numel() : 0);
  const int64_t n = src_rows ? src_rows->numel() : dst_rows ? dst_rows->numel() : src.size(0);
  const int64_t* from = src_rows ? checked_rows(*src_rows, src.size(0), "src_rows") : nullptr;
  const int64_t* to = dst_rows ? checked_rows(*dst_rows, dst.size(0), "dst_rows") : nullptr;
  TORCH_CHECK(from || n <= src.size(0), "copy_rows: ", n, " rows to copy, src has ", src.size(0));
  TORCH_CHECK(to || n <= dst.size(0), "copy_rows: ", n, " rows to copy, dst has ", dst.size(0));
  Plan p;
  p.dst = static_cast<char*>(dst.data_ptr());
  p.src = static_cast<const char*>(src.const_data_ptr());
  p.dst_rows = to;
  p.src_rows = from;
  p.dst_stride = row_stride_bytes(dst);
  p.src_stride = row_stride_bytes(src);
  p.width = width;
  p.n = width == 0 ? 0 : n;
  span(dst, width, p.lo[0], p.hi[0]);
  span(src, width, p.lo[1], p.hi[1]);
  return p;
}

// Rows [begin, end) of the plan.
void copy_part(const Plan& p, int64_t begin, int64_t end) {
  // Rows at random places: each copy would wait on memory in turn. Every cache line of the
  // row kAhead rows on is asked for first, so that ~kAhead rows are on their way at once
  // (benchmarks/results/tier_copy_rows.md). (A prefetch never faults: a mapped page that
  // cannot be read raises its SIGBUS at the copy.)
  for (int64_t i = begin; i < end; ++i) {
    if (i + kAhead < end) {
      if (p.src_rows) {
        prefetch_lines(p.src + p.src_rows[i + kAhead] * p.src_stride, p.width, /*write=*/false);
      }
      if (p.dst_rows) {
        prefetch_lines(p.dst + p.dst_rows[i + kAhead] * p.dst_stride, p.width, /*write=*/true);
      }
    }
    const int64_t d = p.dst_rows ? p.dst_rows[i] : i;
    const int64_t s = p.src_rows ? p.src_rows[i] : i;
    std::memcpy(p.dst + d * p.dst_stride, p.src + s * p.src_stride, static_cast<size_t>(p.width));
  }
}

// A grain of 4096 rows keeps small copies on the calling thread.
constexpr int64_t kGrain = 4096;

void copy_rows_cpu(at::Tensor& dst, const std::optional<at::Tensor>& dst_rows,
                   const at::Tensor& src, const std::optional<at::Tensor>& src_rows) {
  const Plan p = checked_plan(dst, dst_rows, src, src_rows);
  at::parallel_for(0, p.n, kGrain, [&](int64_t begin, int64_t end) { copy_part(p, begin, end); });
}

// ---- the guard

// The copy running in a thread: where to jump back to, and the memory it touches (a SIGBUS at
// another address is not its own).
struct Guard {
  sigjmp_buf back;
  const Plan* plan;
  volatile uintptr_t fault;
};

// initial-exec: read by the handler with one load off the thread pointer (the default model of a
// shared library may call __tls_get_addr, which can allocate: not safe in a signal handler).
__attribute__((tls_model("initial-exec"))) thread_local Guard* active_guard = nullptr;

struct sigaction previous_action;
std::once_flag install_once;

void chain(int sig, siginfo_t* info, void* context) {
  // A fault's SIGBUS (si_code > 0) cannot be ignored: the kernel resets SIG_IGN to the default
  // action for it (returning would run the faulting instruction again, and fault again, for good).
  const bool fault = info != nullptr && info->si_code > 0;
  if (previous_action.sa_handler == SIG_DFL || (previous_action.sa_handler == SIG_IGN && fault)) {
    // The default action: restored, and the signal raised again. It is blocked while this handler
    // runs, so it is delivered (and kills the process) when the handler returns; a fault of an
    // instruction re-executed faults again under the default action alike.
    struct sigaction default_action;
    std::memset(&default_action, 0, sizeof(default_action));
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    sigaction(sig, &default_action, nullptr);
    raise(sig);
    return;
  }
  if (previous_action.sa_handler == SIG_IGN) {
    return;  // (sent by kill() or raise(): ignored, as it was before this handler)
  }
  if (previous_action.sa_flags & SA_SIGINFO) {
    previous_action.sa_sigaction(sig, info, context);
  } else {
    previous_action.sa_handler(sig);
  }
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  Guard* guard = active_guard;
  if (guard != nullptr && info != nullptr &&
      info->si_code > 0) {  // (> 0: raised by the kernel, not sent)
    const auto at = reinterpret_cast<uintptr_t>(info->si_addr);
    for (int k = 0; k < 2; ++k) {
      if (at >= guard->plan->lo[k] && at < guard->plan->hi[k]) {
        guard->fault = at;
        active_guard = nullptr;
        siglongjmp(guard->back, 1);
      }
    }
  }
  chain(sig, info, context);
}

// Rows [begin, end) of the plan under this thread's guard; 0, or the address of the SIGBUS that
// ended the copy (the rows before it copied, the rest not; other threads' parts may be copied).
__attribute__((noinline)) uintptr_t copy_guarded(const Plan& p, int64_t begin, int64_t end) {
  Guard guard;
  guard.plan = &p;
  guard.fault = 0;
  if (sigsetjmp(guard.back, 0) != 0) {
    // Back from the handler, which cleared active_guard. SIGBUS stays blocked in this thread
    // after the jump (the mask was not saved: no system call per copy): unblocked here.
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
    return guard.fault;
  }
  active_guard = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  copy_part(p, begin, end);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  active_guard = nullptr;
  return 0;
}

at::Tensor guarded_copy_rows_cpu(const at::Tensor& dst, const std::optional<at::Tensor>& dst_rows,
                                 const at::Tensor& src, const std::optional<at::Tensor>& src_rows) {
  const Plan p = checked_plan(dst, dst_rows, src, src_rows);
  // (a tensor, not an int: functionalization refuses a mutating custom op returning a scalar)
  at::Tensor result = at::zeros({}, at::TensorOptions().dtype(at::kLong));
  if (p.n == 0) {
    return result;
  }
  install_sigbus_guard_once();
  std::atomic<uintptr_t> fault{0};
  at::parallel_for(0, p.n, kGrain, [&](int64_t begin, int64_t end) {
    if (fault.load(std::memory_order_relaxed) != 0) {
      return;  // another part failed: the copy fails whatever this part does
    }
    const uintptr_t at = copy_guarded(p, begin, end);
    if (at != 0) {
      uintptr_t none = 0;
      fault.compare_exchange_strong(none, at);
    }
  });
  result.fill_(static_cast<int64_t>(fault.load()));
  return result;
}

// pread_rows: copy_rows from a file mapping without touching it. Each run of consecutive rows is
// one pread(2) of the file behind `src` (`fd`, `src` starting at byte `src_offset` of it) into dst:
// the process maps none of the file's pages (a copy through the mapping maps each row's page and
// the kernel's fault-around its neighbours: resident memory grows with every page the tables
// read), and a page that cannot be read is an errno, not a SIGBUS. `src` gives the shape, dtype
// and row stride only. Returns int64 [2]: {-1, 0} when every row was read; else the file offset of
// the read that failed, and its errno (0: the file ended there). Rows before it may be read.
at::Tensor pread_rows_cpu(const at::Tensor& dst, const std::optional<at::Tensor>& dst_rows,
                          const at::Tensor& src, const std::optional<at::Tensor>& src_rows,
                          int64_t fd, int64_t src_offset) {
  const Plan p = checked_plan(dst, dst_rows, src, src_rows);
  TORCH_CHECK(fd >= 0 && src_offset >= 0, "pread_rows: fd and src_offset must be >= 0, got ", fd,
              " and ", src_offset);
  at::Tensor result = at::tensor({int64_t{-1}, int64_t{0}}, at::TensorOptions().dtype(at::kLong));
  const bool whole_rows = p.dst_stride == p.width && p.src_stride == p.width;
  for (int64_t i = 0; i < p.n;) {
    const int64_t d = p.dst_rows ? p.dst_rows[i] : i;
    const int64_t s = p.src_rows ? p.src_rows[i] : i;
    int64_t j = i + 1;  // rows i..j-1 lie back to back in the file and in dst: one read
    while (whole_rows && j < p.n && (p.src_rows ? p.src_rows[j] : j) == s + (j - i) &&
           (p.dst_rows ? p.dst_rows[j] : j) == d + (j - i)) {
      ++j;
    }
    char* out = p.dst + d * p.dst_stride;
    const int64_t at = src_offset + s * p.src_stride;
    const int64_t len = (j - i) * p.width;
    for (int64_t done = 0; done < len;) {
      const ssize_t got = pread(static_cast<int>(fd), out + done, static_cast<size_t>(len - done),
                                static_cast<off_t>(at + done));
      const int err = got < 0 ? errno : 0;  // (read before anything else may set it)
      if (err == EINTR) {
        continue;
      }
      if (got <= 0) {
        result[0] = at + done;
        result[1] = err;
        return result;
      }
      done += got;
    }
    i = j;
  }
  return result;
}

}  // namespace

void install_sigbus_guard_once() {
  std::call_once(install_once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    TORCH_CHECK(sigaction(SIGBUS, &action, &previous_action) == 0,
                "guarded_copy_rows: cannot install the SIGBUS handler: ", std::strerror(errno));
  });
}

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) {
  m.impl("copy_rows", &copy_rows_cpu);
  m.impl("guarded_copy_rows", &guarded_copy_rows_cpu);
  m.impl("pread_rows", &pread_rows_cpu);
}

}  // namespace torchrec_ext
