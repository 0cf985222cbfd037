"""What DynamicEmbeddingBagCollection and DynamicEmbeddingCollection share: the per-table
submodules and their checkpoint format, device moves, optimizer resolution, and the autograd
functions whose backward is the fused optimizer update.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.optim.keyed import KeyedOptimizer

from torchrec_ext import ops
from torchrec_ext.modules.deltas import DeltaMixin
from torchrec_ext.modules.dynamic_tables import DynamicTables, RowLookup
from torchrec_ext.modules.features import LookupInput, LookupPlan, check_and_arrange
from torchrec_ext.modules.fused_optimizer import (
    DEFAULT_OPTIMIZER,
    DynamicEmbeddingFusedOptimizer,
    OptimizerSpec,
    resolve_optimizer,
    spec_from_parameter,
)
from torchrec_ext.modules.table_stats import TableStats
from torchrec_ext.modules.tiered_tables import TieredTables, tables_for

_REQUIRED_STATE = ("weight", "weight_id", "metadata", "counters")


class DynamicTable(nn.Module):
    """One dynamic table (``embedding_bags.<name>`` / ``embeddings.<name>``).

    ``weight`` is a [capacity, dim] view of the collection's storage. Its gradient is never
    materialised: the fused optimizer updates the touched rows during backward. On CPU the rows
    of a training batch's new ids are written by that backward too (or by the next lookup or
    ``state_dict``), so read ``weight`` directly only after the backward. The table's
    ``state_dict`` holds only its live rows: ``weight`` [n, dim], ``weight_id`` (raw ids),
    ``metadata`` (eviction scores), ``row`` (placement), ``optimizer.<state>``, ``counters``
    (index clock, epoch, training step, optimizer step, and the ``LAYOUT_VERSION`` the rows
    follow; a state saved before it has the first four: layout 1, whose rows are re-placed, saying
    so, where they do not fit), plus ``last_seen`` with ttl_steps,
    ``admission_id`` / ``admission_count`` with the counter admission and ``admission_bloom``
    (one packed filter per row) with the Bloom filter.
    """

    def __init__(self, tables: DynamicTables, index: int):
        super().__init__()
        self._tables = tables
        self._index = index
        self._loaded_by_container = False
        self.weight = nn.Parameter(tables.table_view(index))
        tables.register_parameter_owner(self)  # ``weight`` follows the storage when a growth replaces it

    def extra_repr(self) -> str:
        m = self._tables.meta[self._index]
        fallback = f", fallback_rows={m.fallback_rows}" if m.fallback_rows else ""
        grows = f", max_capacity={m.max_capacity}" if m.max_capacity != m.capacity else ""
        return f"capacity={m.capacity}{grows}, dim={m.dim}, policy={m.policy!r}, dtype={m.dtype}{fallback}"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for key, value in self._tables.table_state(self._index).items():
            destination[prefix + key] = value

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if self._loaded_by_container:  # its container loaded every table at once, this one included
            self._loaded_by_container = False
            return
        load_tables(self._tables, {self._index: prefix}, state_dict, None, missing_keys, unexpected_keys, error_msgs)


class DynamicTableDict(nn.ModuleDict):
    """The per-table submodules of a collection (``embedding_bags`` / ``embeddings``). It loads
    a state_dict into all of its tables at once, so a bad table state changes no table."""

    def __init__(self, tables: DynamicTables, modules: dict[str, DynamicTable]):
        super().__init__(modules)
        self._tables = tables
        self.strict: bool | None = None  # the load_state_dict in progress's, when known

    @contextmanager
    def loading(self, strict: bool):
        """For the duration of a load_state_dict(strict=...) that reaches this container."""
        self.strict = strict
        try:
            yield
        finally:
            self.strict = None

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        unknown_before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )  # reports keys of tables this module does not have
        # (a sharded module's container also holds placeholders of other ranks' tables: skipped)
        mine = {name: table for name, table in self.items() if isinstance(table, DynamicTable)}
        tables = {table._index: f"{prefix}{name}." for name, table in mine.items()}
        load_tables(
            self._tables,
            tables,
            state_dict,
            self.strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
            unknown=len(unexpected_keys) > unknown_before,
        )
        for table in mine.values():
            table._loaded_by_container = True


def load_tables(
    tables: DynamicTables,
    prefixes: dict[int, str],
    state_dict: Mapping[str, Any],
    strict: bool | None,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
    unknown: bool = False,
) -> None:
    """Loads tables (index -> state_dict prefix) from ``state_dict``: all or none.

    Missing and unexpected keys are reported. A module without a fused optimizer ignores the
    checkpoint's ``optimizer.*`` keys (a training checkpoint loads for eval or serving). With
    strict=True (or unknown: nested in another module's load_state_dict, whose strictness a
    submodule cannot see) any missing or unexpected key, or ``unknown`` tables, load nothing (a
    strict load then raises, listing them; an unknown-strictness load raises too, saying why, so a
    nested strict=False load never leaves the tables silently unloaded). With strict=False the
    tables whose weight, weight_id, metadata and counters are all there load (other missing state
    starts at its initial values), the others stay as they were. Bad values raise TypeError /
    ValueError before any table changes.
    """
    states, problems = {}, unknown
    for t, prefix in prefixes.items():
        expected = tables.state_keys(t)
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        ignored = (
            []
            if tables.optimizer is not None
            else [k for k in mine if k.startswith(("optimizer.", "fallback_optimizer."))]
        )
        missing = [k for k in expected if k not in mine and k != "row"]
        unexpected = [k for k in mine if k not in expected and k not in ignored]
        missing_keys.extend(prefix + k for k in missing)
        unexpected_keys.extend(prefix + k for k in unexpected)
        problems = problems or bool(missing or unexpected)
        if not any(k in missing for k in _REQUIRED_STATE):
            states[t] = {k: v for k, v in mine.items() if k in expected}
    if problems and strict is not False:
        if strict is None:
            error_msgs.append(
                f"tables {sorted(prefixes.values())} not loaded: their keys are incomplete or unexpected (see "
                "the missing / unexpected keys), and a dynamic collection nested in another module cannot see "
                "the load's strictness, so it loads none of them; call load_state_dict(..., strict=False) on "
                "the collection itself to load the complete tables, or pass the complete state"
            )
        return
    tables.load_states(states, where="load_state_dict")


class DynamicCollectionMixin(DeltaMixin):
    """Storage, optimizer and device handling shared by the two dynamic collections.

    The host class is an ``nn.Module`` that calls ``_init_dynamic`` in its constructor.
    """

    _tables: DynamicTables
    _plan: LookupPlan

    def _init_dynamic(
        self,
        configs: Sequence[BaseEmbeddingConfig],
        device: torch.device | None,
        container: str,
        optimizer: Any,
        optimizer_kwargs: Mapping[str, Any] | None,
    ) -> None:
        where = type(self).__name__
        # Without a device, torch's default one, as TorchRec's modules (so ``with torch.device("meta"):``
        # builds a meta module).
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        self._tables = tables_for(configs, self._device)  # tiered when a table has host or file backing
        self._container = container
        setattr(
            self,
            container,
            DynamicTableDict(self._tables, {cfg.name: DynamicTable(self._tables, t) for t, cfg in enumerate(configs)}),
        )
        self._plan = LookupPlan.of(configs)
        self._optimizer_spec: OptimizerSpec | None = (
            None if optimizer is None else resolve_optimizer(optimizer, optimizer_kwargs, where)
        )
        if optimizer is None and optimizer_kwargs:
            raise ValueError(f"{where}: optimizer_kwargs given without an optimizer")
        self._fused: DynamicEmbeddingFusedOptimizer | None = None
        self._warned_default = False
        self._fused_is_default = False  # the tables train with DEFAULT_OPTIMIZER, none was chosen
        if self._optimizer_spec is not None:
            self._ensure_optimizer()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # deepcopy clones each Parameter on its own (nn.Parameter.__deepcopy__), dropping its
        # attributes: re-point the copy's table parameters at the copy's storage, and give
        # them back the fused optimizer's markers (the copied optimizer already holds them).
        super().__setstate__(state)
        for table in self._table_modules():
            self._tables.register_parameter_owner(table)
        self._bind_parameters()
        if self._fused is not None:
            chosen = not self._fused_is_default
            for table in self._table_modules():
                param = table.weight
                if chosen and not getattr(param, "_optimizer_classes", None):
                    param._optimizer_classes = [self._fused.spec.torch_class()]
                    param._optimizer_kwargs = [self._fused.spec.torch_kwargs()]
                param._in_backward_optimizers = [self._fused]

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling: say what works instead.
        raise TypeError(
            f"{type(self).__name__} cannot be compiled by torch.jit.script: its ids -> rows lookup is a "
            "Python hash-table index. For inference graphs use torch.export.export(model, args, strict=False) "
            "(eval mode), or torch.fx.symbolic_trace / torchrec.fx.symbolic_trace, which keep this module "
            "as one call"
        )

    # ------------------------------------------------------------------ tables

    def _table_modules(self) -> list[DynamicTable]:
        return list(getattr(self, self._container).values())

    def _bind_parameters(self) -> None:
        for t, table in enumerate(self._table_modules()):
            view, old = self._tables.table_view(t), table.weight
            if old.device == view.device and old.dtype == view.dtype:
                old.data = view
            else:  # set_data cannot change device or dtype: a new Parameter keeping the old's markers
                table.weight = nn.Parameter(view, requires_grad=old.requires_grad)
                table.weight.__dict__.update(old.__dict__)

    def _apply(self, fn, recurse: bool = True):
        # Storage moves as a whole and the table parameters are re-pointed at it, so they stay
        # views of one buffer whatever .to() / .cuda() / to_empty() did.
        self._tables.apply(fn)
        self._device = self._tables.device
        self._bind_parameters()
        self._rebuild_fused_optimizer()
        return self

    def reset_parameters(self) -> None:
        """Forgets every id (rows are initialised when ids arrive); a no-op on the meta device."""
        if self._tables.device.type == "meta":
            return
        self._tables.reset()
        self._rebuild_fused_optimizer()

    @property
    def device(self) -> torch.device:
        return self._device

    def num_live_rows(self) -> int:
        """Ids that hold a row now, over all tables."""
        return self._tables.num_live_rows()

    def storage_bytes(self, maximum: bool = False) -> int:
        """Bytes of vectors, optimizer state and index metadata, over all tables, as allocated now;
        ``maximum``: once every growing table (``initial_capacity``) reached num_embeddings."""
        return self._tables.storage_bytes(maximum=maximum)

    def table_stats(self) -> dict[str, TableStats]:
        """Per table (by name): live rows, capacity, load factor, inserts, evictions, TTL expiries,
        admission rejections, refused ids, lookup hit rate and ages of evicted rows, counted as the
        training lookups ran (``torchrec_ext.modules.table_stats.TableStats``). Cheap: one read of
        a small counter tensor and each table's size."""
        return self._tables.table_stats()

    def stage_next(self, features: Any) -> bool:
        """Tables with host or file backing: stages the rows of ``features`` (a KJT of the next
        batch) into the cache while the current batch computes, on a worker thread started once
        this module's next lookup (the current batch's) has its rows; that batch's update may
        still be running, the next lookup finds its rows cached (``TieredTables.stage_next``;
        results are unchanged). False, doing nothing, for all-resident tables. ``TrainPipeline``
        calls it for the batch after the one it runs. ``features`` may be a call that gives the KJT
        (or None: stage nothing) on the stage's worker thread, when it is not known yet (a sharded
        module's share of the next batch, in flight in its input dist)."""
        if not isinstance(self._tables, TieredTables) or self.device.type == "meta":
            return False

        def arrange(kjt):
            return check_and_arrange(
                kjt,
                self._plan,
                getattr(self, "_is_weighted", False),
                type(self).__name__,
                self.device,
                variable_batch="pool",
            )

        if callable(features):  # known later, on the stage's worker thread

            def resolve():
                kjt = features()
                batch = None if kjt is None else arrange(kjt)
                return None if batch is None else (batch.ids, batch.segment_offsets)

            self._tables.stage_next_when_known(resolve)
            return True
        batch = arrange(features)
        self._tables.stage_next(batch.ids, batch.segment_offsets)
        return True

    def tier_step_stats(self) -> dict[str, dict[str, int]]:
        """Tables with host or file backing, per table: the tier's traffic of the last lookup and
        of the stage before it: ``hits`` / ``misses`` (rows found in the cache / read from the
        backing store at step time), ``staged`` (rows the stage read ahead), ``write_backs``
        (``staged_write_backs`` of them by the stage, off the step), ``bytes_moved``. Empty for
        all-resident tables."""
        return dict(getattr(self._tables, "last_step_stats", {}))

    # ------------------------------------------------------------------ checkpoint

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        # The tables' container sees this call's strictness (a submodule's hook is not told it).
        with getattr(self, self._container).loading(strict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        # Runs before the tables load. A fresh module given its optimizer by
        # apply_optimizer_in_backward allocates the optimizer state only when first needed:
        # now, so that the checkpoint's optimizer.<state> has rows to go to. A module training
        # with the default (which holds no per-row state) loads as one without an optimizer.
        if self._fused is not None and self._fused_is_default:
            self._fused = None
            self._tables.optimizer = None  # the default (SGD) allocated no state to free
        self._ensure_optimizer()
        super()._load_from_state_dict(*args, **kwargs)

    # ------------------------------------------------------------------ optimizer

    def _table_params(self) -> dict[str, Tensor]:
        return {
            f"{self._container}.{m.name}.weight": table.weight
            for m, table in zip(self._tables.meta, self._table_modules())
        }

    def _chosen_spec(self) -> OptimizerSpec | None:
        """The optimizer chosen for the tables: apply_optimizer_in_backward's when set, else the
        constructor's (or fuse_embedding_optimizer's); None when none was chosen."""
        where = type(self).__name__
        specs = {name: spec_from_parameter(p, where) for name, p in self._table_params().items()}
        chosen = {s for s in specs.values() if s is not None}
        if len(chosen) > 1:
            raise ValueError(
                f"{where}: all tables of one module must use the same fused optimizer, got "
                + ", ".join(f"{n}: {s}" for n, s in specs.items())
            )
        if chosen and any(s is None for s in specs.values()):
            raise ValueError(
                f"{where}: apply_optimizer_in_backward was applied to only some tables' parameters: "
                f"{sorted(n for n, s in specs.items() if s is None)} have none"
            )
        return next(iter(chosen)) if chosen else self._optimizer_spec

    def _ensure_optimizer(self, default: bool = False) -> DynamicEmbeddingFusedOptimizer | None:
        """The fused optimizer of the chosen spec; with none chosen, DEFAULT_OPTIMIZER when
        ``default`` (a backward follows) or one already in use, else None."""
        spec = self._chosen_spec()
        is_default = spec is None and (default or self._fused is not None)
        if is_default:
            spec = DEFAULT_OPTIMIZER
            if not self._warned_default:
                self._warned_default = True
                warnings.warn(
                    f"{type(self).__name__}: no fused optimizer was chosen, so the tables train with TorchRec's "
                    f"sharded default (EmbOptimType.EXACT_SGD, learning_rate={DEFAULT_OPTIMIZER.lr}); the table "
                    "weights get no .grad, so a dense torch.optim optimizer skips them. Choose one with "
                    "torchrec.optim.apply_optimizer_in_backward(cls, module.parameters(), kwargs), the module's "
                    "optimizer= / optimizer_kwargs= arguments or torchrec_ext.modules.fuse_embedding_optimizer",
                    stacklevel=4,
                )
        if spec is None:
            return None
        self._fused_is_default = is_default
        params = self._table_params()
        if self._fused is not None and self._fused.spec == spec:
            return self._fused
        self._tables.set_optimizer(spec)
        state: dict[Tensor, dict[str, Any]] = {}
        for param, m in zip(params.values(), self._tables.meta):
            # The per-row state (momenta) lives with the rows in the module's state_dict, which is
            # what stays consistent with the ids; here only the step count, which Adam's bias
            # correction and Adagrad's lr decay need.
            state[param] = {f"{m.name}.step": self._tables.optimizer_step}
            # TorchRec's own markers: its sharders read them (the default sets none, so that a
            # sharder's fused_params still apply).
            if not is_default and not getattr(param, "_optimizer_classes", None):
                param._optimizer_classes = [spec.torch_class()]
                param._optimizer_kwargs = [spec.torch_kwargs()]
        self._fused = DynamicEmbeddingFusedOptimizer(params, state, spec)
        for param in params.values():
            param._in_backward_optimizers = [self._fused]
        return self._fused

    def _set_fused_optimizer(self, cls: Any, kwargs: Mapping[str, Any] | None, spec: OptimizerSpec) -> None:
        """fuse_embedding_optimizer's: ``spec`` (resolved from ``cls(**kwargs)``) replaces the
        optimizer chosen before, apply_optimizer_in_backward's included."""
        self._optimizer_spec = spec
        for param in self._table_params().values():
            param._optimizer_classes = [cls if isinstance(cls, type) else spec.torch_class()]
            param._optimizer_kwargs = [dict(kwargs or {}) if isinstance(cls, type) else spec.torch_kwargs()]
        self._ensure_optimizer()

    def _rebuild_fused_optimizer(self) -> None:
        """After the storage was replaced: the optimizer's state views must point at the new one."""
        if self._fused is not None:
            self._fused = None
            self._ensure_optimizer(default=self._fused_is_default)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The tables' optimizer as a TorchRec KeyedOptimizer (empty until one is chosen)."""
        fused = self._ensure_optimizer()
        return fused if fused is not None else EmptyFusedOptimizer()

    def _hyperparams(self):
        fused = self._ensure_optimizer()
        return None if fused is None else fused.hyperparams()

    # ------------------------------------------------------------------ lookup

    def _traced_call(self, features: torch.fx.Proxy, output_type: type) -> torch.fx.Proxy:
        """Under torch.fx / torchrec.fx symbolic tracing: this module as one ``call_module``
        node (a leaf), since ids -> rows depends on the ids' values and the tables' contents,
        which a symbolic trace cannot follow. The traced graph calls this module at run time."""
        tracer = features.tracer
        return tracer.create_proxy("call_module", tracer.path_of_module(self), (features,), {}, type_expr=output_type)

    def _lookup_rows(self, batch: LookupInput) -> RowLookup:
        self._tables.check_ready(type(self).__name__)
        backward_follows = bool(self._differentiable_params())
        if self.training or backward_follows:
            fused = self._ensure_optimizer(default=backward_follows)
            if backward_follows and fused is not None:
                fused.hyperparams()  # settings written since (by a scheduler) are refused before any id is inserted
        return self._tables.lookup(batch.ids, batch.segment_offsets, self.training, backward_follows=backward_follows)

    def _differentiable_params(self) -> list[Tensor]:
        params = [t.weight for t in self._table_modules()]
        return params if torch.is_grad_enabled() and any(p.requires_grad for p in params) else []


class PooledLookupFunction(torch.autograd.Function):
    """Pooled lookup whose backward is the fused optimizer update; the tables get no gradient,
    per-sample weights that require one (a feature processor's) get theirs. ``weights`` is
    ``batch.weights``, passed apart so that autograd sees it."""

    @staticmethod
    def forward(
        ctx,
        owner: DynamicCollectionMixin,
        lookup: RowLookup,
        batch: LookupInput,
        weights: Tensor | None,
        *params: Tensor,
    ) -> Tensor:
        tables, plan = owner._tables, owner._plan
        table_offsets, table_dims, _ = tables.layout()
        feature_table, feature_col, feature_mean = plan.tensors(tables.device)
        offsets = torch.zeros(batch.lengths.numel() + 1, dtype=torch.int64, device=batch.lengths.device)
        torch.cumsum(batch.lengths, 0, out=offsets[1:])
        ctx.owner, ctx.lookup, ctx.batch, ctx.offsets = owner, lookup, batch, offsets
        ctx.num_params = len(params)
        return ops.pooled_lookup(
            tables.weights,
            table_offsets,
            table_dims,
            feature_table,
            feature_col,
            feature_mean,
            lookup.rows,
            offsets,
            batch.weights,
            batch.batch_size,
            plan.total_dim,
            lookup.new_vectors,
            tables.dtype_layout()[0],
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        owner, batch = ctx.owner, ctx.batch
        # Before the update: the weights' gradient reads the rows as the forward did.
        grad_weights = per_sample_weight_grad(owner, ctx.lookup, batch, grad) if ctx.needs_input_grad[3] else None
        _, feature_col, feature_mean = owner._plan.tensors(owner._tables.device)
        owner._tables.apply_gradients(
            grad,
            ctx.lookup,
            ctx.offsets,
            batch.weights,
            feature_col,
            feature_mean,
            batch.batch_size,
            owner._hyperparams(),
        )
        return (None, None, None, grad_weights) + (None,) * ctx.num_params


def per_sample_weight_grad(
    owner: DynamicCollectionMixin, lookup: RowLookup, batch: LookupInput, grad: Tensor
) -> Tensor:
    """d loss / d weight of each id: its row (as the lookup read it) dotted with the gradient of
    its bag's output columns, divided by the bag's length under mean pooling. One sequence
    lookup per distinct embedding dim."""
    tables, plan = owner._tables, owner._plan
    table_offsets, _, _ = tables.layout()
    feature_table, feature_col, feature_mean = plan.tensors(tables.device)
    n, bags = batch.ids.numel(), batch.lengths.numel()
    bag = torch.repeat_interleave(torch.arange(bags, device=grad.device), batch.lengths, output_size=n)
    feature, sample = bag // batch.batch_size, bag % batch.batch_size
    scale = torch.where(feature_mean[feature], 1.0 / batch.lengths[bag].clamp(min=1).float(), 1.0)
    starts = [0]
    for count in batch.value_counts:
        starts.append(starts[-1] + count)
    out = grad.new_zeros(n)
    for dim in sorted(set(plan.dims)):
        features = [i for i, d in enumerate(plan.dims) if d == dim]
        at = torch.cat([torch.arange(starts[i], starts[i + 1], device=grad.device) for i in features])
        counts = torch.tensor([0] + [batch.value_counts[i] for i in features], device=grad.device).cumsum(0)
        # (the op takes one dim: other tables' pending vectors are not read, so stand in empty)
        pending = [v if v.shape[1] == dim else v.new_zeros(0, dim) for v in lookup.new_vectors]
        rows = ops.sequence_lookup(
            tables.weights,
            table_offsets,
            dim,
            feature_table[features],
            counts,
            lookup.rows[at],
            pending,
            tables.dtype_layout()[0],
        )
        cols = feature_col[feature[at]].unsqueeze(1) + torch.arange(dim, device=grad.device)
        out[at] = (grad[sample[at].unsqueeze(1), cols] * rows).sum(1) * scale[at]
    return out


class SequenceLookupFunction(torch.autograd.Function):
    """Sequence lookup ([num_ids, dim]) whose backward is the fused optimizer update."""

    @staticmethod
    def forward(ctx, owner: DynamicCollectionMixin, lookup: RowLookup, batch: LookupInput, *params: Tensor) -> Tensor:
        tables, plan = owner._tables, owner._plan
        table_offsets, _, _ = tables.layout()
        feature_table, _, _ = plan.tensors(tables.device)
        ctx.owner, ctx.lookup = owner, lookup
        ctx.num_params = len(params)
        return ops.sequence_lookup(
            tables.weights,
            table_offsets,
            plan.dims[0] if plan.dims else 1,
            feature_table,
            batch.feature_value_offsets,
            lookup.rows,
            lookup.new_vectors,
            tables.dtype_layout()[0],
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        owner = ctx.owner
        empty = torch.zeros(0, dtype=torch.int64, device=grad.device)
        owner._tables.apply_gradients(grad, ctx.lookup, None, None, empty, empty.bool(), 0, owner._hyperparams())
        return (None, None, None) + (None,) * ctx.num_params
