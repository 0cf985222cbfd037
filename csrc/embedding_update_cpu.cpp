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

constexpr uint64_t kRoundingGolden = 0xD6E8FEB86659FD93ull;

// The 16-bit random numbers of a row's elements at one step (reference.rounding_bits): element
// d takes bits 16 * (d % 4) of hash d / 4, i.e. (little-endian) the d-th uint16 of the hashes.
TREXT_VECTOR_CLONES
void rounding_bits(uint16_t* out, uint64_t* scratch, int64_t dim, int64_t id, uint64_t seed,
                   int64_t step) {
  const uint64_t key = fmix64(fmix64(static_cast<uint64_t>(id) ^ seed) +
                              static_cast<uint64_t>(step) * kRoundingGolden);
  const int64_t groups = (dim + 3) / 4;
  for (int64_t q = 0; q < groups; ++q)
    scratch[q] = fmix64(key + static_cast<uint64_t>(q + 1) * kRoundingGolden);
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
                "rounding_bits reads hashes as uint16 lanes");
  std::memcpy(out, scratch, dim * sizeof(uint16_t));
}

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
  float clr;                         // Adagrad kinds: lr / (1 + (step - 1) * lr_decay)
  float step_size;                   // Adam kinds: lr / (1 - beta1^step)
  float bc2_sqrt;                    // Adam kinds: sqrt(1 - beta2^step)
  float decay;                       // AdamW: 1 - lr * weight_decay
  float lr_power, l1, two_l2, beta;  // FTRL
};

// Adam's moments and step (AdamW's too, after its decay), as torch.optim.Adam orders them.
TREXT_VECTOR_CLONES
void adam_step(const Hyper& h, float* w, const float* g, float* m, float* v, int64_t dim) {
  const float step_size = h.step_size, bc2_sqrt = h.bc2_sqrt;
  for (int64_t d = 0; d < dim; ++d) {
    m[d] += (1.f - h.beta1) * (g[d] - m[d]);  // torch.lerp for weights < 0.5
    v[d] = h.beta2 * v[d] + (1.f - h.beta2) * g[d] * g[d];
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
  check_weights(op, weights);
  const std::vector<Storage> storage = table_storage(op, table_dtypes, table_offsets.numel());
  const std::vector<int64_t> caps =
      table_capacities(op, weights, table_offsets, table_dims, storage);
  const int64_t T = caps.size();
  const int64_t* dims = table_dims.data_ptr<int64_t>();
  // Element-wise optimizer state: the tables' [capacity, dim] back to back.
  std::vector<int64_t> soff(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) soff[t + 1] = soff[t] + caps[t] * dims[t];
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
        TORCH_CHECK(sro[t] >= 0 && sro[t] + caps[t] <= s.numel(), op, ": row-wise state of table ",
                    t, " [", sro[t], ", ", sro[t] + caps[t], ") exceeds its buffer of ", s.numel());
    } else {
      TORCH_CHECK(s.numel() == soff[T], op,
                  ": element-wise optimizer state must hold every table's rows (", soff[T],
                  " elements), got ", s.numel());
    }
  }
  const at::Tensor unique_rows = unique_rows_in.contiguous(),
                   unique_table = unique_table_in.contiguous();
  const at::Tensor inverse = inverse_in.contiguous();
  check_long_1d(op, "unique_rows", unique_rows);
  check_long_1d(op, "unique_table", unique_table);
  check_long_1d(op, "inverse", inverse);
  const int64_t U = unique_rows.numel(), n = inverse.numel();
  TORCH_CHECK(unique_table.numel() == U, op, ": unique_table must have one entry per unique row");
  const int64_t* ur = unique_rows.data_ptr<int64_t>();
  const int64_t* ut = unique_table.data_ptr<int64_t>();
  const int64_t* inv = inverse.data_ptr<int64_t>();
  check_rows_in_tables(op, ur, ut, U, caps);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(inv[i] >= 0 && inv[i] < U, op, ": inverse[", i, "] = ", inv[i],
                " out of range [0, ", U, ")");
  // New rows: unique row u with unique_new[u] = j >= 0 first takes vector j of its table's
  // new_vectors block and state_init, then its step.
  const NewVectors nv = check_new_vectors(op, new_vectors, dims, T, storage);
  at::Tensor unique_new;
  const int64_t* un = nullptr;
  if (unique_new_opt.has_value()) {
    unique_new = unique_new_opt->contiguous();
    check_long_1d(op, "unique_new", unique_new);
    TORCH_CHECK(unique_new.numel() == U, op, ": unique_new must have one entry per unique row (", U,
                "), got ", unique_new.numel());
    TORCH_CHECK(!nv.empty(), op, ": unique_new needs new_vectors");
    TORCH_CHECK(state_init.size() == states.size(), op,
                ": state_init must give one initial value per state (", states.size(), "), got ",
                state_init.size());
    un = unique_new.data_ptr<int64_t>();
    for (int64_t u = 0; u < U; ++u)
      TORCH_CHECK(un[u] == -1 || (un[u] >= 0 && un[u] < nv.count[ut[u]] && ur[u] >= 0), op,
                  ": unique_new[", u, "] = ", un[u], " is neither -1 nor a vector of table ", ut[u],
                  "'s new_vectors (", nv.count[ut[u]], ") for a row >= 0");
  }
  int64_t max_dim = 1;
  for (int64_t t = 0; t < T; ++t) max_dim = std::max(max_dim, dims[t]);
  // Stochastic rounding of half tables with a rounding seed: bits from (seed, id, element, step).
  std::vector<uint64_t> sr_seed(T, 0);
  const int64_t* uid = nullptr;
  at::Tensor unique_ids;
  if (rounding_seeds_opt.has_value()) {
    const at::Tensor seeds = rounding_seeds_opt->contiguous();
    check_long_1d(op, "rounding_seeds", seeds);
    TORCH_CHECK(seeds.numel() == T, op, ": rounding_seeds must have one entry per table (", T,
                "), got ", seeds.numel());
    bool any = false;
    for (int64_t t = 0; t < T; ++t) {
      sr_seed[t] =
          storage[t] == Storage::kFloat ? 0 : static_cast<uint64_t>(seeds.data_ptr<int64_t>()[t]);
      any = any || sr_seed[t] != 0;
    }
    if (any) {
      TORCH_CHECK(unique_ids_opt.has_value(), op,
                  ": stochastic rounding (a non-zero rounding seed) needs unique_ids");
      unique_ids = unique_ids_opt->contiguous();
      check_long_1d(op, "unique_ids", unique_ids);
      TORCH_CHECK(unique_ids.numel() == U, op, ": unique_ids must have one entry per unique row (",
                  U, "), got ", unique_ids.numel());
      uid = unique_ids.data_ptr<int64_t>();
    }
  }
  const std::vector<char*> bases = table_bases(weights, table_offsets);

  TORCH_CHECK(grad_in.dim() == 2 && grad_in.scalar_type() == at::kFloat, op,
              ": grad must be a 2-D float32 tensor, got ", grad_in.scalar_type(), " of shape ",
              grad_in.sizes());
  // Rows may be strided (even broadcast, stride 0, as the gradient of a sum is); columns must
  // be dense for the vector loops.
  at::Tensor grad = grad_in;
  int64_t grow = grad_in.stride(0);
  if (grad_in.stride(1) != 1 || grad_in.size(0) == 0) {
    if (grad_in.stride(0) == 0 && grad_in.size(0) > 0) {
      grad = grad_in.select(0, 0).contiguous();  // one row broadcast to all: keep it once
      grow = 0;
    } else {
      grad = grad_in.contiguous();
      grow = grad_in.size(1);
    }
  }
  const float* gr = grad.data_ptr<float>();
  const int64_t gcols = grad_in.size(1);

  // Per value: the grad row it reads, its first column and its scale.
  const bool pooled = offsets_opt.has_value();
  std::vector<int64_t> src(n);
  std::vector<float> scale(pooled ? n : 0);
  if (pooled) {
    const at::Tensor offsets = offsets_opt->contiguous();
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
    at::parallel_for(0, F * batch_size, 256, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t f = g / batch_size, b = g % batch_size, len = o[g + 1] - o[g];
        for (int64_t i = o[g]; i < o[g + 1]; ++i) {
          TORCH_CHECK(fc[f] + dims[ut[inv[i]]] <= gcols, op, ": feature ", f,
                      "'s columns exceed grad's ", gcols);
          src[i] = b * grow + fc[f];
          float s = psw != nullptr ? psw[i] : 1.f;
          if (fm[f]) s = s / static_cast<float>(std::max<int64_t>(len, 1));
          scale[i] = s;
        }
      }
    });
  } else {
    TORCH_CHECK(grad_in.size(0) >= n, op, ": sequence grad must have one row per id (", n,
                "), got ", grad_in.size(0));
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(dims[ut[inv[i]]] <= gcols, op, ": grad has ", gcols, " columns, table needs ",
                  dims[ut[inv[i]]]);
      src[i] = i * grow;
    }
  }

  // Counting sort of values by unique row (stable: each row sums its values in id order).
  std::vector<int64_t> start(U + 1, 0), order(n);
  for (int64_t i = 0; i < n; ++i) ++start[inv[i] + 1];
  for (int64_t u = 0; u < U; ++u) start[u + 1] += start[u];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[fill[inv[i]]++] = i;
  }

  const double lr = hparams[0], beta1 = hparams[2], beta2 = hparams[3], lr_decay = hparams[5];
  const Hyper h{static_cast<float>(lr),
                static_cast<float>(hparams[1]),
                static_cast<float>(beta1),
                static_cast<float>(beta2),
                static_cast<float>(hparams[4]),
                static_cast<float>(lr / (1.0 + static_cast<double>(step - 1) * lr_decay)),
                static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))),
                static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)))),
                static_cast<float>(1.0 - lr * hparams[4]),
                hparams.size() == 10 ? static_cast<float>(hparams[6]) : 0.f,
                hparams.size() == 10 ? static_cast<float>(hparams[7]) : 0.f,
                hparams.size() == 10 ? static_cast<float>(2.0 * hparams[8]) : 0.f,
                hparams.size() == 10 ? static_cast<float>(hparams[9]) : 0.f};
  float* s0 = want_states > 0 ? states[0].data_ptr<float>() : nullptr;
  float* s1 = want_states > 1 ? states[1].data_ptr<float>() : nullptr;
  const bool rowwise_state = kind == Optim::kRowwiseAdagrad;
  at::parallel_for(0, U, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> g(max_dim), fresh_w(max_dim), fresh_s0(max_dim), fresh_s1(max_dim);
    std::vector<uint16_t> rbits(max_dim), fresh_half(max_dim);
    std::vector<uint64_t> rhash((max_dim + 3) / 4);
    const int64_t n_end = start[end];  // this chunk's values end here
    for (int64_t u = begin; u < end; ++u) {
      // The rows a few unique ids ahead: weights and state are read and written at random
      // (new rows are only written: nothing to fetch).
      const int64_t ahead = u + kPrefetchDistance;
      if (ahead < end && ur[ahead] >= 0 && (un == nullptr || un[ahead] < 0)) {
        const int64_t ta = ut[ahead], dim_a = dims[ta],
                      row_bytes_a = dim_a * storage_bytes(storage[ta]);
        const int64_t selem_a = soff[ta] + ur[ahead] * dim_a;
        prefetch_row(bases[ta] + ur[ahead] * row_bytes_a, row_bytes_a, 1);
        if (s0 != nullptr) {
          if (rowwise_state)
            __builtin_prefetch(s0 + sro[ta] + ur[ahead], 1);
          else
            prefetch_row(s0 + selem_a, dim_a, 1);
        }
        if (s1 != nullptr) prefetch_row(s1 + selem_a, dim_a, 1);
      }
      if (ur[u] < 0) continue;
      const int64_t t = ut[u], dim = dims[t];
      const Storage st = storage[t];
      const int64_t row_bytes = dim * storage_bytes(st);
      std::fill(g.begin(), g.begin() + dim, 0.f);
      for (int64_t k = start[u]; k < start[u + 1]; ++k) {
        // Values are grouped by row, so their gradient rows come in random order: fetch ahead.
        if (k + kPrefetchDistance < n_end)
          prefetch_row(gr + src[order[k + kPrefetchDistance]], dims[ut[u]]);
        const int64_t i = order[k];
        add_scaled(g.data(), gr + src[i], pooled ? scale[i] : 1.f, dim);
      }
      char* row = bases[t] + ur[u] * row_bytes;
      const int64_t selem = soff[t] + ur[u] * dim;
      float* state0 = s0 == nullptr ? nullptr : rowwise_state ? s0 + sro[t] + ur[u] : s0 + selem;
      float* state1 = s1 == nullptr ? nullptr : s1 + selem;
      const uint16_t* r = nullptr;
      if (sr_seed[t] != 0) {
        rounding_bits(rbits.data(), rhash.data(), dim, uid[u], sr_seed[t], step);
        r = rbits.data();
      }
      if (un != nullptr && un[u] >= 0) {
        // A new row: the step runs on its initial vector and state, and the results are
        // streamed to the row (never read from memory).
        load_row(fresh_w.data(), nv.data[t] + un[u] * row_bytes, st, dim);
        const int64_t width0 = rowwise_state ? 1 : dim;
        if (state0 != nullptr)
          std::fill(fresh_s0.begin(), fresh_s0.begin() + width0, static_cast<float>(state_init[0]));
        if (state1 != nullptr)
          std::fill(fresh_s1.begin(), fresh_s1.begin() + dim, static_cast<float>(state_init[1]));
        apply_step(kind, h, fresh_w.data(), g.data(), state0 != nullptr ? fresh_s0.data() : nullptr,
                   state1 != nullptr ? fresh_s1.data() : nullptr, dim);
        if (st == Storage::kFloat) {
          copy_streaming(reinterpret_cast<float*>(row), fresh_w.data(), dim);
        } else {  // rounded into a scratch row, then streamed as the float32 rows are
          store_row(fresh_half.data(), fresh_w.data(), st, dim, r);
          copy_streaming_bytes(row, fresh_half.data(), row_bytes);
        }
        if (state0 != nullptr) copy_streaming(state0, fresh_s0.data(), width0);
        if (state1 != nullptr) copy_streaming(state1, fresh_s1.data(), dim);
        continue;
      }
      if (st == Storage::kFloat) {
        apply_step(kind, h, reinterpret_cast<float*>(row), g.data(), state0, state1, dim);
      } else {  // a half row: stepped in float32, written back rounded
        load_row(fresh_w.data(), row, st, dim);
        apply_step(kind, h, fresh_w.data(), g.data(), state0, state1, dim);
        store_row(row, fresh_w.data(), st, dim, r);
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed rows visible before the op returns
#endif
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("fused_update", &fused_update_cpu); }

}  // namespace torchrec_ext
