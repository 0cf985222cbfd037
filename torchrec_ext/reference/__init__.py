"""Pure-Python/PyTorch references of every torchrec_ext op: the test oracles.

Written from the specification, not from the kernels, and kept deliberately simple (one key at
a time, plain dicts), so a disagreement with a kernel points at a bug in one of them. One module
per op family (named as the op's kernels, wrapper and tests): ``hash_table`` (placement, upsert
order, the dict model, the ``hash_*`` ops), ``route`` (``route``, ``route_bucketize``), ``bloom``
(``bloom_admit``), ``serving_index`` (the read-only serving index), ``dedup``, ``init_rows``,
``embedding_lookup``, ``embedding_update`` (with the optimizers), ``rounding``, ``fallback``; ``storage`` and ``hashing`` hold what several share.

An independent oracle: it imports nothing from the rest of the package and keeps its own copies
of the constants (``tests/test_vocabulary.py`` checks they agree with ``torchrec_ext.vocabulary``
and the C++ headers). Every name, private helpers included, is re-exported here, so
``from torchrec_ext.reference import X`` and ``reference.X`` keep working.
"""

from torchrec_ext.reference.bloom import (  # noqa: F401
    BLOOM_COUNTER_MAX,
    bloom_admit,
    bloom_key_cells,
)
from torchrec_ext.reference.dedup import (  # noqa: F401
    dedup_ids,
    dedup_segments,
)
from torchrec_ext.reference.embedding_lookup import (  # noqa: F401
    pooled_lookup,
    sequence_lookup,
)
from torchrec_ext.reference.embedding_update import (  # noqa: F401
    HYPERPARAMS,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    ROWWISE_STATE,
    _bag_of_values,
    ftrl_step,
    fused_update,
)
from torchrec_ext.reference.fallback import (  # noqa: F401
    FALLBACK_GOLDEN,
    fallback_seed,
    fallback_slots,
)
from torchrec_ext.reference.hash_table import (  # noqa: F401
    POLICIES,
    SLOTS,
    ReferenceHashTable,
    _stripe_span,
    bucket_pairs,
    geometry,
    hash_erase,
    hash_export,
    hash_find,
    hash_find_tables,
    hash_place,
    hash_restore,
    hash_slot_rows,
    hash_upsert,
    hash_upsert_fixed,
    hash_upsert_tables,
    insert_order,
    place,
    place_keys,
    stash_slots,
    stripe_of,
    touched_score,
    upsert_phase,
    upsert_window,
    upsert_windows,
)
from torchrec_ext.reference.hashing import (  # noqa: F401
    _INT64_MAX,
    _MASK64,
    _fastrange32,
    _fmix64,
    _srl,
    _u64,
    fmix64_tensor,
)
from torchrec_ext.reference.init_rows import (  # noqa: F401
    GOLDEN,
    INITIALIZER_NAMES,
    INITIALIZERS,
    PARAM_COUNTS,
    TRUNC_NORMAL_ATTEMPTS,
    _box_muller,
    init_rows,
    init_vectors,
    pair_bits,
    table_seed,
)
from torchrec_ext.reference.rounding import (  # noqa: F401
    BF16_MAX_BITS,
    BF16_OVERFLOW_BOUNDARY,
    HALF_MAX_BITS,
    HALF_OVERFLOW_BOUNDARY,
    SR_GOLDEN,
    round_to_storage,
    rounding_bits,
    rounding_seed,
)
from torchrec_ext.reference.route import (  # noqa: F401
    route,
    route_bucketize,
)
from torchrec_ext.reference.serving_index import (  # noqa: F401
    SERVING_BUCKET_WORDS,
    SERVING_KEYS_PER_BUCKET,
    SERVING_MULTIPLIER,
    SERVING_OVERFLOW_BIT,
    SERVING_SEED,
    _buckets,
    serving_find,
    serving_home_bucket,
    serving_index_entries,
    serving_index_reachable,
    serving_index_update,
)
from torchrec_ext.reference.storage import (  # noqa: F401
    STORAGE_DTYPES,
    _capacities,
    _dtypes_of,
    _table_rows,
    dense_state_offsets,
    dtype_code,
    table_words,
)
