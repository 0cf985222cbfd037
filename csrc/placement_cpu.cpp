// CPU kernel of hash_place: rows for a set of distinct keys in an empty table, as a load places
// a checkpoint's ids when their saved rows do not fit the table (another capacity, world size
// or layout).
//
// Each key may take a free slot of its two buckets (hash_table_layout.h's place_key): a bipartite
// matching of keys to slots. Keys have priorities (higher score first, then lower position), and
// the keys kept are the matroid's greedy basis: a key is left out exactly when it cannot be
// placed beside the higher-priority keys kept, so the count kept is the most the buckets allow.
// Keys go in two rounds (the `capacity` of highest priority, then the rest), each in three
// steps, all deterministic (sequential, in priority order):
//  1. fill: each key, by priority, takes a free slot of the emptier of its buckets if it has one;
//  2. augment (Hopcroft-Karp phases): every bucket gets its distance to a free slot (one
//     breadth-first search for all: a key in bucket c may move to its other bucket t, so c is one
//     move further than t), then each refused key walks down the distances to a free slot, each
//     key of the walk moving one bucket on; stale distances only make a walk fail, retried in the
//     next phase; a phase that places nothing ends with the most keys placed;
//  3. exchange, only when keys are still left out: by priority, each left-out key u looks
//     (breadth-first) for a placed key of lower priority it can take the place of, through a
//     chain of moves; if there is one, u goes in and that key out (to be tried in its turn). A key
//     with none marks the buckets it searched dead: they hold only keys of higher priority than
//     every key still to come, and no later exchange passes through them.
// From a starting placement (start_rows, as a delta replica's held keys): the held keys are put
// at their rows first, then the others go through steps 1-3 in one round, so held keys move only
// along the augmenting paths (or trades) that make room; every key is still placed whenever some
// placement holds them all (a matching is maximum iff no augmenting path is left).
// Then the stash (hash_table_layout.h): the left-out keys of highest priority, up to the stash's
// entries, take free rows outside their buckets (the lowest free rows, by priority); with more
// keys than rows the kept keys are cut to `capacity` by priority (a stashed key that outranks a
// placed one frees its row). So the kept set is the greedy basis of the placement matroid
// joined with the stash's (any T keys), truncated at `capacity`: a full table keeps every key
// unless more are left out than the stash holds.
// Measured (benchmarks/results/reshard_placement_cpu.md): 1M keys in a few seconds at any load.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <optional>
#include <queue>
#include <utility>
#include <vector>

#include "hash_table_checks.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

constexpr int64_t kFar = INT64_MAX;  // no known path to a free slot

class Placement {
 public:
  // keys in priority order: rank[i] is key i's place in it.
  Placement(const TableGeometry& geo, const int64_t* keys, const std::vector<int64_t>& rank)
      : geo_(geo),
        n_(static_cast<int64_t>(rank.size())),
        rank_(rank),
        pair_sum_(n_),
        first_(n_),
        row_of_(n_, -1),
        holder_(geo.num_slots(), -1),
        free_(geo.num_buckets),
        dead_(geo.num_buckets, 0),
        dist_(geo.num_buckets, kFar),
        seen_(geo.num_buckets, 0),
        parent_(geo.num_buckets),
        pair_end_(geo.num_buckets + 1, 0),
        pair_key_(2 * n_) {
    for (int64_t i = 0; i < n_; ++i) {
      const KeyPlace p = place_key(keys[i], geo);
      first_[i] = p.bucket1;
      pair_sum_[i] = p.bucket1 + p.bucket2;  // a key in bucket b may move to pair_sum - b
      ++pair_end_[p.bucket1 + 1];
      ++pair_end_[p.bucket2 + 1];
    }
    // The keys that may use bucket t: pair_key_[pair_end_[t] .. pair_end_[t + 1]).
    for (int64_t b = 0; b < geo.num_buckets; ++b) pair_end_[b + 1] += pair_end_[b];
    std::vector<int64_t> fill(pair_end_.begin(), pair_end_.end() - 1);
    for (int64_t i = 0; i < n_; ++i) {
      pair_key_[fill[first_[i]]++] = i;
      pair_key_[fill[pair_sum_[i] - first_[i]]++] = i;
    }
    for (int64_t b = 0; b < geo.num_buckets; ++b) free_[b] = geo.usable_mask(b);
  }

  // Places the keys of `order` (priority order) in two rounds: the `capacity` first, then the
  // rest, so that the second round's keys, of lower priority than all the first's, never need to
  // be traded for them (a key the first round leaves out has no path to a free slot: its buckets
  // are dead before the second round starts).
  void run(const std::vector<int64_t>& order) {
    const auto middle = order.begin() + std::min<int64_t>(n_, geo_.capacity);
    place_round(std::vector<int64_t>(order.begin(), middle));
    place_round(std::vector<int64_t>(middle, order.end()));
  }

  // Starts from a placement: key i holds `row` (checked by the caller: one of its buckets' usable
  // slots). Returns false when another key holds that row already.
  bool hold(int64_t i, int64_t row) {
    const int64_t bucket = row / kSlotsPerBucket;
    const uint32_t bit = 1u << (row % kSlotsPerBucket);
    if (!(free_[bucket] & bit)) return false;
    free_[bucket] &= ~bit;
    set(row, i);
    ++placed_;
    return true;
  }

  // Places the keys of `order` (priority order) beside the held ones: held keys move only along
  // the augmenting paths (or trades) that make room for them.
  void run_from_held(const std::vector<int64_t>& order) { place_round(order); }

  const std::vector<int64_t>& rows() const { return row_of_; }

 private:
  void place_round(const std::vector<int64_t>& order) {
    std::vector<int64_t> refused;
    for (const int64_t i : order) {
      const int64_t b1 = first_[i], b2 = pair_sum_[i] - b1;
      const int free1 = __builtin_popcount(free_[b1]), free2 = __builtin_popcount(free_[b2]);
      if (free1 || free2) {
        put(i, free1 >= free2 ? b1 : b2);
      } else {
        refused.push_back(i);
      }
    }
    while (!refused.empty() && placed_ < geo_.capacity) {
      label();
      std::vector<int64_t> left;
      for (const int64_t i : refused) {
        if (!descend(i)) left.push_back(i);
      }
      if (left.size() == refused.size()) break;  // exact distances throughout: no key has a path
      refused.swap(left);
    }
    // Trades are only with keys of this round: none placed, none to trade.
    if (!refused.empty() && refused.size() < order.size()) exchange(refused);
  }

  void put(int64_t key, int64_t bucket) {
    const int slot = __builtin_ctz(free_[bucket]);
    free_[bucket] &= ~(1u << slot);
    set(bucket * kSlotsPerBucket + slot, key);
    ++placed_;
  }

  void set(int64_t row, int64_t key) {
    holder_[row] = key;
    row_of_[key] = row;
  }

  // Every bucket's distance to a free slot (kFar: none reachable).
  void label() {
    std::fill(dist_.begin(), dist_.end(), kFar);
    queue_.clear();
    for (int64_t b = 0; b < geo_.num_buckets; ++b) {
      if (free_[b]) {
        dist_[b] = 0;
        queue_.push_back(b);
      }
    }
    for (size_t head = 0; head < queue_.size(); ++head) {
      const int64_t t = queue_[head];
      for (int64_t e = pair_end_[t]; e < pair_end_[t + 1]; ++e) {
        const int64_t row = row_of_[pair_key_[e]];
        const int64_t c = row < 0 ? t : row / kSlotsPerBucket;
        if (c != t && dist_[c] == kFar) {
          dist_[c] = dist_[t] + 1;
          queue_.push_back(c);
        }
      }
    }
  }

  // Places key i by a walk down the distances from one of its buckets (the nearer first) to a
  // free slot; buckets found to lead nowhere (stale distances) are set to kFar.
  bool descend(int64_t i) {
    const int64_t b1 = first_[i], b2 = pair_sum_[i] - b1;
    for (const int64_t start : {dist_[b2] < dist_[b1] ? b2 : b1, dist_[b2] < dist_[b1] ? b1 : b2}) {
      if (dist_[start] == kFar) continue;
      stack_.assign(1, {start, 0});  // {bucket, next slot to try}; a key leaves each but the last
      while (!stack_.empty()) {
        const int64_t b = stack_.back().first, d = dist_[b];
        if (d == 0) {
          if (free_[b]) {
            put_along_stack(i);
            return true;
          }
          dist_[b] = kFar;  // its free slots were taken since the labelling
          stack_.pop_back();
          continue;
        }
        bool deeper = false;
        for (int slot = stack_.back().second; slot < kSlotsPerBucket && !deeper; ++slot) {
          const int64_t j = holder_[b * kSlotsPerBucket + slot];
          if (j >= 0 && pair_sum_[j] - b != b && dist_[pair_sum_[j] - b] == d - 1) {
            stack_.back().second = slot + 1;
            stack_.push_back({pair_sum_[j] - b, 0});
            deeper = true;
          }
        }
        if (!deeper) {
          dist_[b] = kFar;
          stack_.pop_back();
        }
      }
    }
    return false;
  }

  // Each key of the walk on stack_ moves one bucket on, into the slot ahead; key i takes the first.
  void put_along_stack(int64_t i) {
    const int64_t last = stack_.back().first;
    const int slot = __builtin_ctz(free_[last]);
    free_[last] &= ~(1u << slot);
    int64_t row = last * kSlotsPerBucket + slot;
    for (size_t k = stack_.size() - 1; k-- > 0;) {
      const int64_t left = stack_[k].first * kSlotsPerBucket + stack_[k].second - 1;
      set(row, holder_[left]);
      row = left;
    }
    set(row, i);
    ++placed_;
  }

  // Step 3: the most keys are placed; trade placed keys for left-out ones of higher priority.
  void exchange(const std::vector<int64_t>& left) {
    std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> by_rank;
    std::vector<int64_t> key_at(n_);
    for (int64_t i = 0; i < n_; ++i) key_at[rank_[i]] = i;
    for (const int64_t i : left) by_rank.push(rank_[i]);
    while (!by_rank.empty()) {
      const int64_t u = key_at[by_rank.top()];
      by_rank.pop();
      const int64_t out = take_place_of_lower(u);
      if (out >= 0) by_rank.push(rank_[out]);
    }
  }

  // Breadth-first from u's buckets for a placed key of lower priority; if one is found, u goes
  // in (the keys between moving one bucket on) and that key out: returned. Else -1, and the
  // buckets searched are dead.
  int64_t take_place_of_lower(int64_t u) {
    if (++stamp_ == 0) {
      std::fill(seen_.begin(), seen_.end(), 0);
      stamp_ = 1;
    }
    queue_.clear();
    for (const int64_t root : {first_[u], pair_sum_[u] - first_[u]}) {
      if (!dead_[root] && seen_[root] != stamp_) {
        seen_[root] = stamp_;
        parent_[root] = {-1, 0};
        queue_.push_back(root);
      }
    }
    for (size_t head = 0; head < queue_.size(); ++head) {
      const int64_t b = queue_[head];
      for (int slot = 0; slot < kSlotsPerBucket; ++slot) {
        const int64_t j = holder_[b * kSlotsPerBucket + slot];
        if (j < 0) continue;
        if (rank_[j] > rank_[u]) {  // j out, u in
          int64_t row = b * kSlotsPerBucket + slot, bucket = b;
          row_of_[j] = -1;
          while (parent_[bucket].first >= 0) {
            const int64_t from = parent_[bucket].first * kSlotsPerBucket + parent_[bucket].second;
            set(row, holder_[from]);
            row = from;
            bucket = parent_[bucket].first;
          }
          set(row, u);
          return j;
        }
        const int64_t next = pair_sum_[j] - b;
        if (next == b || dead_[next] || seen_[next] == stamp_) continue;
        seen_[next] = stamp_;
        parent_[next] = {b, slot};
        queue_.push_back(next);
      }
    }
    for (const int64_t b : queue_) dead_[b] = 1;
    return -1;
  }

  const TableGeometry geo_;
  const int64_t n_;
  const std::vector<int64_t>& rank_;
  std::vector<int64_t> pair_sum_, first_;  // first_: each key's bucket1
  std::vector<int64_t> row_of_;            // each key's row, -1 while not placed
  std::vector<int64_t> holder_;            // key of each slot, -1 when free
  std::vector<uint32_t> free_;             // free usable slots of each bucket
  std::vector<uint8_t> dead_;              // searched by a failed exchange (step 3)
  std::vector<int64_t> dist_;              // moves to a free slot, as of the last labelling
  std::vector<uint32_t> seen_;             // the stamp of the search that last reached each bucket
  std::vector<std::pair<int64_t, int>> parent_;  // where that search came from: bucket, slot
  std::vector<int64_t> pair_end_, pair_key_;
  std::vector<int64_t> queue_;
  std::vector<std::pair<int64_t, int>> stack_;
  uint32_t stamp_ = 0;
  int64_t placed_ = 0;
};

// The stash's share of a placement (see the top): `rows` (-1: left out) of keys in priority
// `order` gain free rows outside their buckets for the left-out keys of highest priority.
void stash_left_out(std::vector<int64_t>& rows, const std::vector<int64_t>& order,
                    const TableGeometry& geo) {
  std::vector<int64_t> stash;
  int64_t kept = 0;
  for (const int64_t i : order) {
    if (rows[i] >= 0) {
      ++kept;
    } else if (static_cast<int64_t>(stash.size()) < geo.stash_slots) {
      stash.push_back(i);
      ++kept;
    }
  }
  if (stash.empty()) return;
  std::vector<uint8_t> in_stash(rows.size(), 0);
  for (const int64_t i : stash) in_stash[i] = 1;
  for (auto it = order.rbegin(); kept > geo.capacity && it != order.rend();
       ++it) {  // cut to capacity
    if (rows[*it] >= 0) {
      rows[*it] = -1;
      --kept;
    } else if (in_stash[*it]) {
      in_stash[*it] = 0;
      --kept;
    }
  }
  std::vector<uint8_t> taken(geo.capacity, 0);
  for (const int64_t r : rows) {
    if (r >= 0) taken[r] = 1;
  }
  int64_t free_row = 0;
  for (const int64_t i : stash) {
    if (!in_stash[i]) continue;
    while (taken[free_row]) ++free_row;  // kept <= capacity: a free row is left for each
    rows[i] = free_row++;
  }
}

at::Tensor hash_place_cpu(const at::Tensor& keys, const at::Tensor& scores, int64_t capacity,
                          const std::optional<at::Tensor>& start_rows) {
  check_keys("hash_place", keys);
  TORCH_CHECK(capacity > 0, "hash_place: capacity must be > 0, got ", capacity);
  const int64_t n = keys.numel();
  TORCH_CHECK(scores.scalar_type() == at::kLong && scores.dim() == 1 && scores.numel() == n,
              "hash_place: scores must be a 1-D int64 tensor of ", n,
              " elements (one per key), got ", scores.scalar_type(), " of shape ", scores.sizes());
  const at::Tensor k = keys.contiguous(), s = scores.contiguous();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* sp = s.data_ptr<int64_t>();
  check_distinct_keys("hash_place", kp, n);

  std::vector<int64_t> order(n), rank(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [sp](int64_t a, int64_t b) { return sp[a] > sp[b]; });
  for (int64_t r = 0; r < n; ++r) rank[order[r]] = r;
  const TableGeometry geo = make_geometry(capacity);
  Placement placement(geo, kp, rank);
  if (!start_rows.has_value()) {
    placement.run(order);
  } else {
    const at::Tensor& start = *start_rows;
    TORCH_CHECK(start.scalar_type() == at::kLong && start.dim() == 1 && start.numel() == n,
                "hash_place: start_rows must be a 1-D int64 tensor of ", n,
                " elements (one per key), got ", start.scalar_type(), " of shape ", start.sizes());
    const at::Tensor st = start.contiguous();
    const int64_t* rp = st.data_ptr<int64_t>();
    std::vector<uint8_t> held(n, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = rp[i];
      if (row < 0) continue;
      TORCH_CHECK(row < capacity, "hash_place: start_rows[", i, "] = ", row,
                  " is not a row of capacity ", capacity);
      const KeyPlace p = place_key(kp[i], geo);
      const int64_t bucket = row / kSlotsPerBucket;
      if (bucket != p.bucket1 && bucket != p.bucket2) continue;  // a stashed key: placed afresh
      TORCH_CHECK(placement.hold(i, row), "hash_place: start_rows[", i, "] = ", row,
                  " is held by an earlier key already (start rows must be distinct)");
      held[i] = 1;
    }
    std::vector<int64_t> rest;
    for (const int64_t i : order) {
      if (!held[i]) rest.push_back(i);
    }
    placement.run_from_held(rest);
  }
  std::vector<int64_t> placed = placement.rows();
  stash_left_out(placed, order, geo);
  at::Tensor rows = at::empty({n}, k.options());
  std::copy(placed.begin(), placed.end(), rows.data_ptr<int64_t>());
  return rows;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("hash_place", &hash_place_cpu); }

}  // namespace torchrec_ext
