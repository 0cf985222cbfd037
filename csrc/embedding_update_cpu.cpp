// CPU kernel of fused_update: the lookups' backward fused with the optimizer step (SGD,
// Adagrad, row-wise Adagrad, Adam, AdamW, FTRL), rows stored back rounded to nearest or
// stochastically; a new row is written once, its initial vector stepped.
//
// The backward never materialises a per-id gradient: values are grouped by unique row (a
// counting sort of `inverse`), and each unique row sums its values' output gradients and takes
// its optimizer step in one pass, in parallel over unique rows (no two threads share a row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "embedding_checks.h"
#include "row_storage.h"

namespace torchrec_ext {
namespace {

enum class Optim : int64_t {
  kSgd = 0,
  kAdagrad = 1,
  kRowwiseAdagrad = 2,
  kAdam = 3,
  kAdamW = 4,
  kFtrl = 5
};

// ------------------------------------------------------------------- backward + optimizer

// Scalars derived once per call, in double and then rounded, as torch.optim does with its
// Python-float step sizes.
struct Hyper {
  float lr, eps, beta1, beta2, weight_decay;
  float one_minus_beta1, one_minus_beta2;  // Adam kinds: not 1.f - beta (0.1f is not 1.f - 0.9f)
  float clr;                               // Adagrad kinds: lr / (1 + (step - 1) * lr_decay)
  float step_size;                         // Adam kinds: lr / (1 - beta1^step)
  float bc2_sqrt;                          // Adam kinds: sqrt(1 - beta2^step)
  float decay;                             // AdamW: 1 - lr * weight_decay
  float lr_power, l1, two_l2, beta;        // FTRL
};

// Adam's moments and step (AdamW's too, after its decay), as torch.optim.Adam orders them.
TREXT_VECTOR_CLONES
void adam_step(const Hyper& h, float* w, const float* g, float* m, float* v, int64_t dim) {
  const float step_size = h.step_size, bc2_sqrt = h.bc2_sqrt;
  const float weight = h.one_minus_beta1, rest = 1.f - weight;
  const bool low = weight < 0.5f;  // torch.lerp's two formulas, picked by the weight as torch does
  for (int64_t d = 0; d < dim; ++d) {
    m[d] = low ? m[d] + weight * (g[d] - m[d]) : g[d] - (g[d] - m[d]) * rest;
    v[d] = h.beta2 * v[d] + h.one_minus_beta2 * g[d] * g[d];
    w[d] -= step_size * m[d] / (std::sqrt(v[d]) / bc2_sqrt + h.eps);
  }
}

// FTRL-Proximal (TensorFlow's ApplyFtrl, see reference.ftrl_step) on accumulator n and linear z.
// n^-lr_power is a square root for the default lr_power = -0.5, as TensorFlow computes it.
template <bool kSqrt>
inline void ftrl_loop(const Hyper& h, float* w, const float* g, float* n, float* z, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) {
    const float n_new = n[d] + g[d] * g[d];
    const float p_new = kSqrt ? std::sqrt(n_new) : std::pow(n_new, -h.lr_power);
    const float p_old = kSqrt ? std::sqrt(n[d]) : std::pow(n[d], -h.lr_power);
    const float sigma = (p_new - p_old) / h.lr;
    const float zd = z[d] + (g[d] - sigma * w[d]);
    z[d] = zd;
    n[d] = n_new;
    const float quadratic = (p_new + h.beta) / h.lr + h.two_l2;
    w[d] = std::fabs(zd) > h.l1 ? (std::copysign(h.l1, zd) - zd) / quadratic : 0.f;
  }
}

TREXT_VECTOR_CLONES
void ftrl_step(const Hyper& h, float* w, const float* g, float* n, float* z, int64_t dim) {
  if (h.lr_power == -0.5f)
    ftrl_loop<true>(h, w, g, n, z, dim);
  else
    ftrl_loop<false>(h, w, g, n, z, dim);
}

// One optimizer step on a row of `dim` floats with gradient g (modified in place).
TREXT_VECTOR_CLONES
void apply_step(Optim kind, const Hyper& h, float* w, float* g, float* s0, float* s1, int64_t dim) {
  // torch's coupled (L2) decay; AdamW decays the weight itself, FTRL has none.
  if (h.weight_decay != 0.f && kind != Optim::kAdamW && kind != Optim::kFtrl)
    for (int64_t d = 0; d < dim; ++d) g[d] += h.weight_decay * w[d];
  switch (kind) {
    case Optim::kSgd:
      for (int64_t d = 0; d < dim; ++d) w[d] -= h.lr * g[d];
      break;
    case Optim::kAdagrad: {
      const float clr = h.clr;
      for (int64_t d = 0; d < dim; ++d) {
        s0[d] += g[d] * g[d];
        w[d] -= clr * g[d] / (std::sqrt(s0[d]) + h.eps);
      }
      break;
    }
    case Optim::kRowwiseAdagrad: {
      float sq = 0.f;
      for (int64_t d = 0; d < dim; ++d) sq += g[d] * g[d];
      *s0 += sq / static_cast<float>(dim);
      const float clr = h.clr;
      const float denom = std::sqrt(*s0) + h.eps;
      for (int64_t d = 0; d < dim; ++d) w[d] -= clr * g[d] / denom;
      break;
    }
    case Optim::kAdam:
      adam_step(h, w, g, s0, s1, dim);
      break;
    case Optim::kAdamW:
      for (int64_t d = 0; d < dim; ++d) w[d] *= h.decay;
      adam_step(h, w, g, s0, s1, dim);
      break;
    case Optim::kFtrl:
      ftrl_step(h, w, g, s0, s1, dim);
      break;
  }
}

// The tables' flat layout, checked: storage dtypes, capacities and dims, and where each
// table's element-wise optimizer state starts (the tables' [capacity, dim] back to back).
struct UpdateLayout {
  std::vector<Storage> storage;
  std::vector<int64_t> caps;
  const int64_t* dims;
  std::vector<int64_t> state_offsets;  // T + 1 entries
  int64_t count;
};

UpdateLayout check_layout(const char* op, const at::Tensor& weights,
                          const at::Tensor& table_offsets, const at::Tensor& table_dims,
                          const std::optional<at::Tensor>& table_dtypes) {
  check_weights(op, weights);
  UpdateLayout l;
  l.storage = table_storage(op, table_dtypes, table_offsets.numel());
  l.caps = table_capacities(op, weights, table_offsets, table_dims, l.storage);
  l.count = l.caps.size();
  l.dims = table_dims.data_ptr<int64_t>();
  l.state_offsets.assign(l.count + 1, 0);
  for (int64_t t = 0; t < l.count; ++t)
    l.state_offsets[t + 1] = l.state_offsets[t] + l.caps[t] * l.dims[t];
  return l;
}

// The optimizer id, its hyperparameters, the step and its state buffers (one per state, sized
// for every table's rows: element-wise, or one float per row from state_row_offsets[t]).
Optim check_optimizer(const char* op, int64_t optimizer, at::ArrayRef<double> hparams, int64_t step,
                      at::TensorList states, const at::Tensor& state_row_offsets,
                      const UpdateLayout& l) {
  const int64_t T = l.count;
  TORCH_CHECK(optimizer >= 0 && optimizer <= 5, op, ": unknown optimizer id ", optimizer);
  TORCH_CHECK(hparams.size() == 6 || hparams.size() == 10, op,
              ": hparams must be (lr, eps, beta1, beta2, weight_decay, lr_decay[, lr_power, l1, "
              "l2, beta]), got ",
              hparams.size(), " values");
  TORCH_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  const Optim kind = static_cast<Optim>(optimizer);
  TORCH_CHECK(kind != Optim::kFtrl || (hparams.size() == 10 && hparams[0] > 0 && hparams[6] <= 0),
              op,
              ": ftrl needs hparams (..., lr_power, l1, l2, beta) with lr > 0 and lr_power <= 0");
  const size_t want_states = kind == Optim::kSgd                                           ? 0
                             : (kind == Optim::kAdagrad || kind == Optim::kRowwiseAdagrad) ? 1
                                                                                           : 2;
  TORCH_CHECK(states.size() == want_states, op, ": optimizer ", optimizer, " needs ", want_states,
              " state buffers, got ", states.size());
  check_long_1d(op, "state_row_offsets", state_row_offsets);
  TORCH_CHECK(state_row_offsets.numel() == T, op,
              ": state_row_offsets must have one entry per table");
  const int64_t* sro = state_row_offsets.data_ptr<int64_t>();
  for (const at::Tensor& s : states) {
    TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
                ": optimizer states must be contiguous 1-D float32 buffers");
    if (kind == Optim::kRowwiseAdagrad) {
      for (int64_t t = 0; t < T; ++t)
        TORCH_CHECK(sro[t] >= 0 && sro[t] + l.caps[t] <= s.numel(), op,
                    ": row-wise state of table ", t, " [", sro[t], ", ", sro[t] + l.caps[t],
                    ") exceeds its buffer of ", s.numel());
    } else {
      TORCH_CHECK(s.numel() == l.state_offsets[T], op,
                  ": element-wise optimizer state must hold every table's rows (",
                  l.state_offsets[T], " elements), got ", s.numel());
    }
  }
  return kind;
}

// The batch's unique rows (row, table) and each value's unique row, checked.
struct UniqueRows {
  at::Tensor rows_holder, table_holder, inverse_holder;
  const int64_t* rows;
  const int64_t* table;
  const int64_t* inverse;
  int64_t count;       // U
  int64_t num_values;  // n
};

UniqueRows check_unique_rows(const char* op, const at::Tensor& unique_rows_in,
                             const at::Tensor& unique_table_in, const at::Tensor& inverse_in,
                             const std::vector<int64_t>& caps) {
  UniqueRows u;
  u.rows_holder = unique_rows_in.contiguous();
  u.table_holder = unique_table_in.contiguous();
  u.inverse_holder = inverse_in.contiguous();
  check_long_1d(op, "unique_rows", u.rows_holder);
  check_long_1d(op, "unique_table", u.table_holder);
  check_long_1d(op, "inverse", u.inverse_holder);
  const int64_t U = u.rows_holder.numel(), n = u.inverse_holder.numel();
  TORCH_CHECK(u.table_holder.numel() == U, op, ": unique_table must have one entry per unique row");
  u.rows = u.rows_holder.data_ptr<int64_t>();
  u.table = u.table_holder.data_ptr<int64_t>();
  u.inverse = u.inverse_holder.data_ptr<int64_t>();
  u.count = U;
  u.num_values = n;
  check_rows_in_tables(op, u.rows, u.table, U, caps);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(u.inverse[i] >= 0 && u.inverse[i] < U, op, ": inverse[", i, "] = ", u.inverse[i],
                " out of range [0, ", U, ")");
  return u;
}

// New rows: unique row u with unique_new[u] = j >= 0 first takes vector j of its table's
// new_vectors block and state_init, then its step. Null when the batch has none.
const int64_t* check_unique_new(const char* op, const std::optional<at::Tensor>& unique_new_opt,
                                at::Tensor& holder, const UniqueRows& u, const NewVectors& nv,
                                at::TensorList states, at::ArrayRef<double> state_init) {
  if (!unique_new_opt.has_value()) return nullptr;
  const int64_t U = u.count;
  holder = unique_new_opt->contiguous();
  check_long_1d(op, "unique_new", holder);
  TORCH_CHECK(holder.numel() == U, op, ": unique_new must have one entry per unique row (", U,
              "), got ", holder.numel());
  TORCH_CHECK(!nv.empty(), op, ": unique_new needs new_vectors");
  TORCH_CHECK(state_init.size() == states.size(), op,
              ": state_init must give one initial value per state (", states.size(), "), got ",
              state_init.size());
  const int64_t* un = holder.data_ptr<int64_t>();
  const int64_t* ur = u.rows;
  const int64_t* ut = u.table;
  for (int64_t k = 0; k < U; ++k)
    TORCH_CHECK(un[k] == -1 || (un[k] >= 0 && un[k] < nv.count[ut[k]] && ur[k] >= 0), op,
                ": unique_new[", k, "] = ", un[k], " is neither -1 nor a vector of table ", ut[k],
                "'s new_vectors (", nv.count[ut[k]], ") for a row >= 0");
  return un;
}

// Stochastic rounding of half tables with a rounding seed: bits from (seed, id, element, step).
struct StochasticRounding {
  std::vector<uint64_t> seed;  // per table; 0: round to nearest
  at::Tensor ids_holder;
  const int64_t* ids = nullptr;  // the unique rows' ids, when any seed is set
};

StochasticRounding check_stochastic_rounding(const char* op,
                                             const std::optional<at::Tensor>& rounding_seeds_opt,
                                             const std::optional<at::Tensor>& unique_ids_opt,
                                             const std::vector<Storage>& storage, int64_t U) {
  const int64_t T = storage.size();
  StochasticRounding sr;
  sr.seed.assign(T, 0);
  if (!rounding_seeds_opt.has_value()) return sr;
  const at::Tensor seeds = rounding_seeds_opt->contiguous();
  check_long_1d(op, "rounding_seeds", seeds);
  TORCH_CHECK(seeds.numel() == T, op, ": rounding_seeds must have one entry per table (", T,
              "), got ", seeds.numel());
  bool any = false;
  for (int64_t t = 0; t < T; ++t) {
    sr.seed[t] =
        storage[t] == Storage::kFloat ? 0 : static_cast<uint64_t>(seeds.data_ptr<int64_t>()[t]);
    any = any || sr.seed[t] != 0;
  }
  if (any) {
    TORCH_CHECK(unique_ids_opt.has_value(), op,
                ": stochastic rounding (a non-zero rounding seed) needs unique_ids");
    sr.ids_holder = unique_ids_opt->contiguous();
    check_long_1d(op, "unique_ids", sr.ids_holder);
    TORCH_CHECK(sr.ids_holder.numel() == U, op, ": unique_ids must have one entry per unique row (",
                U, "), got ", sr.ids_holder.numel());
    sr.ids = sr.ids_holder.data_ptr<int64_t>();
  }
  return sr;
}

// The output gradient with dense columns (the vector loops need them); rows may be strided,
// even broadcast (stride 0, as the gradient of a sum is): one broadcast row is kept once.
struct GradRows {
  at::Tensor holder;
  const float* data;
  int64_t row_stride;
  int64_t cols;
};

GradRows dense_grad_columns(const char* op, const at::Tensor& grad_in) {
  TORCH_CHECK(grad_in.dim() == 2 && grad_in.scalar_type() == at::kFloat, op,
              ": grad must be a 2-D float32 tensor, got ", grad_in.scalar_type(), " of shape ",
              grad_in.sizes());
  GradRows g{grad_in, nullptr, grad_in.stride(0), grad_in.size(1)};
  if (grad_in.stride(1) != 1 || grad_in.size(0) == 0) {
    if (grad_in.stride(0) == 0 && grad_in.size(0) > 0) {
      g.holder = grad_in.select(0, 0).contiguous();  // one row broadcast to all: keep it once
      g.row_stride = 0;
    } else {
      g.holder = grad_in.contiguous();
      g.row_stride = grad_in.size(1);
    }
  }
  g.data = g.holder.data_ptr<float>();
  return g;
}

// Per value: the gradient element its row's sum starts at, and (pooled) its scale.
struct ValueSources {
  std::vector<int64_t> src;
  std::vector<float> scale;  // empty for sequence lookups (every scale 1)
};

// Pooled: value i of bag g = f * batch_size + b reads grad row b at feature f's columns, scaled
// by its per-sample weight and, for a mean feature, 1 / the bag's length.
ValueSources pooled_value_sources(const char* op, const at::Tensor& offsets_in,
                                  const std::optional<at::Tensor>& per_sample_weights,
                                  const at::Tensor& feature_col, const at::Tensor& feature_mean,
                                  int64_t batch_size, const at::Tensor& grad_in,
                                  const GradRows& grad, const UniqueRows& u, const int64_t* dims) {
  const int64_t n = u.num_values;
  ValueSources v{std::vector<int64_t>(n), std::vector<float>(n)};
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t F = feature_col.numel();
  check_long_1d(op, "feature_col", feature_col);
  TORCH_CHECK(feature_mean.scalar_type() == at::kBool && feature_mean.numel() == F, op,
              ": feature_mean must be a bool tensor with one entry per feature");
  check_bags(op, offsets, F * batch_size, n);
  TORCH_CHECK(grad_in.size(0) == batch_size, op, ": grad must have batch_size = ", batch_size,
              " rows, got ", grad_in.size(0));
  at::Tensor psw_holder;
  const float* psw = check_per_sample_weights(op, per_sample_weights, n, psw_holder);
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* fc = feature_col.data_ptr<int64_t>();
  const bool* fm = feature_mean.data_ptr<bool>();
  const int64_t* ut = u.table;
  const int64_t* inv = u.inverse;
  const int64_t gcols = grad.cols, grow = grad.row_stride;
  at::parallel_for(0, F * batch_size, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t f = g / batch_size, b = g % batch_size, len = o[g + 1] - o[g];
      for (int64_t i = o[g]; i < o[g + 1]; ++i) {
        TORCH_CHECK(fc[f] + dims[ut[inv[i]]] <= gcols, op, ": feature ", f,
                    "'s columns exceed grad's ", gcols);
        v.src[i] = b * grow + fc[f];
        float s = psw != nullptr ? psw[i] : 1.f;
        if (fm[f]) s = s / static_cast<float>(std::max<int64_t>(len, 1));
        v.scale[i] = s;
      }
    }
  });
  return v;
}

// Sequence: value i reads grad row i.
ValueSources sequence_value_sources(const char* op, const at::Tensor& grad_in, const GradRows& grad,
                                    const UniqueRows& u, const int64_t* dims) {
  const int64_t n = u.num_values;
  ValueSources v{std::vector<int64_t>(n), {}};
  TORCH_CHECK(grad_in.size(0) >= n, op, ": sequence grad must have one row per id (", n, "), got ",
              grad_in.size(0));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t dim = dims[u.table[u.inverse[i]]];
    TORCH_CHECK(dim <= grad.cols, op, ": grad has ", grad.cols, " columns, table needs ", dim);
    v.src[i] = i * grad.row_stride;
  }
  return v;
}

// Values grouped by unique row, a stable counting sort of `inverse` (each row sums its values in
// id order): row u's values are order[start[u] .. start[u + 1]).
struct RowGroups {
  std::vector<int64_t> start, order;
};

RowGroups group_values_by_row(const UniqueRows& u) {
  const int64_t U = u.count, n = u.num_values;
  const int64_t* inv = u.inverse;
  RowGroups r{std::vector<int64_t>(U + 1, 0), std::vector<int64_t>(n)};
  for (int64_t i = 0; i < n; ++i) ++r.start[inv[i] + 1];
  for (int64_t k = 0; k < U; ++k) r.start[k + 1] += r.start[k];
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t i = 0; i < n; ++i) r.order[fill[inv[i]]++] = i;
  return r;
}

Hyper hyper_of(at::ArrayRef<double> hparams, int64_t step) {
  const double lr = hparams[0], beta1 = hparams[2], beta2 = hparams[3], lr_decay = hparams[5];
  return Hyper{static_cast<float>(lr),
               static_cast<float>(hparams[1]),
               static_cast<float>(beta1),
               static_cast<float>(beta2),
               static_cast<float>(hparams[4]),
               static_cast<float>(1.0 - beta1),
               static_cast<float>(1.0 - beta2),
               static_cast<float>(lr / (1.0 + static_cast<double>(step - 1) * lr_decay)),
               static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))),
               static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)))),
               static_cast<float>(1.0 - lr * hparams[4]),
               hparams.size() == 10 ? static_cast<float>(hparams[6]) : 0.f,
               hparams.size() == 10 ? static_cast<float>(hparams[7]) : 0.f,
               hparams.size() == 10 ? static_cast<float>(2.0 * hparams[8]) : 0.f,
               hparams.size() == 10 ? static_cast<float>(hparams[9]) : 0.f};
}

// Where the update reads and writes: the rows, the optimizer state, the new rows' vectors.
struct UpdateTarget {
  const UpdateLayout& layout;
  const std::vector<char*>& bases;
  float* s0;
  float* s1;
  const int64_t* state_row_offsets;
  bool rowwise_state;
  const int64_t* unique_new;  // null: no new rows
  const NewVectors& nv;
  at::ArrayRef<double> state_init;
};

// Fetches unique row `ahead`'s weights and state for writing (they are read and written at
// random; a new row is only written: nothing to fetch).
TREXT_PREFETCH_INLINE void prefetch_unique_row(const UpdateTarget& x, const UniqueRows& u,
                                               int64_t ahead) {
  const int64_t* ur = u.rows;
  if (ur[ahead] < 0 || (x.unique_new != nullptr && x.unique_new[ahead] >= 0)) return;
  const int64_t ta = u.table[ahead], dim_a = x.layout.dims[ta],
                row_bytes_a = dim_a * storage_bytes(x.layout.storage[ta]);
  const int64_t selem_a = x.layout.state_offsets[ta] + ur[ahead] * dim_a;
  prefetch_row(x.bases[ta] + ur[ahead] * row_bytes_a, row_bytes_a, 1);
  if (x.s0 != nullptr) {
    if (x.rowwise_state)
      __builtin_prefetch(x.s0 + x.state_row_offsets[ta] + ur[ahead], 1);
    else
      prefetch_row(x.s0 + selem_a, dim_a, 1);
  }
  if (x.s1 != nullptr) prefetch_row(x.s1 + selem_a, dim_a, 1);
}

// g = the sum of row u's values' output gradient rows, each scaled (pooled).
inline void sum_row_gradient(float* g, const GradRows& grad, const ValueSources& v,
                             const RowGroups& groups, int64_t u, int64_t dim, int64_t n_end) {
  std::fill(g, g + dim, 0.f);
  const bool pooled = !v.scale.empty();
  for (int64_t k = groups.start[u]; k < groups.start[u + 1]; ++k) {
    // Values are grouped by row, so their gradient rows come in random order: fetch ahead.
    if (k + kPrefetchDistance < n_end)
      prefetch_row(grad.data + v.src[groups.order[k + kPrefetchDistance]], dim);
    const int64_t i = groups.order[k];
    add_scaled(g, grad.data + v.src[i], pooled ? v.scale[i] : 1.f, dim);
  }
}

// Per-thread rows: the gradient, a new row's weights and state, rounding bits and hashes.
struct RowScratch {
  std::vector<float> g, fresh_w, fresh_s0, fresh_s1;
  std::vector<uint16_t> rbits, fresh_half;
  std::vector<uint64_t> rhash;
  explicit RowScratch(int64_t max_dim)
      : g(max_dim),
        fresh_w(max_dim),
        fresh_s0(max_dim),
        fresh_s1(max_dim),
        rbits(max_dim),
        fresh_half(max_dim),
        rhash((max_dim + 3) / 4) {}
};

// A new row: the step runs on its initial vector (block t's vector j) and initial state, and
// the results are streamed to the row (never read from memory).
inline void step_new_row(const UpdateTarget& x, Optim kind, const Hyper& h, RowScratch& s,
                         int64_t t, int64_t j, char* row, float* state0, float* state1, int64_t dim,
                         const RowRounding* r) {
  const Storage st = x.layout.storage[t];
  const int64_t row_bytes = dim * storage_bytes(st);
  load_row(s.fresh_w.data(), x.nv.data[t] + j * row_bytes, st, dim);
  const int64_t width0 = x.rowwise_state ? 1 : dim;
  if (state0 != nullptr)
    std::fill(s.fresh_s0.begin(), s.fresh_s0.begin() + width0, static_cast<float>(x.state_init[0]));
  if (state1 != nullptr)
    std::fill(s.fresh_s1.begin(), s.fresh_s1.begin() + dim, static_cast<float>(x.state_init[1]));
  apply_step(kind, h, s.fresh_w.data(), s.g.data(), state0 != nullptr ? s.fresh_s0.data() : nullptr,
             state1 != nullptr ? s.fresh_s1.data() : nullptr, dim);
  store_row_streaming(row, s.fresh_w.data(), st, dim, r, s.fresh_half.data());
  if (state0 != nullptr) copy_streaming(state0, s.fresh_s0.data(), width0);
  if (state1 != nullptr) copy_streaming(state1, s.fresh_s1.data(), dim);
}

// A stored row stepped in place; a half row is stepped in float32 and written back rounded.
inline void step_stored_row(Optim kind, const Hyper& h, RowScratch& s, Storage st, char* row,
                            float* state0, float* state1, int64_t dim, const RowRounding* r) {
  if (st == Storage::kFloat) {
    apply_step(kind, h, reinterpret_cast<float*>(row), s.g.data(), state0, state1, dim);
  } else {
    load_row(s.fresh_w.data(), row, st, dim);
    apply_step(kind, h, s.fresh_w.data(), s.g.data(), state0, state1, dim);
    store_row(row, s.fresh_w.data(), st, dim, r);
  }
}

// Each unique row sums its gradient and takes its step, in parallel over unique rows (no two
// threads share a row).
void update_unique_rows(const UpdateTarget& x, const UniqueRows& u, const GradRows& grad,
                        const ValueSources& v, const RowGroups& groups, Optim kind, const Hyper& h,
                        const StochasticRounding& sr, int64_t step) {
  const UpdateLayout& l = x.layout;
  int64_t max_dim = 1;
  for (int64_t t = 0; t < l.count; ++t) max_dim = std::max(max_dim, l.dims[t]);
  const int64_t* ur = u.rows;
  const int64_t* ut = u.table;
  at::parallel_for(0, u.count, 32, [&](int64_t begin, int64_t end) {
    RowScratch s(max_dim);
    const int64_t n_end = groups.start[end];  // this chunk's values end here
    for (int64_t k = begin; k < end; ++k) {
      if (k + kPrefetchDistance < end) prefetch_unique_row(x, u, k + kPrefetchDistance);
      if (ur[k] < 0) continue;
      const int64_t t = ut[k], dim = l.dims[t];
      const Storage st = l.storage[t];
      sum_row_gradient(s.g.data(), grad, v, groups, k, dim, n_end);
      char* row = x.bases[t] + ur[k] * dim * storage_bytes(st);
      const int64_t selem = l.state_offsets[t] + ur[k] * dim;
      float* state0 = x.s0 == nullptr   ? nullptr
                      : x.rowwise_state ? x.s0 + x.state_row_offsets[t] + ur[k]
                                        : x.s0 + selem;
      float* state1 = x.s1 == nullptr ? nullptr : x.s1 + selem;
      const RowRounding rounding{sr.seed[t] != 0 ? rounding_key(sr.ids[k], sr.seed[t], step) : 0,
                                 s.rbits.data(), s.rhash.data()};
      const RowRounding* r = sr.seed[t] != 0 ? &rounding : nullptr;
      if (x.unique_new != nullptr && x.unique_new[k] >= 0)
        step_new_row(x, kind, h, s, t, x.unique_new[k], row, state0, state1, dim, r);
      else
        step_stored_row(kind, h, s, st, row, state0, state1, dim, r);
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed rows visible before the op returns
#endif
  });
}

void fused_update_cpu(const at::Tensor& grad_in, const at::Tensor& weights, at::TensorList states,
                      const at::Tensor& table_offsets, const at::Tensor& table_dims,
                      const at::Tensor& state_row_offsets, const at::Tensor& unique_rows_in,
                      const at::Tensor& unique_table_in, const at::Tensor& inverse_in,
                      const std::optional<at::Tensor>& offsets_opt,
                      const std::optional<at::Tensor>& per_sample_weights,
                      const at::Tensor& feature_col, const at::Tensor& feature_mean,
                      int64_t batch_size, int64_t optimizer, at::ArrayRef<double> hparams,
                      int64_t step, at::TensorList new_vectors,
                      const std::optional<at::Tensor>& unique_new_opt,
                      at::ArrayRef<double> state_init,
                      const std::optional<at::Tensor>& table_dtypes,
                      const std::optional<at::Tensor>& unique_ids_opt,
                      const std::optional<at::Tensor>& rounding_seeds_opt) {
  const char* op = "fused_update";
  // Every argument is checked before anything is written.
  const UpdateLayout layout = check_layout(op, weights, table_offsets, table_dims, table_dtypes);
  const Optim kind =
      check_optimizer(op, optimizer, hparams, step, states, state_row_offsets, layout);
  const UniqueRows unique =
      check_unique_rows(op, unique_rows_in, unique_table_in, inverse_in, layout.caps);
  const NewVectors nv =
      check_new_vectors(op, new_vectors, layout.dims, layout.count, layout.storage);
  at::Tensor unique_new_holder;
  const int64_t* unique_new =
      check_unique_new(op, unique_new_opt, unique_new_holder, unique, nv, states, state_init);
  const StochasticRounding rounding = check_stochastic_rounding(
      op, rounding_seeds_opt, unique_ids_opt, layout.storage, unique.count);
  const std::vector<char*> bases = table_bases(weights, table_offsets);
  const GradRows grad = dense_grad_columns(op, grad_in);
  const ValueSources values =
      offsets_opt.has_value()
          ? pooled_value_sources(op, *offsets_opt, per_sample_weights, feature_col, feature_mean,
                                 batch_size, grad_in, grad, unique, layout.dims)
          : sequence_value_sources(op, grad_in, grad, unique, layout.dims);

  const RowGroups groups = group_values_by_row(unique);
  const UpdateTarget target{layout,
                            bases,
                            states.size() > 0 ? states[0].data_ptr<float>() : nullptr,
                            states.size() > 1 ? states[1].data_ptr<float>() : nullptr,
                            state_row_offsets.data_ptr<int64_t>(),
                            kind == Optim::kRowwiseAdagrad,
                            unique_new,
                            nv,
                            state_init};
  update_unique_rows(target, unique, grad, values, groups, kind, hyper_of(hparams, step), rounding,
                     step);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("fused_update", &fused_update_cpu); }

}  // namespace torchrec_ext
