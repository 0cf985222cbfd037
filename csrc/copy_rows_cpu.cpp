// CPU kernel of copy_rows: dst[dst_rows[i]] = src[src_rows[i]], whole rows, one memcpy each.
// What a tiered table's moves between its cache and its backing store are (tiered_tables.py):
// `dst.index_copy_(0, rows, src)` walks its rows element by element (2.5-4.6x the time of
// copy_rows at dlrm-small scale: benchmarks/results/tier_copy_rows.md), and
// `index_copy_(index_select(...))` makes an intermediate besides. Rows may be strided (a
// field of a records buffer: rows of record_bytes), their elements contiguous.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace torchrec_ext {
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

void copy_rows_cpu(at::Tensor& dst, const std::optional<at::Tensor>& dst_rows,
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
  if (n == 0 || width == 0) {
    return;
  }
  const auto* src_base = static_cast<const char*>(src.const_data_ptr());
  auto* dst_base = static_cast<char*>(dst.data_ptr());
  const int64_t src_stride = row_stride_bytes(src);
  const int64_t dst_stride = row_stride_bytes(dst);
  // Rows at random places: each copy would wait on memory in turn. Every cache line of the
  // row kAhead rows on is asked for first, so that ~kAhead rows are on their way at once
  // (benchmarks/results/tier_copy_rows.md). A grain of 4096 rows keeps small copies on the
  // calling thread.
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) {
        if (from) {
          prefetch_lines(src_base + from[i + kAhead] * src_stride, width, /*write=*/false);
        }
        if (to) {
          prefetch_lines(dst_base + to[i + kAhead] * dst_stride, width, /*write=*/true);
        }
      }
      const int64_t s = from ? from[i] : i;
      const int64_t d = to ? to[i] : i;
      std::memcpy(dst_base + d * dst_stride, src_base + s * src_stride, static_cast<size_t>(width));
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("copy_rows", &copy_rows_cpu); }

}  // namespace torchrec_ext
