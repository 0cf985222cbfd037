"""Admission: which unseen ids of a training batch get a row.

A dynamic table admits an id without a row only when its table's strategy says so; ids not
admitted read as zeros and learn nothing. One class per strategy, with one interface:

- ``admit(keys, counts, unseen, step)``: the bool mask of the table's distinct ``keys`` (seen
  ``counts`` times in this batch) that may take a row; ``unseen`` marks those without one (the
  others are never refused). ``step`` is the table's training step (1, 2, ...).
- ``state()`` / ``state_keys()``: the strategy's checkpoint entries; ``load(...)`` checks one
  (``checked_state``) and the table installs it all-or-nothing (``install``).
- ``nbytes()``: memory held, as the planner counts it (``admission_bytes``).

Strategies (``DynamicTableOptions.admission``):

``counter``  exact sighting counts of ids without a row, in a side hash table of
    ``admission_capacity`` ids that forgets the rarest first; an id is admitted once seen
    ``admit_after`` times, and forgotten by the counter then.
``bloom``  a counting Bloom filter of 4-bit saturating counters (``BloomGeometry``): an unseen
    id's sightings are added to its k counters (``min(counter + count, 15)``); it is admitted
    when the smallest of its k counters reaches ``admit_after``. Every ``bloom_decay_steps``
    training steps each counter is halved first, so stale sightings age out. Counters are not
    decremented on admission (a saturated counter cannot be): an id evicted soon after admission
    is re-admitted at its next sighting, until decay has halved its counts. In one batch all
    sightings are added before any id is decided. One native op per batch (``ops.bloom_admit``:
    parallel over ids on CPU, a thread per id on GPU); the cells are ``bloom_cells``.
``probabilistic``  an unseen id is admitted iff ``u(seed, table, id) < admit_probability``, u a
    53-bit uniform from a hash of the id (independent of the bucket, routing and initializer
    hashes). No state; the same ids are admitted whatever the batch order or world size. The
    draw is per id, not per sighting: an id refused once is refused always (a fixed fraction
    ``p`` of the id space gets rows).

Bloom filters and sharding: a row-wise shard's filter is sized for its share (budget and
expected ids divided by the world size), with the same hashes. Counters are a power of two,
so a filter maps onto one of any other power-of-two size: folding (summing counters whose
positions agree modulo the smaller size) or tiling (repeating the smaller) keeps every id's
counters >= its true count, when both use the same hashes (a shard keeps its table's k,
``bloom_hashes``; a filter with more hashes than the saved one would read cells the saved one
never counted). Checkpoints hold one filter per rank ([ranks, bytes]); a rank
loading the same layout takes its own back exactly, any other layout (another world size, an
unsharded module) loads the saturating sum of all saved filters folded or tiled to its size: no
sighting is lost (no false negative), but each rank's filter then also holds the other ranks'
ids (more false positives) until decay halves them away.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext import ops
from torchrec_ext.hashing import fmix64_tensor, srl, u64
from torchrec_ext.modules.state_checks import _check_distinct, _checked
from torchrec_ext.table import HashTable

# Hash salts: an admission hash must not correlate with the bucket, routing or initializer hashes.
from torchrec_ext.vocabulary import (
    BLOOM_COUNTER_BITS,
    BLOOM_COUNTER_MAX,
    BLOOM_MAX_HASHES,
    BLOOM_SALT,
    PROBABILITY_SALT,
    index_bytes,
)

ADMISSIONS = ("counter", "bloom", "probabilistic")
BLOOM_DEFAULT_FPR = 0.01
PROBABILITY_BITS = 53
COUNTER_COUNT_BYTES = 8  # its int64 sighting count


def bloom_fpr(counters: int, hashes: int, ids: int) -> float:
    """False-positive rate of a Bloom filter of ``counters`` cells and ``hashes`` hashes holding
    ``ids`` distinct ids: the chance that all k cells of an id never inserted are non-zero."""
    return (1.0 - math.exp(-hashes * ids / counters)) ** hashes


@dataclass(frozen=True)
class BloomGeometry:
    """Size of one counting Bloom filter: ``counters`` 4-bit cells (a power of two), ``hashes``
    cells per id, designed for ``expected_ids`` distinct ids."""

    counters: int
    hashes: int
    expected_ids: int

    @property
    def nbytes(self) -> int:
        return max(1, self.counters * BLOOM_COUNTER_BITS // 8)

    @property
    def fpr(self) -> float:
        return bloom_fpr(self.counters, self.hashes, self.expected_ids)


def _best_hashes(counters: int, ids: int) -> int:
    """The k in [1, 16] minimising the false-positive rate (about counters / ids * ln 2)."""
    guess = max(1, min(BLOOM_MAX_HASHES, round(counters / ids * math.log(2))))
    near = {max(1, min(BLOOM_MAX_HASHES, guess + d)) for d in (-1, 0, 1)}
    return min(sorted(near), key=lambda k: bloom_fpr(counters, k, ids))


def bloom_geometry(
    expected_ids: int, budget_bytes: int | None, fpr: float | None, where: str, hashes: int | None = None
) -> BloomGeometry:
    """The filter for ``expected_ids`` ids: from a byte budget (the largest power-of-two counter
    count it holds), or else the smallest power-of-two filter reaching ``fpr`` (default 1%).
    With both, a budget whose filter misses the rate is refused, naming the bytes it needs.
    ``hashes``: k given (a shard keeps its table's), else chosen for the size."""
    if budget_bytes is not None:
        counters = 1 << max(1, (budget_bytes * 8 // BLOOM_COUNTER_BITS).bit_length() - 1)
        geometry = BloomGeometry(counters, hashes or _best_hashes(counters, expected_ids), expected_ids)
        if fpr is not None and geometry.fpr > fpr:
            need = bloom_geometry(expected_ids, None, fpr, where)
            raise ValueError(
                f"{where}: bloom_bytes={budget_bytes} is too small for bloom_fpr={fpr} at bloom_expected_ids="
                f"{expected_ids}: it holds {counters} {BLOOM_COUNTER_BITS}-bit counters ({geometry.nbytes} bytes), "
                f"a false-positive rate of {geometry.fpr:.4g}; that rate needs bloom_bytes >= {need.nbytes}"
            )
        return geometry
    target = BLOOM_DEFAULT_FPR if fpr is None else fpr
    # Optimal cells per id for the rate: -ln(p) / ln(2)^2, rounded up to a power of two. The
    # rounding leaves room: the fewest hashes that still reach the rate do (fewer cells touched).
    cells = math.ceil(expected_ids * -math.log(target) / math.log(2) ** 2)
    counters = 1 << max(1, (cells - 1).bit_length())
    best = _best_hashes(counters, expected_ids)
    hashes = hashes or next(
        k for k in range(1, best + 1) if k == best or bloom_fpr(counters, k, expected_ids) <= target
    )
    return BloomGeometry(counters, hashes, expected_ids)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_admission_options(opts, capacity: int, where: str) -> str | None:
    """Checks a config's admission fields (``DynamicTableOptions``); returns the strategy name
    (None: every id is admitted). Raises ValueError / TypeError naming the field and value."""
    name = opts.admission
    if name is not None and (not isinstance(name, str) or name not in ADMISSIONS):
        raise ValueError(f"{where}: admission must be one of {list(ADMISSIONS)} or None, got {name!r}")
    if name is None:
        name = "counter" if opts.admit_after > 1 else None
    if opts.admit_probability is not None and name != "probabilistic":
        raise ValueError(f"{where}: admit_probability applies to admission='probabilistic', got admission={name!r}")
    bloom_fields = ("bloom_bytes", "bloom_fpr", "bloom_expected_ids", "bloom_decay_steps", "bloom_hashes")
    given = [f for f in bloom_fields if getattr(opts, f) is not None]
    if given and name != "bloom":
        raise ValueError(f"{where}: {', '.join(given)} apply to admission='bloom', got admission={name!r}")
    if name in ("counter", "bloom") and opts.admit_after < 2:
        raise ValueError(
            f"{where}: admission={name!r} needs admit_after >= 2 (1 admits every id at its first "
            f"sighting), got {opts.admit_after}"
        )
    if name == "bloom":
        if opts.admit_after > BLOOM_COUNTER_MAX:
            raise ValueError(
                f"{where}: admission='bloom' counts up to {BLOOM_COUNTER_MAX} ({BLOOM_COUNTER_BITS}-bit "
                f"counters), so admit_after must be <= {BLOOM_COUNTER_MAX}, got {opts.admit_after}"
            )
        if opts.bloom_bytes is not None and (not _is_int(opts.bloom_bytes) or opts.bloom_bytes < 1):
            raise ValueError(f"{where}: bloom_bytes must be an int >= 1 or None, got {opts.bloom_bytes!r}")
        if opts.bloom_fpr is not None and (
            isinstance(opts.bloom_fpr, bool)
            or not isinstance(opts.bloom_fpr, (int, float))
            or not 0 < opts.bloom_fpr < 1
        ):
            raise ValueError(f"{where}: bloom_fpr must be a number in (0, 1) or None, got {opts.bloom_fpr!r}")
        if opts.bloom_expected_ids is not None and (
            not _is_int(opts.bloom_expected_ids) or opts.bloom_expected_ids < 1
        ):
            raise ValueError(
                f"{where}: bloom_expected_ids must be an int >= 1 or None, got {opts.bloom_expected_ids!r}"
            )
        if opts.bloom_decay_steps is not None and (not _is_int(opts.bloom_decay_steps) or opts.bloom_decay_steps < 1):
            raise ValueError(f"{where}: bloom_decay_steps must be an int >= 1 or None, got {opts.bloom_decay_steps!r}")
        if opts.bloom_hashes is not None and (
            not _is_int(opts.bloom_hashes) or not 1 <= opts.bloom_hashes <= BLOOM_MAX_HASHES
        ):
            raise ValueError(
                f"{where}: bloom_hashes must be an int in [1, {BLOOM_MAX_HASHES}] or None, got {opts.bloom_hashes!r}"
            )
        bloom_geometry(opts.bloom_expected_ids or capacity, opts.bloom_bytes, opts.bloom_fpr, where, opts.bloom_hashes)
    if name == "probabilistic":
        p = opts.admit_probability
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"{where}: admission='probabilistic' needs admit_probability in (0, 1], got {p!r}")
        if opts.admit_after != 1:
            raise ValueError(
                f"{where}: admit_after applies to admission='counter' or 'bloom', got admit_after="
                f"{opts.admit_after} with admission='probabilistic'"
            )
    return name


# ---------------------------------------------------------------------------- strategies


class Admission:
    """The interface every strategy implements (see the module docstring)."""

    name = ""

    def admit(self, keys: Tensor, counts: Tensor, unseen: Tensor, step: int) -> Tensor:
        raise NotImplementedError

    def readmit(self, keys: Tensor) -> None:
        """``keys`` (distinct) that the table admitted or held, taken out of it again (a tiered
        lookup that failed after its upsert): their next sighting admits them. Strategies that
        forget nothing on admission (bloom, probabilistic) have nothing to do."""

    def state_keys(self) -> list[str]:
        return []

    def state(self) -> dict[str, Tensor]:
        return {}

    def checked_state(self, state: dict[str, Tensor], where: str, device: torch.device | None = None) -> Admission:
        """A new strategy holding ``state`` (checked; empty when the keys are absent), on
        ``device`` (default: this one's)."""
        return self

    def moved(self, device: torch.device) -> Admission:
        """This strategy with its state on ``device``: a copy, not rebuilt (a device move)."""
        return self

    def nbytes(self) -> int:
        return 0


class CounterAdmission(Admission):
    """Exact sighting counts in a side hash table (LFU: the rarest are forgotten when full)."""

    name = "counter"

    def __init__(self, admit_after: int, capacity: int, device: torch.device):
        self.admit_after, self.capacity = admit_after, capacity
        self.counter = HashTable(capacity, policy="lfu", device=device)
        self.seen = torch.zeros(capacity, dtype=torch.int64, device=device)

    # CPU keys take the compacting form (tests turn it off to run the fixed-size form on the CPU).
    compact_on_cpu = True

    def admit(self, keys: Tensor, counts: Tensor, unseen: Tensor, step: int) -> Tensor:
        if self.compact_on_cpu and keys.device.type == "cpu":
            return self._admit_compacted(keys, counts, unseen)
        # One entry per key throughout (nothing read on the host): the ids not pending (seen)
        # take no part in the side table's upsert, and the writes below are fixed-size.
        result = self.counter.find_or_insert_fixed(keys, counts, unseen)
        live = result.rows >= 0  # pending and given a row (a refused id is not counted)
        rows = result.rows.clamp(min=0)
        before = self.seen.index_select(0, rows)
        # A row new to the counter starts from 0 (its slot may hold an evicted id's count).
        seen = torch.where(result.inserted, 0, before) + counts
        ready = live & (seen >= self.admit_after)
        # Live rows are distinct; the other entries add 0 (to row 0): an exact integer sum.
        self.seen.index_put_((rows,), torch.where(live, seen - before, 0), accumulate=True)
        done = torch.zeros(self.capacity, dtype=torch.uint8, device=keys.device)
        self.counter.erase_rows(done.index_put_((rows,), ready.to(torch.uint8), accumulate=True).bool())
        return ready

    def _admit_compacted(self, keys: Tensor, counts: Tensor, unseen: Tensor) -> Tensor:
        """``admit`` on the CPU, where reading sizes costs no sync: the side table sees only the
        unseen ids, and no pass over its capacity (the fixed-size form's erase mask) is made,
        which cost 1.4x the no-admission step on dlrm-small. The same decisions and counts."""
        admitted = torch.zeros_like(unseen)
        which = unseen.nonzero().squeeze(1)
        if which.numel() == 0:
            return admitted
        pending, pending_counts = keys.index_select(0, which), counts.index_select(0, which)
        result = self.counter.find_or_insert(pending, pending_counts)
        live = result.rows >= 0
        rows = result.rows.clamp(min=0)  # a refused key (no row: full buckets) reads row 0, then is masked out
        # A row new to the counter starts from 0 (its slot may hold an evicted id's count).
        seen = torch.where(result.inserted, 0, self.seen.index_select(0, rows)) + pending_counts
        ready = live & (seen >= self.admit_after)
        if bool(live.all()):  # the keys are distinct, so are their rows
            self.seen.index_copy_(0, rows, seen)
        else:
            self.seen[result.rows[live]] = seen[live]
        self.counter.erase(pending.index_select(0, ready.nonzero().squeeze(1)))
        admitted.index_copy_(0, which, ready)
        return admitted

    def readmit(self, keys: Tensor) -> None:
        # Admission forgot them: counted again as seen admit_after times (a full counter drops
        # the rarest, as for any id).
        if self.admit_after > 1 and keys.numel():
            rows = self.counter.insert_or_assign(keys, torch.full_like(keys, self.admit_after)).rows
            self.seen.index_fill_(0, rows[rows >= 0], self.admit_after)

    def state_keys(self) -> list[str]:
        return ["admission_id", "admission_count"]

    def state(self) -> dict[str, Tensor]:
        pending = self.counter.state_dict()
        return {"admission_id": pending["keys"], "admission_count": self.seen[pending["rows"]].clone()}

    def checked_state(
        self, state: dict[str, Tensor], where: str, device: torch.device | None = None
    ) -> CounterAdmission:
        device = self.seen.device if device is None else device
        fresh = CounterAdmission(self.admit_after, self.capacity, device)
        if "admission_id" not in state:
            return fresh
        ids = _checked(where, "admission_id", state["admission_id"], "int", None)
        counts = _checked(where, "admission_count", state.get("admission_count"), "int", tuple(ids.shape))
        _check_distinct(where, "admission_id", ids)
        if counts.numel() and int(counts.min()) < 0:
            i = int((counts < 0).nonzero()[0])
            raise ValueError(
                f"{where} admission_count must be >= 0, got {int(counts[i])} at entry {i} (admission_id {int(ids[i])})"
            )
        ids, counts = ids.to(device, torch.int64), counts.to(device, torch.int64)
        # A bounded counter: sightings that do not fit are dropped, as a full counter drops them.
        rows = fresh.counter.insert_or_assign(ids, counts).rows
        live = rows >= 0
        fresh.seen[rows[live]] = counts[live]
        return fresh

    def moved(self, device: torch.device) -> CounterAdmission:
        twin = copy.copy(self)
        twin.counter, twin.seen = self.counter.clone(device), self.seen.to(device, copy=True)
        return twin

    def nbytes(self) -> int:
        return self.counter.metadata_bytes() + self.seen.numel() * self.seen.element_size()


def bloom_hash_seed(seed: int) -> int:
    """What keys are hashed with for a table of ``seed``: ``seed ^ BLOOM_SALT`` as an int64 bit
    pattern (``ops.bloom_admit``'s ``hash_seed``)."""
    salted = (seed ^ BLOOM_SALT) & ((1 << 64) - 1)
    return salted - (1 << 64) if salted >> 63 else salted


def bloom_cells(keys: Tensor, seed: int, geometry: BloomGeometry) -> Tensor:
    """[n, k] counter indices of each key: double hashing h1 + i * h2 of h = fmix64(key ^
    bloom_hash_seed(seed)) (h1 = its low 32 bits, h2 = its high 32 bits | 1), modulo the
    power-of-two counter count. The kernels of ``ops.bloom_admit`` hash the same way
    (``csrc/bloom_layout.h``)."""
    h = fmix64_tensor(keys ^ bloom_hash_seed(seed))
    h1, h2 = h & 0xFFFFFFFF, srl(h, 32) | 1
    steps = torch.arange(geometry.hashes, dtype=torch.int64, device=keys.device)
    return (h1.unsqueeze(1) + steps * h2.unsqueeze(1)) & (geometry.counters - 1)


def unpack_counters(packed: Tensor) -> Tensor:
    """uint8 [bytes] of two 4-bit counters each (low nibble first) -> uint8 [2 * bytes]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def pack_counters(counters: Tensor) -> Tensor:
    pairs = counters.view(*counters.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def resize_counters(counters: Tensor, size: int) -> Tensor:
    """Unpacked counters [.., m] of a filter onto ``size`` cells (both powers of two), keeping
    every id's counters >= its count: folded (summed modulo ``size``) or tiled."""
    m = counters.shape[-1]
    wide = counters.to(torch.int64)
    if m >= size:
        wide = wide.view(*counters.shape[:-1], m // size, size).sum(-2)
    else:
        wide = wide.repeat(*([1] * (counters.dim() - 1)), size // m)
    return wide.clamp_(max=BLOOM_COUNTER_MAX).to(torch.uint8)


class BloomAdmission(Admission):
    """A counting Bloom filter of 4-bit saturating counters, halved every ``decay_steps``."""

    name = "bloom"

    def __init__(
        self, admit_after: int, geometry: BloomGeometry, decay_steps: int | None, seed: int, device: torch.device
    ):
        self.admit_after, self.geometry, self.decay_steps, self.seed = admit_after, geometry, decay_steps, seed
        self.hash_seed = bloom_hash_seed(seed)
        self.packed = torch.zeros(geometry.nbytes, dtype=torch.uint8, device=device)

    def decay(self) -> None:
        """Halves every counter (both nibbles of a byte at once), in place."""
        self.packed.bitwise_right_shift_(1).bitwise_and_(0x77)

    def admit(self, keys: Tensor, counts: Tensor, unseen: Tensor, step: int) -> Tensor:
        if self.decay_steps is not None and step % self.decay_steps == 0:
            self.decay()
        # Only ids without a row are counted (pending = unseen); the others are never refused.
        return ops.bloom_admit(
            self.packed, keys, counts, unseen, self.hash_seed, self.geometry.hashes, self.admit_after
        )

    def state_keys(self) -> list[str]:
        return ["admission_bloom"]

    def state(self) -> dict[str, Tensor]:
        return {"admission_bloom": self.packed.clone().unsqueeze(0)}  # one filter per row (a rank's)

    def checked_state(self, state: dict[str, Tensor], where: str, device: torch.device | None = None) -> BloomAdmission:
        device = self.packed.device if device is None else device
        fresh = BloomAdmission(self.admit_after, self.geometry, self.decay_steps, self.seed, device)
        if "admission_bloom" not in state:
            return fresh
        saved = state["admission_bloom"]
        if not isinstance(saved, Tensor) or saved.dtype != torch.uint8:
            raise TypeError(
                f"{where} admission_bloom must be a uint8 tensor, got "
                f"{saved.dtype if isinstance(saved, Tensor) else type(saved).__name__}"
            )
        if saved.dim() != 2 or saved.shape[1] < 1 or saved.shape[1] & (saved.shape[1] - 1):
            raise ValueError(
                f"{where} admission_bloom must be [filters, bytes] with a power-of-two byte count "
                f"(one packed filter per row), got {list(saved.shape)}"
            )
        fresh.packed.copy_(self.combined(saved.to(device)))
        return fresh

    def combined(self, filters: Tensor) -> Tensor:
        """Saved packed filters [r, bytes] as one filter of this size: their saturating sum,
        each folded or tiled to this filter's counter count (one identical filter: itself)."""
        if filters.shape == (1, self.geometry.nbytes):
            return filters[0]
        counters = unpack_counters(filters)
        resized = resize_counters(counters, self.geometry.counters).to(torch.int64).sum(0)
        return pack_counters(resized.clamp_(max=BLOOM_COUNTER_MAX).to(torch.uint8))

    def counters(self) -> Tensor:
        return unpack_counters(self.packed)

    def moved(self, device: torch.device) -> BloomAdmission:
        twin = copy.copy(self)
        twin.packed = self.packed.to(device, copy=True)
        return twin

    def nbytes(self) -> int:
        return self.packed.numel()


def probabilistic_draw(keys: Tensor, seed: int) -> Tensor:
    """Each key's 53-bit uniform integer, a pure function of (seed, key)."""
    h = fmix64_tensor(fmix64_tensor(keys ^ u64((seed ^ PROBABILITY_SALT) & ((1 << 64) - 1))))
    return srl(h, 64 - PROBABILITY_BITS)


class ProbabilisticAdmission(Admission):
    """Admits the unseen ids whose hash draw falls under ``probability``; no state."""

    name = "probabilistic"

    def __init__(self, probability: float, seed: int):
        self.probability, self.seed = probability, seed
        self.threshold = int(probability * (1 << PROBABILITY_BITS))  # draw < threshold: admitted

    def admit(self, keys: Tensor, counts: Tensor, unseen: Tensor, step: int) -> Tensor:
        return unseen & (probabilistic_draw(keys, self.seed) < self.threshold)


def make_admission(opts, name: str | None, capacity: int, seed: int, device: torch.device) -> Admission | None:
    """The strategy of a table's options (``check_admission_options`` resolved ``name``)."""
    if name is None:
        return None
    if name == "counter":
        return CounterAdmission(opts.admit_after, opts.admission_capacity or capacity, device)
    if name == "bloom":
        geometry = bloom_geometry(
            opts.bloom_expected_ids or capacity, opts.bloom_bytes, opts.bloom_fpr, "admission", opts.bloom_hashes
        )
        return BloomAdmission(opts.admit_after, geometry, opts.bloom_decay_steps, seed, device)
    return ProbabilisticAdmission(float(opts.admit_probability), seed)


def admission_bytes(opts, name: str | None, capacity: int, parts: int = 1) -> int:
    """Bytes one rank's share (of ``parts``) of a table's admission state holds (planner)."""
    share = lambda n: -(-n // parts)  # noqa: E731
    if name == "counter":
        pending = share(opts.admission_capacity or capacity)
        return index_bytes(pending) + COUNTER_COUNT_BYTES * pending  # its side table's index, its counts
    if name == "bloom":
        return local_bloom_geometry(opts, capacity, parts).nbytes
    return 0


def local_bloom_geometry(opts, capacity: int, parts: int) -> BloomGeometry:
    """One row-wise shard's filter: the table's expected ids divided by ``parts``, and at least its
    share of the counters, rounded up to a power of two (filters must be powers of two to fold and
    tile): the shard keeps the table's false-positive rate, at up to twice its share of the bytes
    when ``parts`` is not a power of two."""
    whole = bloom_geometry(
        opts.bloom_expected_ids or capacity, opts.bloom_bytes, opts.bloom_fpr, "admission", opts.bloom_hashes
    )
    if parts == 1:
        return whole
    expected = -(-whole.expected_ids // parts)
    share = -(-whole.counters // parts)
    counters = max(2, 1 << (share - 1).bit_length())  # the power of two >= whole / parts
    if opts.bloom_fpr is not None:  # the share of ids is rounded up: keep the target exactly
        while bloom_fpr(counters, whole.hashes, expected) > opts.bloom_fpr:
            counters *= 2
    return BloomGeometry(counters, whole.hashes, expected)  # the same hashes: filters fold and tile


def local_admission_fields(opts, capacity: int, parts: int) -> dict[str, object]:
    """The admission fields of a row-wise shard's config (``parts`` ranks; 1: table-wise)."""
    fields: dict[str, object] = dict(
        admission=opts.admission,
        admit_after=opts.admit_after,
        admit_probability=opts.admit_probability,
        bloom_decay_steps=opts.bloom_decay_steps,
    )
    fields["admission_capacity"] = None if opts.admission_capacity is None else -(-opts.admission_capacity // parts)
    if opts.admission == "bloom":
        geometry = local_bloom_geometry(opts, capacity, parts)
        fields.update(
            bloom_bytes=geometry.nbytes,
            bloom_expected_ids=geometry.expected_ids,
            bloom_fpr=None,
            bloom_hashes=geometry.hashes,
        )
    else:
        fields.update(
            bloom_bytes=opts.bloom_bytes,
            bloom_fpr=opts.bloom_fpr,
            bloom_expected_ids=opts.bloom_expected_ids,
            bloom_hashes=opts.bloom_hashes,
        )
    return fields
