"""Configs of dynamic tables: TorchRec's EmbeddingBagConfig / EmbeddingConfig plus what a
dynamic table needs (eviction policy, initializer, admission, time-to-live, seed).

``num_embeddings`` is the table's capacity in rows. A plain TorchRec config is accepted
everywhere a dynamic one is and means the defaults.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, EmbeddingBagConfig, EmbeddingConfig

from torchrec_ext.modules.admission import check_admission_options
from torchrec_ext.vocabulary import INITIALIZER_NAMES, INITIALIZERS, POLICIES


@dataclass(frozen=True)
class Initializer:
    """How a new id's vector is drawn: a pure function of (seed, table, id).

    kind: ``uniform`` on [low, high] (default: TorchRec's +-sqrt(1 / num_embeddings), or the
    config's weight_init_min/max); ``normal`` (mean, std); ``truncated_normal`` (mean, std,
    cut to [low, high], default mean -+ 2 std); ``constant`` (value).

    first_column: the table is a column shard (``column_wise`` sharding) holding columns
    first_column.. of its whole table: it draws exactly those elements of the whole table's
    vectors (any column: bit for bit the whole vector's elements from there).
    """

    kind: str = "uniform"
    low: float | None = None
    high: float | None = None
    mean: float = 0.0
    std: float = 1.0
    value: float = 0.0
    first_column: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise TypeError(f"Initializer: kind must be a str, one of {sorted(INITIALIZERS)}, got {self.kind!r}")
        if self.kind not in INITIALIZERS:
            raise ValueError(f"Initializer: kind must be one of {sorted(INITIALIZERS)}, got {self.kind!r}")
        # A NaN or infinite setting would make every new row NaN (or inf) at its first lookup.
        for name in ("low", "high", "mean", "std", "value"):
            if getattr(self, name) is not None or name not in ("low", "high"):
                # Frozen: the checked value is stored as a plain float (the kernels take floats).
                object.__setattr__(self, name, check_finite(getattr(self, name), f"Initializer: {name}"))
        if self.std < 0:
            raise ValueError(f"Initializer: std must be >= 0, got {self.std}")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"Initializer: low must be <= high, got low={self.low}, high={self.high}")
        if not _is_int(self.first_column) or self.first_column < 0:
            raise ValueError(f"Initializer: first_column must be an int >= 0, got {self.first_column!r}")

    def kernel_params(self, default_low: float, default_high: float) -> tuple[int, tuple[float, ...]]:
        """(kind id, params) as csrc/init_rows_cpu.cpp's init_rows takes them (the first column
        last, when not 0)."""
        kind, params = self._kind_params(default_low, default_high)
        return kind, params + ((float(self.first_column),) if self.first_column else ())

    def _kind_params(self, default_low: float, default_high: float) -> tuple[int, tuple[float, ...]]:
        if self.kind == "uniform":
            low = default_low if self.low is None else self.low
            high = default_high if self.high is None else self.high
            return INITIALIZERS["uniform"], (low, high)
        if self.kind == "normal":
            return INITIALIZERS["normal"], (self.mean, self.std)
        if self.kind == "truncated_normal":
            low = self.mean - 2 * self.std if self.low is None else self.low
            high = self.mean + 2 * self.std if self.high is None else self.high
            return INITIALIZERS["truncated_normal"], (self.mean, self.std, low, high)
        return INITIALIZERS["constant"], (self.value,)

    @staticmethod
    def from_kernel_params(kind: int, params: Sequence[float]) -> Initializer:
        """The Initializer whose ``kernel_params`` are (kind, params), every default resolved."""
        name = INITIALIZER_NAMES[kind]
        fields = {"constant": ("value",), "uniform": ("low", "high")}.get(name, ("mean", "std", "low", "high"))
        first = {"first_column": int(params[len(fields)])} if len(params) > len(fields) else {}
        return Initializer(name, **dict(zip(fields, params)), **first)


DEFAULT_GROWTH_LOAD_FACTOR = 0.75


@dataclass(kw_only=True)
class DynamicTableOptions:
    """The fields a dynamic table adds to a TorchRec config.

    eviction_policy: which rows go first when the table is full: lru, lfu, epoch_lru,
        epoch_lfu, or none (a full table refuses new ids, which then read as zeros).
    initializer: an ``Initializer`` or its kind name; None means TorchRec's default (uniform).
    admission: which unseen ids get a row (``torchrec_ext.modules.admission``): None (every id,
        or ``"counter"`` when admit_after > 1, as before), ``"counter"``, ``"bloom"`` or
        ``"probabilistic"``. Ids not admitted read as zeros.
    admit_after: ``counter`` / ``bloom``: an id gets a row once it has been seen this many times
        (1: at once; bloom: at most 15).
    admission_capacity: ``counter``: ids waiting for admission are counted in a side table of
        this many ids (default: the capacity) that forgets the rarest first.
    admit_probability: ``probabilistic``: the fraction p in (0, 1] of ids admitted, each id's
        draw a pure function of (seed, table, id).
    bloom_bytes / bloom_fpr / bloom_expected_ids: ``bloom``: the filter's memory budget and/or
        false-positive target for that many distinct ids (default: the capacity); sized from
        the budget, else from the target (default 1%); a budget too small for the target is refused.
    bloom_decay_steps: ``bloom``: every counter is halved every this many training steps (None: never).
    bloom_hashes: ``bloom``: counters per id (None: the fewest reaching the target, or the best for
        the budget); a row-wise shard keeps its table's, so filters fold and tile across world sizes.
    ttl_steps: rows unseen for more than this many training steps are evicted (None: never).
    fallback_rows: K >= 1 shared rows that ids without a row of their own (not admitted, refused
        by a full table, evicted or expired, unseen in eval) read instead of zeros: an id reads
        row ``reference.fallback_slots`` (a hash of the id, independent of the bucket and routing
        hashes) of K. They start at zero and train with the fused optimizer like any row (their own
        optimizer state); checkpoints hold them (``fallback_weight``, ``fallback_optimizer.*``).
        None: no fallback rows (such ids read zeros and learn nothing).
    seed: with the table name, fixes every id's initial vector (and the rounding bits below).
    stochastic_rounding: how the fused update writes FP16 / BF16 rows (``data_type``): rounded
        stochastically (True, as fbgemm does; unbiased, a pure function of seed, table, id,
        element and optimizer step) or to nearest even (False). FP32 tables ignore it.
    backing: where all of the table's rows (vectors and optimizer state) live: ``"device"`` (the
        module's buffer, as before), ``"host"`` (host memory) or ``"file:<dir>"`` (a file in that
        directory, memory-mapped); with host or file backing only ``cache_load_factor`` of the
        rows are kept in the module's buffer (``torchrec_ext.modules.tiered_tables``).
    cache_load_factor: the fraction in (0, 1] of the capacity kept hot with host or file backing
        (None: 0.2, TorchRec's default; sharded, the plan's ``cache_params.load_factor``, which the
        planner chooses from the memory budget: ``torchrec_ext.distributed.planner``).
    cache_algorithm: which cached rows leave first when rows must come in, with host or file
        backing: ``"lru"`` (least recently used; None: this, TorchRec's default) or ``"lfu"``
        (fewest lookups, ties by least recent use; tier_device_maps.py); TorchRec's
        ``CacheAlgorithm.LRU`` / ``.LFU`` are taken too. Sharded, the plan's
        ``cache_params.algorithm`` (``distributed/tier_plan.py``). Which rows sit in the cache
        only: values never change.
    backing_shard: which shard of a sharded table this config is, e.g. ``"rank0-of-2"``: set by the
        sharders on each rank's share (None for a table of its own); the backing files of a
        ``"file:<dir>"`` table start with it, so that ranks sharing a directory never share a file.
    initial_capacity: rows of storage the table starts with (vectors, optimizer state and index
        together), in [1, num_embeddings]; None: num_embeddings (all of it up front). The table
        doubles them when its load (live rows / current capacity) would pass
        ``growth_load_factor``, up to num_embeddings; only then does it evict. Any int works (the
        index's last 32-slot bucket may be partly usable, as for any capacity). Rows move only at a
        growth, between steps; values, scores, optimizer state and admission / TTL state do not
        change (``DynamicTables.grow``). Device backing only.
    growth_load_factor: the load in (0, 1] past which a growing table doubles (default 0.75; near 1,
        a key's two full 32-slot buckets may evict before the table grows). A training batch counts
        its distinct ids as new for this (those admitted, with admission), so a table grows before
        a batch could push it past the factor.
    """

    eviction_policy: str = "lru"
    initializer: Initializer | str | None = None
    admission: str | None = None
    admit_after: int = 1
    admission_capacity: int | None = None
    admit_probability: float | None = None
    bloom_bytes: int | None = None
    bloom_fpr: float | None = None
    bloom_expected_ids: int | None = None
    bloom_decay_steps: int | None = None
    bloom_hashes: int | None = None
    ttl_steps: int | None = None
    fallback_rows: int | None = None
    seed: int = 0
    stochastic_rounding: bool = True
    backing: str = "device"
    cache_load_factor: float | None = None
    cache_algorithm: str | None = None
    backing_shard: str | None = None
    initial_capacity: int | None = None
    growth_load_factor: float = DEFAULT_GROWTH_LOAD_FACTOR

    def _check_dynamic_fields(self) -> None:
        name = type(self).__name__
        if (
            not isinstance(self.eviction_policy, str)
            or self.eviction_policy not in POLICIES
            or self.eviction_policy == "custom"
        ):
            allowed = sorted(set(POLICIES) - {"custom"})
            raise ValueError(f"{name}: eviction_policy must be one of {allowed}, got {self.eviction_policy!r}")
        if isinstance(self.initializer, str):
            self.initializer = Initializer(self.initializer)
        elif self.initializer is not None and not isinstance(self.initializer, Initializer):
            raise TypeError(
                f"{name}: initializer must be an Initializer, a kind name or None, got {self.initializer!r}"
            )
        if not _is_int(self.admit_after) or self.admit_after < 1:
            raise ValueError(f"{name}: admit_after must be an int >= 1, got {self.admit_after!r}")
        if self.admission_capacity is not None and (
            not _is_int(self.admission_capacity) or self.admission_capacity < 1
        ):
            raise ValueError(f"{name}: admission_capacity must be an int >= 1 or None, got {self.admission_capacity!r}")
        if self.ttl_steps is not None and (not _is_int(self.ttl_steps) or self.ttl_steps < 1):
            raise ValueError(f"{name}: ttl_steps must be an int >= 1 or None, got {self.ttl_steps!r}")
        check_fallback_rows(self.fallback_rows, f"{name}: table {getattr(self, 'name', None)!r}")
        if not _is_int(self.seed):
            raise TypeError(f"{name}: seed must be an int, got {self.seed!r}")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"{name}: stochastic_rounding must be a bool, got {self.stochastic_rounding!r}")
        check_admission_options(self, getattr(self, "num_embeddings", 1), name)
        check_backing_options(self, name)
        check_growth_options(
            self, getattr(self, "num_embeddings", None), f"{name}: table {getattr(self, 'name', None)!r}"
        )

    @property
    def admission_strategy(self) -> str | None:
        """The admission in force: ``admission``, or ``"counter"`` when only admit_after > 1 is given."""
        return self.admission if self.admission is not None else ("counter" if self.admit_after > 1 else None)


def check_fallback_rows(value: object, where: str) -> None:
    """Raises unless ``value`` is None or an int >= 1 (a table's ``fallback_rows``)."""
    if value is not None and (not _is_int(value) or value < 1):
        raise ValueError(f"{where} fallback_rows must be an int >= 1 (or None: no fallback rows), got {value!r}")


DEFAULT_CACHE_LOAD_FACTOR = 0.2


def cache_slots(capacity: int, load_factor: float) -> int:
    """Rows a tiered table of ``capacity`` rows caches at ``load_factor``: ceil(load_factor *
    capacity), at least 1 (with a margin for the float product: 0.2 * 1000 is 200 slots, not 201)."""
    return min(capacity, max(1, math.ceil(load_factor * capacity - 1e-9)))


def check_growth_options(opts: DynamicTableOptions, num_embeddings: int | None, where: str) -> None:
    """Checks ``initial_capacity`` (an int in [1, num_embeddings], or None) and
    ``growth_load_factor`` (a number in (0, 1]); growth needs device backing."""
    initial, factor = opts.initial_capacity, opts.growth_load_factor
    if initial is not None:
        if not _is_int(initial) or initial < 1 or (_is_int(num_embeddings) and initial > num_embeddings):
            raise ValueError(
                f"{where} initial_capacity must be an int in [1, num_embeddings={num_embeddings}] "
                f"(None: num_embeddings), got {initial!r}"
            )
        if opts.backing != "device" and _is_int(num_embeddings) and initial < num_embeddings:
            raise ValueError(
                f"{where} initial_capacity < num_embeddings (a growing table) is not supported with "
                f"backing={opts.backing!r} (growth needs device backing), got initial_capacity={initial!r}, "
                f"num_embeddings={num_embeddings}"
            )
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor <= 1:
        raise ValueError(
            f"{where} growth_load_factor must be a number in (0, 1] (the load past which the table "
            f"doubles), got {factor!r}"
        )


def initial_capacity_of(config: BaseEmbeddingConfig) -> int:
    """Rows of storage the table starts with: its ``initial_capacity``, else ``num_embeddings``."""
    initial = options_of(config).initial_capacity
    return config.num_embeddings if initial is None else initial


def check_backing_options(opts: DynamicTableOptions, where: str) -> None:
    """Checks ``backing`` and ``cache_load_factor`` (the directory itself is checked when the
    table is built, on the machine that opens it)."""
    backing = opts.backing
    if not isinstance(backing, str) or not (
        backing in ("device", "host") or (backing.startswith("file:") and len(backing) > len("file:"))
    ):
        raise ValueError(f'{where}: backing must be "device", "host" or "file:<dir>", got {backing!r}')
    if backing != "device" and opts.fallback_rows:
        raise ValueError(
            f'{where}: fallback_rows applies to backing="device" tables for now (a tiered table '
            f"caches its id rows only), got fallback_rows={opts.fallback_rows!r} with backing={backing!r}"
        )
    shard = opts.backing_shard
    if shard is not None and (not isinstance(shard, str) or not re.fullmatch(r"[A-Za-z0-9_-]+", shard)):
        raise ValueError(
            f"{where}: backing_shard must be None or a name of letters, digits, '_' and '-' (it starts "
            f"the backing files' names), got {shard!r}"
        )
    opts.cache_algorithm = check_cache_algorithm(opts.cache_algorithm, where)
    if opts.cache_algorithm is not None and backing == "device":
        raise ValueError(
            f'{where}: cache_algorithm applies to backing="host" or "file:<dir>" (a device-backed '
            f"table has no cache), got cache_algorithm={opts.cache_algorithm!r}"
        )
    factor = opts.cache_load_factor
    if factor is None:
        return
    if backing == "device":
        raise ValueError(
            f'{where}: cache_load_factor applies to backing="host" or "file:<dir>" (a device-backed '
            f"table keeps all its rows in the module's buffer), got cache_load_factor={factor!r}"
        )
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor <= 1:
        raise ValueError(
            f"{where}: cache_load_factor must be a number in (0, 1] (the fraction of rows kept hot), got {factor!r}"
        )


CACHE_ALGORITHMS = ("lru", "lfu")


def check_cache_algorithm(value: object, where: str, what: str = "cache_algorithm") -> str | None:
    """A cache algorithm as "lru" / "lfu" (None stays None: LRU); TorchRec's ``CacheAlgorithm``
    members are taken by name. Raises on anything else."""
    if value is None:
        return None
    name = getattr(value, "name", value)  # (a CacheAlgorithm enum member)
    if isinstance(name, str) and name.lower() in CACHE_ALGORITHMS:
        return name.lower()
    raise ValueError(
        f'{where}: {what} must be "lru" or "lfu" (or TorchRec\'s CacheAlgorithm.LRU / .LFU; None: LRU), got {value!r}'
    )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_finite(value: object, what: str, minimum: float | None = None) -> float:
    """``value`` as a float; raises unless it is a finite real number (a Python or NumPy scalar
    or a one-element floating-point tensor; bools and strings are not numbers), >= ``minimum``
    when one is given."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a finite number, got {value!r}")
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        rule = "a finite number" if minimum is None else f"finite and >= {minimum:g}"
        raise ValueError(f"{what} must be {rule}, got {value!r}")
    return float(value)


def _check_shape_fields(config: BaseEmbeddingConfig, where: str) -> None:
    """num_embeddings, embedding_dim and the uniform bounds: what TorchRec's own config does
    arithmetic on (sqrt(1 / num_embeddings)), so checked before it runs."""
    if not _is_int(config.num_embeddings) or config.num_embeddings < 1:
        raise ValueError(f"{where} num_embeddings (capacity) must be an int >= 1, got {config.num_embeddings!r}")
    if not _is_int(config.embedding_dim) or config.embedding_dim < 1:
        raise ValueError(f"{where} embedding_dim must be an int >= 1, got {config.embedding_dim!r}")
    for name in ("weight_init_min", "weight_init_max"):
        if getattr(config, name) is not None:
            check_finite(getattr(config, name), f"{where} {name}")
    if (
        config.weight_init_min is not None
        and config.weight_init_max is not None
        and config.weight_init_min > config.weight_init_max
    ):
        raise ValueError(
            f"{where} weight_init_min must be <= weight_init_max, got "
            f"{config.weight_init_min} > {config.weight_init_max}"
        )


@dataclass
class DynamicEmbeddingBagConfig(EmbeddingBagConfig, DynamicTableOptions):
    """``EmbeddingBagConfig`` of a dynamic table; ``num_embeddings`` is its capacity in rows."""

    def __post_init__(self) -> None:
        _check_shape_fields(self, type(self).__name__ + ":")
        super().__post_init__()
        self._check_dynamic_fields()


@dataclass
class DynamicEmbeddingConfig(EmbeddingConfig, DynamicTableOptions):
    """``EmbeddingConfig`` of a dynamic table; ``num_embeddings`` is its capacity in rows."""

    def __post_init__(self) -> None:
        _check_shape_fields(self, type(self).__name__ + ":")
        super().__post_init__()
        self._check_dynamic_fields()


def options_of(config: BaseEmbeddingConfig) -> DynamicTableOptions:
    """The dynamic options of any config: a plain TorchRec one gets the defaults."""
    if isinstance(config, DynamicTableOptions):
        return config
    return DynamicTableOptions()


# The data_types a trainable dynamic table stores its vectors in (optimizer state stays float32).
STORAGE_DATA_TYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


def storage_dtype_of(config: BaseEmbeddingConfig) -> torch.dtype:
    """The torch dtype of the table's vectors, from its ``data_type`` (checked by check_tables)."""
    return STORAGE_DATA_TYPES[config.data_type]


def initializer_of(config: BaseEmbeddingConfig) -> tuple[int, tuple[float, ...]]:
    """(kind id, params) of the config's initializer, TorchRec's defaults filling the gaps.

    A DynamicEmbedding*Config's ``initializer`` wins; otherwise the config's ``init_fn`` (TorchRec
    sets a uniform one by default) is read by ``initializer_from_init_fn``.
    """
    init = options_of(config).initializer
    if init is None:
        init = initializer_from_init_fn(config.init_fn, config.name)
    kind, params = init.kernel_params(config.get_weight_init_min(), config.get_weight_init_max())
    try:  # the defaults filled in (a one-sided low / high) must still make sense
        Initializer.from_kernel_params(kind, params)
    except (TypeError, ValueError) as e:
        raise type(e)(f"table {config.name!r}: its initializer resolves to {params}, which is invalid: {e}") from None
    return kind, params


# The torch.nn.init functions an init_fn may be (or be a functools.partial of): our initializer
# kind, and which of the function's arguments fills which Initializer field.
_TORCH_INITS = {
    torch.nn.init.uniform_: ("uniform", {"a": "low", "b": "high"}),
    torch.nn.init.normal_: ("normal", {"mean": "mean", "std": "std"}),
    torch.nn.init.trunc_normal_: ("truncated_normal", {"mean": "mean", "std": "std", "a": "low", "b": "high"}),
    torch.nn.init.constant_: ("constant", {"val": "value"}),
}
_ACCEPTED_INIT_FNS = (
    "torch.nn.init.uniform_, normal_, trunc_normal_ or constant_, or a functools.partial of "
    "one with its arguments (e.g. partial(torch.nn.init.normal_, mean=0.0, std=0.01))"
)


def initializer_from_init_fn(init_fn: object, table: str) -> Initializer:
    """The Initializer drawing what ``init_fn`` draws, with torch's semantics (uniform_ on [a, b],
    trunc_normal_ cut to the absolute bounds [a, b], torch's defaults for arguments left out),
    but per id, a pure function of (seed, table, id). None means TorchRec's default uniform.

    An init_fn acts on a whole tensor, so only these four, whose draw is per element, can be
    replayed id by id; any other callable is refused.
    """
    if init_fn is None:
        return Initializer("uniform")
    partial = isinstance(init_fn, functools.partial)
    func = init_fn.func if partial else init_fn
    args, kwargs = (init_fn.args, init_fn.keywords) if partial else ((), {})
    if func not in _TORCH_INITS:
        raise ValueError(
            f"table {table!r}: init_fn {init_fn!r} cannot initialise rows id by id; an init_fn must be "
            f"{_ACCEPTED_INIT_FNS}. Other initialisations: DynamicEmbeddingBagConfig / "
            "DynamicEmbeddingConfig(initializer=Initializer(...))"
        )
    where = f"table {table!r}: init_fn {init_fn!r}"
    weight = object()  # stands for the tensor, which follows a partial's positional arguments
    try:
        bound = inspect.signature(func).bind(*args, weight, **kwargs)
    except TypeError as e:
        raise TypeError(f"{where} does not fit torch.nn.init.{func.__name__}'s arguments: {e}") from None
    if bound.arguments.get("tensor") is not weight:
        raise TypeError(
            f"{where}: a partial's positional arguments come before the tensor, so torch would take "
            f"{args[0]!r} for the tensor; pass them by keyword"
        )
    bound.apply_defaults()
    if bound.arguments.get("generator") is not None:
        raise ValueError(
            f"{where}: a generator cannot be honoured; each id's vector is drawn from the config's seed, "
            f"the table name and the id, got generator={bound.arguments['generator']!r}"
        )
    kind, fields = _TORCH_INITS[func]
    try:
        return Initializer(kind, **{field: bound.arguments[arg] for arg, field in fields.items()})
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: {e}") from None


def check_tables(tables: object, expected: type, module: str) -> None:
    """Checks what a dynamic module cannot serve, naming the table and the field; gives tables
    without feature_names their own name as feature, as TorchRec's modules do."""
    if not isinstance(tables, (list, tuple)):  # [] is fine: an empty module, as in TorchRec
        raise ValueError(f"{module}: tables must be a list of {expected.__name__}, got {tables!r}")
    names = set()
    for config in tables:
        _check_table(config, expected, module)
        if config.name in names:
            raise ValueError(f"Duplicate table name {config.name}")
        names.add(config.name)
        if not config.feature_names:
            config.feature_names = [config.name]


def _check_table(config: object, expected: type, module: str) -> None:
    if not isinstance(config, expected):
        raise TypeError(f"{module}: tables must be {expected.__name__}s, got {type(config).__name__}")
    if not config.name:
        raise ValueError(f"{module}: every table needs a name, got {config!r}")
    _check_shape_fields(config, f"{module}: table {config.name!r}")
    # Checked again here: a config's fields may have been changed since it was built.
    check_fallback_rows(options_of(config).fallback_rows, f"{module}: table {config.name!r}")
    check_growth_options(options_of(config), config.num_embeddings, f"{module}: table {config.name!r}")
    if config.data_type not in STORAGE_DATA_TYPES:
        # a str such as "FP16" is the likely slip: say it is not the enum
        got = config.data_type if isinstance(config.data_type, DataType) else f"{config.data_type!r}, not a DataType"
        raise ValueError(
            f"{module}: table {config.name!r} data_type must be one of "
            f"{[d.name for d in STORAGE_DATA_TYPES]} (torchrec.DataType; a trainable dynamic table stores its "
            f"vectors in float32, float16 or bfloat16), got {got}"
        )
    if config.embedding_dim == 1 and STORAGE_DATA_TYPES[config.data_type] != torch.float32:
        # The kernels read a table's rows from its span of 4-byte words: a 2-byte row could not be
        # told from the padding after an odd number of rows.
        raise ValueError(
            f"{module}: table {config.name!r} data_type {config.data_type.name} needs embedding_dim "
            ">= 2 (a one-element half-precision row is smaller than the word padding), got "
            "embedding_dim 1: use DataType.FP32 for dim-1 tables"
        )
