"""Checks a KeyedJaggedTensor against a module's tables and lays its ids out in lookup order.

Lookup order is the output order of TorchRec's EmbeddingBagCollection: tables in order, each
table's features in order (a feature read by several tables appears once per table). A
table's ids are thus contiguous, which is what the per-table dedup and the kernels take.

As in TorchRec, one KJT may feed several modules: keys no table reads are ignored, and so are
the weights of an unweighted module (EmbeddingCollection never reads weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext import device_sync

_ID_DTYPES = (torch.int64, torch.int32)


@dataclass
class LookupPlan:
    """Where each lookup feature's ids go and where its output lands (built once per module)."""

    features: list[str]  # feature name of each lookup feature
    tables: list[int]  # table index of each lookup feature
    embedding_names: list[str]  # output key of each lookup feature
    dims: list[int]  # output width of each lookup feature
    mean: list[bool]  # mean pooling per lookup feature
    num_tables: int

    def __post_init__(self) -> None:
        self.total_dim = sum(self.dims)
        self.cols = [sum(self.dims[:i]) for i in range(len(self.dims))]
        self._tensors: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    @staticmethod
    def of(configs: Sequence[BaseEmbeddingConfig]) -> LookupPlan:
        names = [n for table in get_embedding_names_by_table(configs) for n in table]
        feats, tables, dims, mean = [], [], [], []
        for t, cfg in enumerate(configs):
            for feature in cfg.feature_names:
                feats.append(feature)
                tables.append(t)
                dims.append(cfg.embedding_dim)
                mean.append(getattr(cfg, "pooling", PoolingType.SUM) == PoolingType.MEAN)
        return LookupPlan(feats, tables, names, dims, mean, len(configs))

    def tensors(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(feature_table, feature_col, feature_mean) on ``device``, as the kernels take them."""
        if device not in self._tensors:
            self._tensors[device] = (
                device_sync.to_device(torch.tensor(self.tables, dtype=torch.int64, device="cpu"), device),
                device_sync.to_device(torch.tensor(self.cols, dtype=torch.int64, device="cpu"), device),
                device_sync.to_device(torch.tensor(self.mean, dtype=torch.bool, device="cpu"), device),
            )
        return self._tensors[device]


@dataclass
class LookupInput:
    """One batch's ids in lookup order."""

    ids: Tensor  # int64, all lookup features' ids
    lengths: Tensor  # int64, [num_lookup_features * batch_size]
    weights: Tensor | None  # float32 per-sample weights, or None
    segment_offsets: Tensor  # where each table's ids start, [num_tables + 1]
    feature_value_offsets: Tensor  # where each lookup feature's ids start, [num_features + 1]
    batch_size: int
    value_counts: list[int] = field(default_factory=list)  # ids per lookup feature (host side)
    # A KJT with a variable batch size per feature, looked up at its own strides (each feature's
    # bags padded with empty ones to the largest): feature_bags[i] bags of lookup feature i are
    # real, and row b of its pooled output is pooled row expand[i, b].
    expand: Tensor | None = None
    feature_bags: list[int] | None = None


def check_and_arrange(
    features: object,
    plan: LookupPlan,
    is_weighted: bool,
    where: str,
    device: torch.device | None = None,
    variable_batch: str | None = None,
) -> LookupInput:
    """Validates ``features`` (raising before any table is touched) and arranges its ids.

    device: where the tables are; the KJT must be there too (not checked for meta tables,
    which compute shapes only). Meta ids (shape inference) are not checked by value.
    variable_batch: what a KJT with a variable batch size per feature (TorchRec's VBE:
    ``stride_per_key_per_rank`` and ``inverse_indices``) becomes: None refuses it; "pool" pools
    each feature's bags as given and says how to expand the pooled rows (``LookupInput.expand``,
    as TorchRec's EmbeddingBagCollection expands them); "expand" repeats each feature's bags
    into the full batch first (for routing, which needs one batch size).
    """
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"{where}: features must be a KeyedJaggedTensor, got {type(features).__name__}")
    keys = features.keys()
    if len(set(keys)) != len(keys):
        # Only one occurrence's ids could be looked up: the others would be dropped silently.
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"{where}: KJT keys must be distinct, got {repeated} more than once in keys {list(keys)}")
    missing = sorted(set(plan.features) - set(keys))
    if missing:
        raise ValueError(f"{where}: KJT lacks the features {missing} that the tables read")
    variable = features.variable_stride_per_key()
    if variable and variable_batch is None:
        raise ValueError(f"{where}: KJTs with a variable batch size per feature are not supported")
    values = features.values()
    if values.dtype not in _ID_DTYPES:
        raise TypeError(f"{where}: ids (KJT values) must be int64 or int32, got {values.dtype}")
    if values.dim() != 1:
        raise ValueError(f"{where}: ids (KJT values) must be 1-D, got shape {tuple(values.shape)}")
    lengths = features.lengths()
    _check_devices(
        where, device, values=values, lengths=lengths, weights=features.weights_or_none() if is_weighted else None
    )
    if lengths.dtype not in _ID_DTYPES or lengths.is_floating_point():
        raise TypeError(f"{where}: KJT lengths must be integers, got {lengths.dtype}")
    if variable:
        strides, inverse = _variable_batch(features, where)
        if lengths.numel() != sum(strides):
            raise ValueError(
                f"{where}: KJT lengths must have one entry per bag, sum(stride_per_key) = "
                f"{sum(strides)}, got {lengths.numel()}"
            )
    else:
        batch_size = features.stride()
        if lengths.numel() != len(keys) * batch_size:
            raise ValueError(
                f"{where}: KJT lengths must have num_keys * batch_size = {len(keys) * batch_size} "
                f"entries, got {lengths.numel()}"
            )
    weights = features.weights_or_none() if is_weighted else None  # an unweighted module reads none
    per_key = nonfinite = None
    if torch.compiler.is_compiling():
        # torch.export / compile: values are symbolic, so these checks become the program's runtime asserts.
        # (The messages take `where` as a default, not a closure: torch 2.11's dynamo refuses a
        # torch._check message that closes over a variable, a graph break.)
        if lengths.numel():
            torch._check(lengths.min().item() >= 0, lambda where=where: f"{where}: KJT lengths must be >= 0")
            torch._check(
                lengths.sum().item() == values.numel(),
                lambda where=where: f"{where}: KJT lengths must sum to the ids' count",
            )
    elif not values.is_meta:
        read = None if variable or weights is None else [k in set(plan.features) for k in keys]
        known = None if variable else features.length_per_key_or_none()
        if known is not None and len(known) == len(keys):
            # The KJT knows its ids per key on the host (built with them, or computed before its
            # copy to the device): no read of the lengths; checked on the device, raised later.
            per_key = [int(n) for n in known]
            if sum(per_key) != values.numel():
                raise ValueError(
                    f"{where}: KJT length_per_key must sum to the ids' count {values.numel()}, got {sum(per_key)}"
                )
            nonfinite = _defer_length_checks(where, keys, values, lengths, batch_size, per_key, weights, read)
        else:
            bag_starts = [0]
            for s in strides if variable else [batch_size] * len(keys):
                bag_starts.append(bag_starts[-1] + s)
            per_key, smallest, total, nonfinite = _read_lengths(values, lengths, bag_starts, weights, read)
            if smallest < 0:
                raise ValueError(f"{where}: KJT lengths must be >= 0, got a length of {smallest}")
            if total != values.numel():
                raise ValueError(f"{where}: KJT lengths sum to {total} but there are {values.numel()} ids")
    if is_weighted:
        if weights is None:
            raise ValueError(f"{where}: the module is weighted (is_weighted=True) but the KJT has no weights")
        if not weights.is_floating_point():
            raise TypeError(f"{where}: KJT weights must be floats, got {weights.dtype}")
        if weights.shape != values.shape:
            raise ValueError(
                f"{where}: KJT weights must be one per id, shape {tuple(values.shape)}, got {tuple(weights.shape)}"
            )

    lengths = lengths.to(torch.int64)
    if per_key is None:  # symbolic or meta ids: TorchRec's own (cached on the KJT)
        per_key = features.length_per_key()
    key_start = dict(zip(keys, _starts(per_key)))
    key_index = {k: i for i, k in enumerate(keys)}
    value_counts = [per_key[key_index[f]] for f in plan.features]
    expand = feature_bags = None
    if variable:
        feature_bags = [strides[key_index[f]] for f in plan.features]
        ids, arranged_lengths, arranged_weights, value_counts, batch_size, expand = _arrange_variable_batch(
            values,
            lengths,
            weights,
            plan,
            key_index,
            key_start,
            value_counts,
            strides,
            inverse,
            variable_batch == "expand",
        )
    elif list(keys) == plan.features:
        ids, arranged_lengths, arranged_weights = values, lengths, weights
    else:  # the read features' ids in lookup order; other keys' ids are left out
        order = device_sync.to_device(
            torch.tensor([key_index[f] for f in plan.features], dtype=torch.int64, device="cpu"), lengths.device
        )
        spans = [(key_start[f], n) for f, n in zip(plan.features, value_counts)]
        ids = _gather_spans(values, spans)
        arranged_lengths = lengths.view(len(keys), batch_size).index_select(0, order).reshape(-1)
        arranged_weights = None if weights is None else _gather_spans(weights, spans)
    if arranged_weights is not None:
        # Only the weights that are read must be finite, as TorchRec reads no others (counted
        # with the lengths above; a variable batch reads its arranged weights here).
        if nonfinite is None and not arranged_weights.is_meta and not torch.compiler.is_compiling():
            nonfinite = int(
                device_sync.to_host(
                    (~torch.isfinite(arranged_weights)).sum(), "check_and_arrange: variable-batch weights"
                )
            )
        if nonfinite:
            raise ValueError(f"{where}: KJT weights must be finite, got NaN or inf")
        arranged_weights = arranged_weights.float()
    table_counts = [0] * plan.num_tables
    for t, n in zip(plan.tables, value_counts):
        table_counts[t] += n
    # Both offsets summed on the host and made one tensor (no op per offset); one copy for both;
    # mirrored: the kernels read their host values (the longest feature) without a sync.
    tables_end = plan.num_tables + 1
    host = torch.tensor(_starts(table_counts + [0]) + _starts(value_counts + [0]), dtype=torch.int64, device="cpu")
    both = device_sync.to_device(host, values.device)
    return LookupInput(
        ids.to(torch.int64),
        arranged_lengths,
        arranged_weights,
        device_sync.mirror(both[:tables_end], host[:tables_end]),
        device_sync.mirror(both[tables_end:], host[tables_end:]),
        batch_size,
        value_counts,
        expand,
        feature_bags,
    )


def _read_lengths(
    values: Tensor, lengths: Tensor, bag_starts: list[int], weights: Tensor | None, read: list[bool] | None
) -> tuple[list[int], int, int, int | None]:
    """One host read (``device_sync``) for everything the checks and the arrangement need: each
    key's id count, the smallest length, the lengths' sum and, when ``read`` (which keys a table
    reads) is given and the weights are one float per id, how many weights of read keys are not
    finite (else None)."""
    device = lengths.device
    ends = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths.to(torch.int64), 0, out=ends[1:])
    key_ends = ends.index_select(
        0, device_sync.to_device(torch.tensor(bag_starts, dtype=torch.int64, device="cpu"), device)
    )
    smallest = lengths.min().to(torch.int64).view(1) if lengths.numel() else ends[:1]
    parts = [key_ends, smallest]
    counted = (
        read is not None
        and len(read) > 0
        and weights is not None
        and weights.is_floating_point()
        and weights.shape == values.shape
    )
    if counted:
        # Each id's key: the first key whose end passes its position.
        key_of = torch.searchsorted(key_ends[1:], torch.arange(values.numel(), device=device), right=True)
        is_read = device_sync.to_device(torch.tensor(read, dtype=torch.bool, device="cpu"), device).index_select(
            0, key_of.clamp(max=len(read) - 1)
        )
        parts.append(((~torch.isfinite(weights)) & is_read).sum().view(1))
    host = device_sync.host_list(torch.cat(parts), "check_and_arrange: lengths and weights")
    keys = len(bag_starts) - 1
    per_key = [host[k + 1] - host[k] for k in range(keys)]
    return per_key, host[keys + 1], host[keys], host[keys + 2] if counted else None


def _defer_length_checks(
    where: str,
    keys: list[str],
    values: Tensor,
    lengths: Tensor,
    batch_size: int,
    per_key: list[int],
    weights: Tensor | None,
    read: list[bool] | None,
) -> int | None:
    """The checks of ``_read_lengths`` when the ids per key are known on the host: lengths >= 0,
    each key's lengths summing to its known count and the read keys' weights finite, computed on
    the device and raised at the next host read (``device_sync.defer_check``: on a GPU the
    lookup's count of unique ids, before any table is touched). Returns 0 when the weights are
    checked here, else None (the caller checks them)."""
    device = lengths.device
    # Each key's sum goes to the host whole (a few ints, in the one deferred copy): compared with
    # length_per_key there, not by ops on the device (kernels on a GPU).
    sums = lengths.to(torch.int64).view(len(keys), batch_size).sum(1)
    smallest = lengths.min().to(torch.int64).view(1) if lengths.numel() else sums.new_zeros(1)
    parts = [smallest, sums]
    counted = read is not None and weights is not None and weights.is_floating_point() and weights.shape == values.shape
    if counted:
        is_read = torch.repeat_interleave(
            device_sync.to_device(torch.tensor(read, dtype=torch.bool, device="cpu"), device),
            device_sync.to_device(torch.tensor(per_key, dtype=torch.int64, device="cpu"), device),
            output_size=values.numel(),
        )
        parts.append(((~torch.isfinite(weights)) & is_read).sum().view(1))

    def verdict(host: list) -> Exception | None:
        low, totals = host[0], host[1 : 1 + len(keys)]
        if low < 0:
            return ValueError(f"{where}: KJT lengths must be >= 0, got a length of {low}")
        for key, (total, known) in enumerate(zip(totals, per_key)):
            if total != known:
                return ValueError(
                    f"{where}: KJT lengths of key {keys[key]!r} must sum to its length_per_key entry "
                    f"{known}, got {total}"
                )
        if counted and host[-1]:
            return ValueError(f"{where}: KJT weights must be finite, got NaN or inf")
        return None

    def fails(values: Tensor) -> Tensor:  # the verdict's tests, on the device (for the sharded input dist)
        known = device_sync.to_device(torch.tensor(per_key, dtype=torch.int64, device="cpu"), values.device)
        failed = (values[0] < 0) | (values[1 : 1 + len(keys)] != known).any()
        return failed | (values[-1] != 0) if counted else failed

    device_sync.defer_check(torch.cat(parts), verdict, fails)
    return 0 if counted else None


def _starts(counts: list[int]) -> list[int]:
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def _variable_batch(features: KeyedJaggedTensor, where: str) -> tuple[list[int], Tensor]:
    """(bags of each key, inverse indices [num_keys, batch]) of a KJT with a variable batch size
    per feature, checked: row b of key k's output is its bag inverse[k, b]."""
    strides = [int(s) for s in features.stride_per_key()]
    found = features.inverse_indices_or_none()
    if found is None:
        raise ValueError(
            f"{where}: a KJT with a variable batch size per feature needs inverse_indices (which "
            "of its bags each sample reads), got none"
        )
    inverse_keys, inverse = found
    if list(inverse_keys) != list(features.keys()):
        raise ValueError(
            f"{where}: KJT inverse_indices must name the KJT's keys {list(features.keys())} in order, "
            f"got {list(inverse_keys)}"
        )
    if inverse.dim() != 2 or inverse.shape[0] != len(strides) or inverse.is_floating_point():
        raise ValueError(
            f"{where}: KJT inverse_indices must be an integer tensor [num_keys = {len(strides)}, "
            f"batch_size], got {inverse.dtype} of shape {tuple(inverse.shape)}"
        )
    if inverse.numel() and not inverse.is_meta:
        limit = device_sync.to_device(torch.tensor(strides, device="cpu"), inverse.device).unsqueeze(1)
        outside = ((inverse < 0) | (inverse >= limit)).any(1)  # per key
        if device_sync.to_host(outside.any(), "check_and_arrange: variable-batch inverse indices"):
            bad = int(device_sync.to_host(outside.int().argmax(), "check_and_arrange: error message"))
            low, high = device_sync.host_list(
                torch.stack([inverse[bad].min(), inverse[bad].max()]), "check_and_arrange: error message"
            )
            raise ValueError(
                f"{where}: KJT inverse_indices of key {features.keys()[bad]!r} must lie in "
                f"[0, {strides[bad]}) (its bags), got values in [{low}, {high}]"
            )
    return strides, inverse.to(torch.int64)


def _arrange_variable_batch(
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    plan: LookupPlan,
    key_index: dict[str, int],
    key_start: dict[str, int],
    value_counts: list[int],
    strides: list[int],
    inverse: Tensor,
    expand_bags: bool,
):
    """The read features' ids in lookup order, each feature's bags either repeated into the full
    batch (``expand_bags``) or as given, padded with empty bags to the largest stride (the pooled
    rows then expand as ``expand`` says). Returns (ids, lengths, weights, value_counts,
    batch_size, expand)."""
    bag_start = [0]
    for s in strides:
        bag_start.append(bag_start[-1] + s)
    batch = inverse.shape[1]
    width = max((strides[key_index[f]] for f in plan.features), default=0)
    ids, lens, wts, counts = [], [], [], []
    for f, n in zip(plan.features, value_counts):
        k = key_index[f]
        bags = lengths[bag_start[k] : bag_start[k] + strides[k]]
        v = values[key_start[f] : key_start[f] + n]
        w = None if weights is None else weights[key_start[f] : key_start[f] + n]
        if expand_bags:
            picked = bags.index_select(0, inverse[k])
            first = (torch.cumsum(bags, 0) - bags).index_select(0, inverse[k])  # where each picked bag starts
            out_start = torch.cumsum(picked, 0) - picked
            total = (
                int(device_sync.to_host(picked.sum(), "check_and_arrange: variable-batch expansion"))
                if picked.numel()
                else 0
            )
            at = torch.repeat_interleave(first - out_start, picked, output_size=total) + torch.arange(
                total, device=values.device
            )
            v, w, bags = v.index_select(0, at), None if w is None else w.index_select(0, at), picked
        else:
            bags = torch.cat([bags, bags.new_zeros(width - strides[k])])
        ids.append(v)
        lens.append(bags)
        wts.append(w)
        counts.append(v.numel())
    expand = None if expand_bags else inverse[[key_index[f] for f in plan.features]]
    return (
        _cat(ids, values),
        _cat(lens, lengths),
        None if weights is None else _cat(wts, weights),
        counts,
        batch if expand_bags else width,
        expand,
    )


def _cat(parts: list[Tensor], like: Tensor) -> Tensor:
    return torch.cat(parts) if parts else like[:0]


def expand_pooled(pooled: Tensor, expand: Tensor, plan: LookupPlan) -> Tensor:
    """[batch, total_dim] from rows pooled at each feature's own batch size: lookup feature i's
    columns of row b are its pooled row expand[i, b] (TorchRec's VBE expansion)."""
    return (
        torch.cat(
            [pooled[:, c : c + d].index_select(0, expand[i]) for i, (c, d) in enumerate(zip(plan.cols, plan.dims))],
            dim=1,
        )
        if plan.dims
        else pooled.new_zeros(expand.shape[1], 0)
    )


def _gather_spans(t: Tensor, spans: Sequence[tuple[int, int]]) -> Tensor:
    """The (start, length) slices of ``t``, concatenated (empty when there are none)."""
    return torch.cat([t[start : start + n] for start, n in spans]) if spans else t[:0]


def _check_devices(
    where: str, device: torch.device | None, values: Tensor, lengths: Tensor, weights: Tensor | None
) -> None:
    """Ids, lengths and weights on the tables' device (without one: on the ids' device)."""
    meta_tables = device is not None and device.type == "meta"
    if device is not None and not meta_tables:
        expected, holder = device, "the tables are"
    elif values.device.type == "meta" and not meta_tables:
        raise ValueError(f"{where}: KJT values are on the meta device; ids must hold data to be looked up")
    else:
        expected, holder = values.device, "its values are"
    for name, t in (("values", values), ("lengths", lengths), ("weights", weights)):
        if t is not None and not _same_device(t.device, expected):
            raise ValueError(f"{where}: KJT {name} are on {t.device}, {holder} on {expected}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)
