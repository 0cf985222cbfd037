"""Synthetic recommendation data: heavy-tailed raw ids, the "dlrm-small" batches of ANCHORS.md,
and a Criteo-shaped stream whose labels come from a hidden model (so AUC means something).

Ids: a Zipf rank r in [1, num_ids] (P(r) proportional to r^-alpha: exact for r <= 1024 through
an alias table, a midpoint-rounded continuous tail beyond, within ~1e-6 relative of r^-alpha),
then id = mix((r - 1) xor key) with `mix` a fixed bijection of [0, 2^id_bits): ranks scatter over
the whole id space, and each `key` (one per table / feature) has its own hot ids. Everything is a
pure function of the seeds and vectorised (a 131k-id dlrm-small batch in ~2.5 ms on 2 cores).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

_MASK64 = (1 << 64) - 1
_HEAD = 1024  # ranks sampled from their exact probabilities; the tail is sampled continuously
# Odd multipliers for the rank -> id bijection (from splitmix64 / murmur3's finalisers).
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xFF51AFD7ED558CCD)


def mix64(*values: int) -> int:
    """A 64-bit hash of a tuple of ints (splitmix64 chained); seeds everything in this module."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def generator(*seeds: int) -> torch.Generator:
    """A CPU torch.Generator seeded from a tuple of ints."""
    return torch.Generator().manual_seed(mix64(*seeds) >> 1)


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _stream_key(key: int, bits: int) -> int:
    """The xor key of a stream, as a signed int64 value."""
    return _signed64(mix64(key, 0x6B6579) & ((1 << bits) - 1))


def _mix_rounds(x: np.ndarray, bits: int) -> np.ndarray:
    """A fixed bijection of [0, 2^bits), in place on a uint64 array: three rounds of multiply by
    an odd constant mod 2^bits, then xorshift by half the width."""
    mask = np.uint64((1 << bits) - 1)
    shift = np.uint64((bits + 1) // 2)
    for m in _MULTIPLIERS:
        x *= np.uint64(m & ((1 << bits) - 1) | 1)  # uint64 wraps mod 2^64; the mask makes it mod 2^bits
        x &= mask
        x ^= x >> shift
    return x


def _ids_of_ranks(ranks: torch.Tensor, keys: int | torch.Tensor, bits: int) -> torch.Tensor:
    """id = mix((rank - 1) xor key): a bijection of [0, 2^bits) per key; `keys` may be one key
    per element. Returns int64 (ids >= 2^63 of a 64-bit space read as negative)."""
    x = ranks.to(torch.int64, copy=True).sub_(1).bitwise_xor_(keys)
    _mix_rounds(x.numpy().view(np.uint64), bits)
    return x


@dataclasses.dataclass(frozen=True)
class HeavyTailedIds:
    """Raw int64 ids with Zipf-distributed frequencies, scattered over [0, 2^id_bits).

    alpha: Zipf exponent (P(rank r) ~ r^-alpha), > 0.
    num_ids: how many distinct ids can occur (ranks 1..num_ids), <= 2^id_bits.
    id_bits: ids lie in [0, 2^id_bits); with 64 they cover all of int64 (negative ones too).
    key: selects the rank -> id bijection; give each table / feature its own.

        ids = HeavyTailedIds(key=3).sample(131072, generator(seed, step))
    """

    alpha: float = 1.05
    num_ids: int = 1 << 40
    id_bits: int = 40
    key: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"HeavyTailedIds: alpha must be a number > 0, got {self.alpha!r}")
        if not (isinstance(self.id_bits, int) and 1 <= self.id_bits <= 64):
            raise ValueError(f"HeavyTailedIds: id_bits must be an int in [1, 64], got {self.id_bits!r}")
        if not (isinstance(self.num_ids, int) and 1 <= self.num_ids <= 1 << self.id_bits):
            raise ValueError(
                f"HeavyTailedIds: num_ids must be an int in [1, 2^id_bits = {1 << self.id_bits}], got {self.num_ids!r}"
            )

    @functools.cached_property
    def _tables(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """Walker alias table of ranks 1..head (acceptance probability, alias index), head mass,
        tail mass (both unnormalised)."""
        head = min(self.num_ids, _HEAD)
        weights = np.arange(1, head + 1, dtype=np.float64) ** -self.alpha
        accept, alias = _alias_table(weights / weights.sum())
        return (
            torch.from_numpy(accept),
            torch.from_numpy(alias),
            float(weights.sum()),
            self._tail_mass(head + 0.5, self.num_ids + 0.5),
        )

    def _tail_mass(self, lo: float, hi: float) -> float:
        if hi <= lo:
            return 0.0
        if self.alpha == 1.0:
            return math.log(hi / lo)
        return (lo ** (1 - self.alpha) - hi ** (1 - self.alpha)) / (self.alpha - 1)

    def probability(self, ranks: torch.Tensor) -> torch.Tensor:
        """The sampling probability of each rank (float64), for tests and analysis."""
        ranks = torch.as_tensor(ranks, dtype=torch.float64, device=getattr(ranks, "device", "cpu"))
        _, _, head_mass, tail_mass = self._tables
        exact = ranks.pow(-self.alpha)
        if self.alpha == 1.0:
            tail = torch.log((ranks + 0.5) / (ranks - 0.5))
        else:
            tail = ((ranks - 0.5).pow(1 - self.alpha) - (ranks + 0.5).pow(1 - self.alpha)) / (self.alpha - 1)
        inside = (ranks >= 1) & (ranks <= self.num_ids)
        return torch.where(inside, torch.where(ranks <= _HEAD, exact, tail), 0.0) / (head_mass + tail_mass)

    def ranks(self, n: int, gen: torch.Generator | None = None) -> torch.Tensor:
        """n Zipf ranks in [1, num_ids] (int64); rank 1 is the most frequent."""
        accept, alias, head_mass, tail_mass = self._tables
        head = accept.numel()
        u = torch.rand(n, generator=gen, dtype=torch.float64, device="cpu")
        # Head (u < head share): u rescaled to [0, head) picks a column and a coin of the alias table.
        w = u * ((head_mass + tail_mass) / head_mass * head)
        col = w.to(torch.int64).clamp_(max=head - 1)
        coin = w.sub_(col)
        ranks = torch.where(coin < accept[col], col, alias[col]).add_(1)
        if tail_mass > 0:  # in place from here: fresh 1 MB temporaries cost more than the math
            a, lo, hi = self.alpha, head + 0.5, self.num_ids + 0.5
            total = head_mass + tail_mass
            in_tail = u >= head_mass / total
            v = u.mul_(total).sub_(head_mass).div_(tail_mass).clamp_(0.0, 1.0)
            if a == 1.0:
                x = v.mul_(math.log(hi / lo)).exp_().mul_(lo)
            else:  # inverse CDF of density x^-a on [lo, hi)
                lo_p, hi_p = lo ** (1 - a), hi ** (1 - a)
                x = v.mul_(hi_p - lo_p).add_(lo_p).pow_(1 / (1 - a))
            tail = x.add_(0.5).floor_().clamp_(head + 1, self.num_ids).to(torch.int64)
            ranks = torch.where(in_tail, tail, ranks, out=ranks)
        return ranks

    def ids_of_ranks(self, ranks: torch.Tensor) -> torch.Tensor:
        """The id of each rank (int64 in [0, 2^id_bits), or all of int64 when id_bits is 64)."""
        return _ids_of_ranks(ranks, _stream_key(self.key, self.id_bits), self.id_bits)

    def sample(self, n: int, gen: torch.Generator | None = None) -> torch.Tensor:
        """n raw ids (int64)."""
        return self.ids_of_ranks(self.ranks(n, gen))


def _alias_table(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vose's alias method: column i keeps outcome i with probability accept[i], else alias[i]."""
    n = p.size
    scaled = p * n
    accept, alias = np.ones(n), np.arange(n, dtype=np.int64)
    small = [i for i in range(n) if scaled[i] < 1.0]
    large = [i for i in range(n) if scaled[i] >= 1.0]
    while small and large:
        s, g = small.pop(), large.pop()
        accept[s], alias[s] = scaled[s], g
        scaled[g] -= 1.0 - scaled[s]
        (small if scaled[g] < 1.0 else large).append(g)
    return accept, alias  # leftovers keep accept 1 (rounding)


def _multi_stream_ids(
    dist: HeavyTailedIds, stream_keys: Sequence[int], counts: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """counts[s] ids of HeavyTailedIds(key=stream_keys[s]) (same alpha, num_ids, id_bits),
    concatenated, in one vectorised pass."""
    ranks = dist.ranks(int(counts.sum()), gen)
    keys = torch.tensor([_stream_key(k, dist.id_bits) for k in stream_keys], dtype=torch.int64, device="cpu")
    return _ids_of_ranks(ranks, torch.repeat_interleave(keys, counts), dist.id_bits)


def table_key(seed: int, table: int) -> int:
    """The HeavyTailedIds key of table `table` in dlrm_small_batch(seed=seed)."""
    return mix64(seed, table, 0x7461626C)


def dlrm_small_batch(
    step: int,
    num_tables: int = 8,
    batch_size: int = 4096,
    max_bag: int = 7,
    seed: int = 0,
    *,
    min_bag: int = 1,
    alpha: float = 1.05,
    id_bits: int = 40,
    num_ids: int | None = None,
    modulo: int | None = None,
):
    """The sparse input of one "dlrm-small" step (ANCHORS.md): a KeyedJaggedTensor with keys
    f0..f{num_tables-1}, `batch_size` bags per key of uniform length in [min_bag, max_bag], raw
    ids from HeavyTailedIds(alpha, num_ids or 2^id_bits, id_bits), each table its own hot ids.
    A pure function of (seed, step). `modulo` (e.g. 1M rows of a fixed-size table) maps ids to
    id % modulo.
    """
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    for name, value, low in (("num_tables", num_tables, 1), ("batch_size", batch_size, 1), ("min_bag", min_bag, 0)):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"dlrm_small_batch: {name} must be an int >= {low}, got {value!r}")
    if not (isinstance(max_bag, int) and max_bag >= min_bag):
        raise ValueError(f"dlrm_small_batch: max_bag must be an int >= min_bag = {min_bag}, got {max_bag!r}")
    if modulo is not None and not (isinstance(modulo, int) and modulo >= 1):
        raise ValueError(f"dlrm_small_batch: modulo must be None or an int >= 1, got {modulo!r}")
    dist = HeavyTailedIds(alpha=alpha, num_ids=num_ids if num_ids is not None else 1 << id_bits, id_bits=id_bits)
    gen = generator(seed, step, 0x646C726D)
    lengths = torch.randint(min_bag, max_bag + 1, (num_tables * batch_size,), generator=gen, device="cpu")
    counts = lengths.view(num_tables, batch_size).sum(1)
    ids = _multi_stream_ids(dist, [table_key(seed, t) for t in range(num_tables)], counts, gen)
    if modulo is not None:
        ids = ids.remainder(modulo)
    # With its ids per key (host ints, kept by .to(device)): the module checks it without a host read.
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(num_tables)],
        values=ids,
        lengths=lengths,
        stride=batch_size,
        length_per_key=counts.tolist(),
    )


# Distinct values per categorical feature of Criteo 1TB (as in MLPerf DLRM); each feature's ids
# are drawn from that many ranks.
CRITEO_1TB_CARDINALITIES = (
    39884406,
    39043,
    17289,
    7420,
    20263,
    3,
    7120,
    1543,
    63,
    38532951,
    2953546,
    403346,
    10,
    2208,
    11938,
    155,
    4,
    976,
    14,
    39979771,
    25641295,
    39664984,
    585935,
    12972,
    108,
    36,
)
NUM_DENSE = 13
NUM_SPARSE = 26


class SyntheticCriteo(IterableDataset):
    """A Criteo-shaped stream of `torchrec.datasets.utils.Batch`: 13 dense features (log of
    heavy-tailed counts, like the usual log(1 + x) transform of Criteo's integers), 26 sparse
    features `cat_0..cat_25` of raw heavy-tailed ids, and click labels drawn from a hidden model:

        logit = bias + w . (dense / sigma) + sum over `effect_features` f of
                mean over the ids of bag f of effect_f(id)

    where effect_f(id) is a fixed pseudo-random value per (truth_seed, f, id) with standard
    deviation `effect_scale`. A model that learns the dense weights and the embeddings of the
    frequent ids approaches the AUC of `hidden_logits` (~0.84 with the defaults; ids seen too
    rarely to learn keep a model below that).

    seed: the sample stream; truth_seed: the hidden model (keep it, change seed, for eval data).
    Each of `world_size` ranks gets its own `num_batches` batches; DataLoader workers split them.
    """

    def __init__(
        self,
        batch_size: int = 2048,
        num_batches: int = 100,
        seed: int = 0,
        *,
        truth_seed: int = 0,
        min_bag: int = 1,
        max_bag: int = 1,
        alpha: float = 1.05,
        id_bits: int = 64,
        cardinalities: Sequence[int] | None = CRITEO_1TB_CARDINALITIES,
        effect_features: Sequence[int] = (0, 1, 2, 3, 4, 5, 6, 7),
        effect_scale: float = 0.5,
        dense_weight_scale: float = 0.4,
        base_ctr: float = 0.25,
        rank: int = 0,
        world_size: int = 1,
    ):
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("num_batches", num_batches, 0),
            ("min_bag", min_bag, 0),
            ("world_size", world_size, 1),
        ):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"SyntheticCriteo: {name} must be an int >= {low}, got {value!r}")
        if not (isinstance(max_bag, int) and max_bag >= min_bag):
            raise ValueError(f"SyntheticCriteo: max_bag must be an int >= min_bag = {min_bag}, got {max_bag!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"SyntheticCriteo: rank must be an int in [0, world_size = {world_size}), got {rank!r}")
        if cardinalities is not None and len(cardinalities) != NUM_SPARSE:
            raise ValueError(f"SyntheticCriteo: cardinalities must have {NUM_SPARSE} entries, got {len(cardinalities)}")
        if any(not (isinstance(f, int) and 0 <= f < NUM_SPARSE) for f in effect_features):
            raise ValueError(
                f"SyntheticCriteo: effect_features must be ints in [0, {NUM_SPARSE}), got {effect_features!r}"
            )
        if not 0.0 < base_ctr < 1.0:
            raise ValueError(f"SyntheticCriteo: base_ctr must be in (0, 1), got {base_ctr!r}")
        self.batch_size, self.num_batches, self.seed, self.truth_seed = batch_size, num_batches, seed, truth_seed
        self.min_bag, self.max_bag, self.rank, self.world_size = min_bag, max_bag, rank, world_size
        self.effect_features, self.effect_scale = tuple(effect_features), float(effect_scale)
        self.keys: list[str] = [f"cat_{i}" for i in range(NUM_SPARSE)]
        self._dists = [
            HeavyTailedIds(
                alpha=alpha,
                id_bits=id_bits,
                key=mix64(truth_seed, f, 0x63617473),
                num_ids=min(cardinalities[f], 1 << id_bits) if cardinalities else 1 << id_bits,
            )
            for f in range(NUM_SPARSE)
        ]
        # The hidden model, a pure function of truth_seed: per-feature log-normal count parameters,
        # dense weights, and the bias that puts the mean click rate near base_ctr.
        g = generator(truth_seed, 0x74727574)
        self._dense_mu = torch.rand(NUM_DENSE, generator=g, dtype=torch.float64, device="cpu") * 3.0 - 0.5
        self._dense_sigma = torch.rand(NUM_DENSE, generator=g, dtype=torch.float64, device="cpu") * 1.5 + 0.5
        self._dense_weight = torch.randn(NUM_DENSE, generator=g, dtype=torch.float64, device="cpu") * dense_weight_scale
        self._effect_keys = [_signed64(mix64(truth_seed, f, 0x65666663)) for f in range(NUM_SPARSE)]
        self._bias = 0.0
        probe = [self._make(i, 0x70726F62) for i in range(4)]  # calibration batches off the data stream
        logits = torch.cat([self.hidden_logits(b) for b in probe]).double()
        self._bias = _bias_for_rate(logits, base_ctr)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(worker, self.num_batches, workers):
            yield self.batch(i)

    def batch(self, index: int):
        """Batch `index` of this rank's stream (a pure function of seed, rank, index)."""
        return self._make(index * self.world_size + self.rank, self.seed)

    def _make(self, stream_index: int, seed: int):
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        gen = generator(seed, stream_index, 0x63726974)
        b = self.batch_size
        z = torch.randn(b, NUM_DENSE, generator=gen, dtype=torch.float64, device="cpu")
        counts = torch.floor(torch.exp(self._dense_mu + self._dense_sigma * z))
        dense = torch.log1p(counts).float()
        lengths = torch.randint(self.min_bag, self.max_bag + 1, (NUM_SPARSE * b,), generator=gen, device="cpu")
        per_feature = lengths.view(NUM_SPARSE, b).sum(1).tolist()
        values = torch.cat([d.sample(n, gen) for d, n in zip(self._dists, per_feature)])
        sparse = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
        batch = Batch(dense_features=dense, sparse_features=sparse, labels=torch.empty(0, device="cpu"))
        p = torch.sigmoid(self.hidden_logits(batch).double())
        batch.labels = (torch.rand(b, generator=gen, dtype=torch.float64, device="cpu") < p).float()
        return batch

    def hidden_logits(self, batch) -> torch.Tensor:
        """The ground-truth logit of each sample of a batch from this stream (float32, [B]):
        scoring labels with it gives the best AUC any model can reach on this data."""
        # log1p(floor(e^x)) ~ max(x, 0): dividing by sigma puts the features on a unit scale (the
        # calibrated bias absorbs their means).
        logit = self._bias + (batch.dense_features.double() / self._dense_sigma) @ self._dense_weight
        jts = batch.sparse_features.to_dict()
        for f in self.effect_features:
            jt = jts[self.keys[f]]
            key = self._effect_keys[f]
            h = _mix_rounds((jt.values() ^ key).numpy().view(np.uint64), 64)
            u = torch.from_numpy((h >> np.uint64(11)).astype(np.float64) * 2.0**-53)
            effect = (u - 0.5) * (math.sqrt(12.0) * self.effect_scale)
            lengths = jt.lengths()
            bag = torch.zeros(lengths.numel(), dtype=torch.float64, device="cpu").index_add_(
                0, torch.repeat_interleave(torch.arange(lengths.numel(), device="cpu"), lengths), effect
            )
            logit = logit + bag / lengths.clamp(min=1)
        return logit.float()


def _bias_for_rate(logits: torch.Tensor, rate: float) -> float:
    """The b with mean(sigmoid(logits + b)) = rate (bisection)."""
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if float(torch.sigmoid(logits + mid).mean()) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
