// CPU kernel of init_rows: a new row's initial vector, a pure function of (seed, id, element)
// for the uniform, normal, truncated-normal and constant initializers (reference.init_vectors
// draws the same bits), and its optimizer state reset, written with non-temporal stores.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "embedding_checks.h"
#include "init_rows_checks.h"
#include "init_rows_math.h"
#include "row_storage.h"

namespace torchrec_ext {
namespace {

// Box-Muller on the two halves of `bits`: two independent standard normals.
inline void box_muller(uint64_t bits, double* z0, double* z1) {
  const double u1 = (static_cast<double>(bits >> 32) + 0.5) * 0x1p-32;
  const double u2 = static_cast<double>(bits & 0xFFFFFFFFull) * 0x1p-32;
  const double r = std::sqrt(-2.0 * std::log(u1));
  *z0 = r * std::cos(2.0 * M_PI * u2);
  *z1 = r * std::sin(2.0 * M_PI * u2);
}

// The default initializer, on every new row: written so the compiler vectorises the hashes
// (64-bit multiplies need AVX-512DQ, hence the x86-64-v4 clone).
TREXT_VECTOR_CLONES
void uniform_vector(float* out, int64_t dim, uint64_t key, double low, double span,
                    int64_t first_pair) {
  const int64_t pairs = dim / 2;
  for (int64_t q = 0; q < pairs; ++q) {
    const uint64_t bits = fmix64(key + static_cast<uint64_t>(first_pair + q + 1) * kGolden);
    out[2 * q] = static_cast<float>(low + span * (static_cast<double>(bits >> 40) * 0x1p-24));
    out[2 * q + 1] = static_cast<float>(
        low + span * (static_cast<double>((bits & 0xFFFFFFFFull) >> 8) * 0x1p-24));
  }
  if (dim % 2) {
    const uint64_t bits = pair_bits(key, first_pair + pairs, 0);
    out[dim - 1] = static_cast<float>(low + span * (static_cast<double>(bits >> 40) * 0x1p-24));
  }
}

// Elements first_column .. of the id's vector: a column shard of a table draws its columns
// of the whole table's vectors.
void init_vector(float* out, int64_t dim, uint64_t key, Init init, at::ArrayRef<double> p,
                 int64_t first_column) {
  if (init == Init::kConstant) {
    std::fill(out, out + dim, static_cast<float>(p[0]));
    return;
  }
  if (first_column % 2) {
    // One hash feeds two elements: draw from the pair holding the first column and drop the
    // pair's first element (every element is a function of its pair alone, so this is exact).
    thread_local std::vector<float> wide;
    wide.resize(dim + 1);
    init_vector(wide.data(), dim + 1, key, init, p, first_column - 1);
    std::copy(wide.begin() + 1, wide.end(), out);
    return;
  }
  const int64_t first_pair = first_column / 2;
  if (init == Init::kUniform) {
    uniform_vector(out, dim, key, p[0], p[1] - p[0], first_pair);
    return;
  }
  for (int64_t j = 0; j < dim; j += 2) {
    double z[2];
    box_muller(pair_bits(key, first_pair + j / 2, 0), &z[0], &z[1]);
    for (int64_t e = 0; e < 2 && j + e < dim; ++e) {
      double v = p[0] + p[1] * z[e];
      if (init == Init::kTruncatedNormal) {
        // Redraw out-of-range elements from the pair's next attempts; clamp after the last.
        for (int attempt = 1; attempt < kTruncNormalAttempts && (v < p[2] || v > p[3]); ++attempt) {
          double r[2];
          box_muller(pair_bits(key, first_pair + j / 2, attempt), &r[0], &r[1]);
          v = p[0] + p[1] * r[e];
        }
        v = std::min(std::max(v, p[2]), p[3]);
      }
      out[j + e] = static_cast<float>(v);
    }
  }
}

// Writes the initial vector of ids[i] into row rows[i] of `table` ([capacity, dim]) for every
// i with rows[i] >= 0 (a pure function of seed, id, element; see reference.init_vectors), and
// resets those rows of each optimizer state ([capacity, width]) to its initial value.
void init_rows_cpu(const at::Tensor& table, const at::Tensor& rows_in, const at::Tensor& ids_in,
                   int64_t seed, int64_t kind, at::ArrayRef<double> params, at::TensorList states,
                   at::ArrayRef<double> state_values) {
  const char* op = "init_rows";
  const at::ScalarType st = table.scalar_type();
  TORCH_CHECK(table.dim() == 2 && (st == at::kFloat || st == at::kHalf || st == at::kBFloat16) &&
                  table.is_contiguous(),
              op, ": table must be a contiguous 2-D float32, float16 or bfloat16 tensor, got ", st,
              " of shape ", table.sizes());
  // Half tables take the initial vector rounded to nearest even (a pure function still).
  const Storage storage = st == at::kFloat  ? Storage::kFloat
                          : st == at::kHalf ? Storage::kHalf
                                            : Storage::kBFloat16;
  const at::Tensor rows = rows_in.contiguous(), ids = ids_in.contiguous();
  check_long_1d(op, "rows", rows);
  check_long_1d(op, "ids", ids);
  TORCH_CHECK(rows.numel() == ids.numel(), op, ": rows and ids must have the same length, got ",
              rows.numel(), " and ", ids.numel());
  TORCH_CHECK(kind >= 0 && kind <= 3, op, ": unknown initializer kind ", kind);
  const size_t need = kind == 3 ? 1 : kind == 2 ? 4 : 2;
  TORCH_CHECK(params.size() == need || params.size() == need + 1, op, ": initializer kind ", kind,
              " needs ", need, " parameters (and optionally the first column), got ",
              params.size());
  // An optional last parameter: the table's first column in the whole table's vectors (a
  // column shard's).
  const double first_value = params.size() > need ? params[need] : 0.0;
  TORCH_CHECK(first_value >= 0 && first_value == std::floor(first_value) && first_value < 0x1p62,
              op, ": the first column must be an integer >= 0, got ", first_value);
  const int64_t first_column = static_cast<int64_t>(first_value);
  const int64_t cap = table.size(0), dim = table.size(1), n = rows.numel();
  TORCH_CHECK(state_values.size() == states.size(), op, ": one state value per state, got ",
              state_values.size(), " values for ", states.size(), " states");
  for (const at::Tensor& s : states)
    TORCH_CHECK(
        s.dim() == 2 && s.size(0) == cap && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
        ": optimizer states must be contiguous float32 [", cap, ", width] tensors, got ",
        s.sizes());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r[i] >= -1 && r[i] < cap, op, ": row ", r[i], " out of range [-1, ", cap, ")");
  char* w = static_cast<char*>(table.data_ptr());
  const int64_t row_bytes = dim * storage_bytes(storage);
  const Init init = static_cast<Init>(kind);
  const uint64_t s = static_cast<uint64_t>(seed);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(storage == Storage::kFloat ? 0 : dim);
    for (int64_t i = begin; i < end; ++i) {
      // New rows are scattered over the table: start fetching a few rows ahead for writing.
      const int64_t ahead = i + kPrefetchDistance;
      if (ahead < end && r[ahead] >= 0)
        prefetch_row(w + r[ahead] * row_bytes, row_bytes, 1);  // states are streamed
      if (r[i] < 0) continue;
      if (storage == Storage::kFloat) {
        init_vector(reinterpret_cast<float*>(w + r[i] * row_bytes), dim, row_key(id[i], s), init,
                    params, first_column);
      } else {
        init_vector(scratch.data(), dim, row_key(id[i], s), init, params, first_column);
        store_row(w + r[i] * row_bytes, scratch.data(), storage, dim, nullptr);
      }
      for (size_t k = 0; k < states.size(); ++k) {
        const int64_t width = states[k].size(1);
        float* row = states[k].data_ptr<float>() + r[i] * width;
        fill_streaming(row, width, static_cast<float>(state_values[k]));
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed stores visible before the op returns
#endif
  });
}

// init_rows of every table of a module in one call, in the flat storage (table t's rows at word
// table_offsets[t] in its storage dtype; its optimizer state rows at element state_offsets[t],
// one value per row when rowwise, else dim_t): each vector is the one init_rows draws for
// (table_seeds[t], id). The reference of the CUDA kernel (init_rows_cuda.cu), which writes the
// same bits in one launch.
void init_rows_tables_cpu(at::Tensor& weights, const at::Tensor& table_offsets,
                          const at::Tensor& table_dims,
                          const std::optional<at::Tensor>& table_dtypes, const at::Tensor& rows,
                          const at::Tensor& tables, const at::Tensor& ids,
                          const at::Tensor& table_seeds, const at::Tensor& table_kinds,
                          const at::Tensor& table_params, int64_t max_dim, at::TensorList states,
                          const std::optional<at::Tensor>& state_offsets, bool rowwise,
                          at::ArrayRef<double> state_values) {
  const char* op = kInitTablesOp;
  const int64_t T = check_init_rows_tables(weights, table_offsets, table_dims, table_dtypes, rows,
                                           tables, ids, table_seeds, table_kinds, table_params,
                                           max_dim, states, state_offsets, state_values);
  const std::vector<Storage> storage = table_storage(op, table_dtypes, T);
  const int64_t *offset = table_offsets.data_ptr<int64_t>(), *dims = table_dims.data_ptr<int64_t>();
  const int64_t *seeds = table_seeds.data_ptr<int64_t>(), *kinds = table_kinds.data_ptr<int64_t>();
  const double* params = table_params.data_ptr<double>();
  const int64_t* state_at = states.empty() ? nullptr : state_offsets->data_ptr<int64_t>();
  const int64_t *r = rows.data_ptr<int64_t>(), *tab = tables.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t n = rows.numel(), words = weights.numel();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(kinds[t] >= 0 && kinds[t] <= 3, op, ": unknown initializer kind ", kinds[t],
                " of table ", t);
    TORCH_CHECK(dims[t] >= 0 && dims[t] <= max_dim, op, ": table ", t, "'s dim ", dims[t],
                " must be in [0, max_dim = ", max_dim, "]");
  }
  // Every write in range before any is made (the tables unchanged on a refusal).
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0) {
      TORCH_CHECK(r[i] == -1, op, ": row ", r[i], " must be >= 0, or -1 to skip");
      continue;
    }
    TORCH_CHECK(tab[i] >= 0 && tab[i] < T, op, ": table ", tab[i], " out of range [0, ", T, ")");
    const int64_t t = tab[i], end = (r[i] + 1) * dims[t];  // in the table's dtype
    const int64_t end_word = offset[t] + (storage[t] == Storage::kFloat ? end : (end + 1) / 2);
    TORCH_CHECK(offset[t] >= 0 && end_word <= words, op, ": row ", r[i], " of table ", t,
                " ends at word ", end_word, ", past the ", words, "-word weights");
    for (size_t k = 0; k < states.size(); ++k) {
      const int64_t state_end = state_at[t] + (rowwise ? r[i] + 1 : end);
      TORCH_CHECK(state_at[t] >= 0 && state_end <= states[k].numel(), op, ": row ", r[i],
                  " of table ", t, " ends at element ", state_end, " of optimizer state ", k,
                  ", past its ", states[k].numel());
    }
  }
  char* w = static_cast<char*>(weights.data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(max_dim);
    for (int64_t i = begin; i < end; ++i) {
      if (r[i] < 0 || dims[tab[i]] == 0) continue;  // (a table of no columns: no state either)
      const int64_t t = tab[i], dim = dims[t];
      init_vector(scratch.data(), dim, row_key(id[i], static_cast<uint64_t>(seeds[t])),
                  static_cast<Init>(kinds[t]), at::ArrayRef<double>(params + 4 * t, 4), 0);
      const int64_t row_bytes = dim * storage_bytes(storage[t]);
      store_row(w + 4 * offset[t] + r[i] * row_bytes, scratch.data(), storage[t], dim, nullptr);
      for (size_t k = 0; k < states.size(); ++k) {
        float* s = states[k].data_ptr<float>() + state_at[t] + (rowwise ? r[i] : r[i] * dim);
        std::fill(s, s + (rowwise ? 1 : dim), static_cast<float>(state_values[k]));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) {
  m.impl("init_rows", &init_rows_cpu);
  m.impl("init_rows_tables", &init_rows_tables_cpu);
}

}  // namespace torchrec_ext
