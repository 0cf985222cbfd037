"""The package's vocabulary: every name and number the layers must agree on, said once.

Eviction policies, optimizer kinds with their state buffers and hyper-parameters, initializer
kinds with their parameter counts, storage dtypes and the flat-buffer layout arithmetic, the
hash table's bucket geometry and layout version, the hash seeds and salts, and the pending-row
encoding. The kernels (``csrc/``, ``torch_kernels.py``, ``triton_kernels/``), ``ops``, ``table``,
the modules, the planner and the inference storage import them from here. This is the lowest
layer: it imports only torch and the standard library.

``torchrec_ext.reference`` (the test oracle) keeps its own copies written from the
specification; ``tests/test_vocabulary.py`` checks the two agree, and that the C++ enums and
constants (``csrc/*.h``, ``csrc/*.cpp``) agree with both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# ----------------------------------------------------------------------------- hash table

# Eviction policies, by their id in csrc/hash_table_layout.h's ``Policy`` enum.
POLICIES: dict[str, int] = {"none": 0, "lru": 1, "lfu": 2, "epoch_lru": 3, "epoch_lfu": 4, "custom": 5}

# Bucket geometry (csrc/hash_table_layout.h: kSlotsPerBucket, kBucketsPerStripeTarget, kMaxStripes):
# buckets of 32 slots, grouped in stripes of ~64 buckets, at most 2^16 stripes.
SLOTS_PER_BUCKET = 32
BUCKETS_PER_STRIPE_TARGET = 64
MAX_STRIPES = 1 << 16


def table_geometry(capacity: int) -> tuple[int, int]:
    """(num_buckets, num_stripes) of a table of ``capacity`` rows (make_geometry in C++)."""
    num_buckets = -(-capacity // SLOTS_PER_BUCKET)
    return num_buckets, min(max(num_buckets // BUCKETS_PER_STRIPE_TARGET, 1), MAX_STRIPES)


# The stash (csrc/hash_table_layout.h: stash_slots, kStashSqrtPerBlock): entries for the few keys
# a full load leaves no row in their buckets, 32 per 128 of sqrt(capacity), at least 32. Its
# entries follow the main slots of the digest array (then one count per bucket) and of the key
# array (stash rows, then stash keys).
STASH_SQRT_PER_BLOCK = 128


def stash_slots(capacity: int) -> int:
    """Entries of the stash of a table of ``capacity`` rows."""
    root = math.isqrt(capacity - 1) + 1 if capacity > 0 else 0  # ceil(sqrt(capacity))
    return SLOTS_PER_BUCKET * max(-(-root // STASH_SQRT_PER_BLOCK), 1)


def index_lengths(capacity: int) -> tuple[int, int, int]:
    """Lengths of a table's digest, key and score arrays: main slots, stash (and its per-bucket
    counts in the digests)."""
    num_buckets, _ = table_geometry(capacity)
    slots, stash = num_buckets * SLOTS_PER_BUCKET, stash_slots(capacity)
    return slots + stash + num_buckets, slots + 2 * stash, slots


def index_bytes(capacity: int) -> int:
    """Bytes of a table's index (uint8 digests, int64 keys and scores: HashTable.metadata_bytes)."""
    digests, keys, scores = index_lengths(capacity)
    return digests + 8 * (keys + scores)


def row_map_dtype(capacity: int) -> torch.dtype:
    """dtype of a table's slot <-> row maps (HashTable's, kept by tables that grow)."""
    return torch.int32 if capacity < 2**31 else torch.int64


def row_map_bytes(capacity: int) -> int:
    """Bytes of a table's slot -> row and row -> slot maps (``row_map_dtype``, one entry per row each)."""
    return 2 * capacity * (4 if row_map_dtype(capacity) == torch.int32 else 8)


# Which rows a key may hold (csrc/hash_table_layout.h's make_geometry and place_key), saved with
# every state: rows saved by another layout are re-placed on load. Bump it when either changes.
LAYOUT_VERSION = 3
LAYOUTS = {
    1: "per-stripe buckets: both of a key's buckets in its stripe",
    2: "ring of stripes: a key's second bucket in the next stripe",
    3: "ring of stripes with a stash: a few keys of a full load in rows outside their buckets",
}
STASH_LAYOUT = 3  # the first layout with a stash: rows of earlier ones lie in their keys' buckets
# Layouts whose rows this one takes as they are (3 only added the stash to 2's buckets).
SAME_BUCKET_LAYOUTS = (2, 3)

# ----------------------------------------------------------------------------- hash seeds and salts
# 64-bit constants xor-ed into a key (or a table seed) before fmix64, one per hash stream, so no
# two streams correlate: a key's bucket, stripe, owning rank, admission cells, admission draw,
# initial vector, rounding bits and fallback row are independent of each other.

BUCKET_SEED = 0x9E3779B97F4A7C15  # kBucketSeed: bucket1 and the tag
STRIPE_SEED = 0xC2B2AE3D27D4EB4F  # kStripeSeed: the stripe and bucket2 (mixed into the bucket hash)
ROUTE_SEED = 0x165667B19E3779F9  # kRouteSeed: the owning rank under row-wise sharding
INIT_GOLDEN = 0x9E3779B97F4A7C15  # kGolden (csrc/init_rows_math.h): the initializer stream's counter step
ROUNDING_GOLDEN = 0xD6E8FEB86659FD93  # kRoundingGolden: the stochastic-rounding stream's counter step
FALLBACK_GOLDEN = 0x8CB92BA72F3D8DD7  # a table's fallback-row seed from its table seed
BLOOM_SALT = 0x2545F4914F6CDD1D  # a table's Bloom filter hash seed: table seed ^ salt
PROBABILITY_SALT = 0x94D049BB133111EB  # the probabilistic admission's draw

# ----------------------------------------------------------------------------- admission

BLOOM_COUNTER_BITS = 4
BLOOM_COUNTER_MAX = (1 << BLOOM_COUNTER_BITS) - 1  # kBloomCounterMax (csrc/bloom_layout.h)
BLOOM_MAX_HASHES = 16  # kBloomMaxHashes

# ----------------------------------------------------------------------------- rows

NO_ROW = -1  # an id without a row (refused, not admitted, unseen in eval): reads zeros, takes no update
# Pending rows, the kernels' side of the protocol (CPU kernels only; the GPU kernels refuse it). A
# row not yet written is handed to the kernels beside the storage:
# - pooled_lookup / sequence_lookup: ``rows`` entry PENDING_ROW_BASE - j (``pending_row(j)``) reads
#   ``new_vectors[t][j]``, t being the id's table;
# - fused_update: a unique u with ``unique_new[u] = j >= 0`` first takes ``new_vectors[t][j]`` and
#   ``state_init`` (one value per optimizer state), then its step.
# The modules' side (who defers, the one guard before any other read): modules/pending_rows.py.
PENDING_ROW_BASE = -2


def pending_row(j):
    """The row code of a table's ``j``-th pending row (an int or an int64 tensor)."""
    return PENDING_ROW_BASE - j


# ----------------------------------------------------------------------------- initializers

# By their id in csrc/init_rows_math.h's ``Init`` enum.
INITIALIZERS: dict[str, int] = {"uniform": 0, "normal": 1, "truncated_normal": 2, "constant": 3}
INITIALIZER_NAMES: dict[int, str] = {kind: name for name, kind in INITIALIZERS.items()}
# The parameters each kind reads, in order (init_rows' ``params``).
INITIALIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "uniform": ("low", "high"),
    "normal": ("mean", "std"),
    "truncated_normal": ("mean", "std", "low", "high"),
    "constant": ("value",),
}
INITIALIZER_PARAM_COUNTS: dict[str, int] = {name: len(params) for name, params in INITIALIZER_PARAMS.items()}
TRUNC_NORMAL_ATTEMPTS = 16  # kTruncNormalAttempts: draws of an element before it is clamped

# ----------------------------------------------------------------------------- optimizers

# By their id in csrc/embedding_update_cpu.cpp's ``Optim`` enum.
OPTIMIZERS: dict[str, int] = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3, "adamw": 4, "ftrl": 5}
# Optimizer state buffers per kind: elementwise ones are shaped like the weights, row-wise ones
# hold one float per row. Adam's moments keep fbgemm's names; FTRL's keep TensorFlow's
# (accumulator n, the sum of squared gradients; linear z).
OPTIMIZER_STATES: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "adagrad": ("momentum1",),
    "rowwise_adagrad": ("momentum1",),
    "adam": ("momentum1", "momentum2"),
    "adamw": ("momentum1", "momentum2"),
    "ftrl": ("accumulator", "linear"),
}
ROWWISE_STATE = {"rowwise_adagrad"}
# (kind, state) pairs that sum or average squared gradients: never negative (a square root is taken).
SQUARED_STATES = {
    ("adagrad", "momentum1"),
    ("rowwise_adagrad", "momentum1"),
    ("adam", "momentum2"),
    ("adamw", "momentum2"),
    ("ftrl", "accumulator"),
}
# The kernels' hyper-parameters, in order; FTRL's four come after the others' six (which it
# leaves at 0 but lr).
HYPERPARAMS = ("lr", "eps", "beta1", "beta2", "weight_decay", "lr_decay", "lr_power", "l1", "l2", "beta")
COMMON_HYPERPARAMS = HYPERPARAMS[:6]
FTRL_HYPERPARAMS = HYPERPARAMS[6:]

# ----------------------------------------------------------------------------- storage layout
# All tables of a module live in one flat buffer of 4-byte words (a float32 tensor); table t's
# [capacity_t, dim_t] rows start at word table_offsets[t], in the table's storage dtype, packed,
# its span rounded up to whole words. Element-wise optimizer states hold every table's
# [capacity_t, dim_t] back to back in table order; row-wise ones one float per row.

# Index = the kernels' dtype code (csrc/row_storage.h's ``Storage`` enum).
STORAGE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def dtype_code(dtype: torch.dtype) -> int:
    """The kernels' code of a storage dtype (its index in ``STORAGE_DTYPES``)."""
    return STORAGE_DTYPES.index(dtype)


def table_words(capacity: int, dim: int, dtype: torch.dtype = torch.float32) -> int:
    """4-byte words of a table's rows in the flat buffer: its bytes rounded up to whole words."""
    return -(-capacity * dim * STORAGE_DTYPES[dtype_code(dtype)].itemsize // 4)


def dense_state_offsets(capacities: Sequence[int], dims: Sequence[int]) -> list[int]:
    """Where each table's element-wise optimizer state starts: the tables back to back."""
    out, total = [], 0
    for cap, dim in zip(capacities, dims):
        out.append(total)
        total += cap * dim
    return out
