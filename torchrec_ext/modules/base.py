"""What DynamicEmbeddingBagCollection and DynamicEmbeddingCollection share
(``DynamicCollectionMixin``): their tables (``DynamicTables``) and per-table submodules, device
moves, the choice of the fused optimizer and the ids -> rows step of a lookup. The per-table
submodules are ``table_modules.py``'s, the autograd functions ``lookup_functions.py``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.optim.keyed import KeyedOptimizer

from torchrec_ext.modules.compiled_lookup import register_owner
from torchrec_ext.modules.deltas import DeltaMixin
from torchrec_ext.modules.dynamic_tables import DynamicTables
from torchrec_ext.modules.features import LookupInput, LookupPlan, check_and_arrange
from torchrec_ext.modules.fused_optimizer import (
    DEFAULT_OPTIMIZER,
    DynamicEmbeddingFusedOptimizer,
    OptimizerSpec,
    kwargs_copy,
    resolve_optimizer,
    spec_from_parameter,
)
from torchrec_ext.modules.ids_to_rows import RowLookup
from torchrec_ext.modules.replica_check import check_unsharded_replica
from torchrec_ext.modules.table_modules import DynamicTableDict, DynamicTableModule
from torchrec_ext.modules.table_stats import TableStats
from torchrec_ext.modules.tiered_tables import TieredTables, tables_for


class DynamicCollectionMixin(DeltaMixin):
    """Storage, optimizer and device handling shared by the two dynamic collections.

    The host class is an ``nn.Module`` that calls ``_init_dynamic`` in its constructor.
    """

    _tables: DynamicTables
    _plan: LookupPlan
    # Class defaults, so that a module pickled before these existed reads them too.
    per_rank_tables = False  # each rank of a multi-rank job trains tables of its own, on purpose (replica_check.py)
    _replica_check_pending = True  # cleared once the first training lookup settled replica_check's question

    def _init_dynamic(
        self,
        configs: Sequence[BaseEmbeddingConfig],
        device: torch.device | None,
        container: str,
        optimizer: Any,
        optimizer_kwargs: Mapping[str, Any] | None,
        per_rank_tables: bool = False,
    ) -> None:
        where = type(self).__name__
        register_owner(self)  # (the compiled lookup's handle)
        self.per_rank_tables = bool(per_rank_tables)
        # Without a device, torch's default one, as TorchRec's modules (so ``with torch.device("meta"):``
        # builds a meta module).
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        self._tables = tables_for(configs, self._device)  # tiered when a table has host or file backing
        self._container = container
        setattr(
            self,
            container,
            DynamicTableDict(
                self._tables, {cfg.name: DynamicTableModule(self._tables, t) for t, cfg in enumerate(configs)}
            ),
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
        register_owner(self)  # a copy is another module: the compiled lookup names it by its own id
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

    def _table_modules(self) -> list[DynamicTableModule]:
        return list(getattr(self, self._container).values())

    def _table_weights(self) -> list[Tensor]:
        """Each table's ``weight``, read from the submodules' parameter dicts: no Python call per
        table (``nn.Module.__getattr__`` is one), as the step reads them several times."""
        return [m._parameters["weight"] for m in self._modules[self._container]._modules.values()]

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
        self._refuse_dtype_change(fn)
        self._tables.apply(fn)
        self._device = self._tables.device
        self._bind_parameters()
        self._rebuild_fused_optimizer()
        return self

    def _refuse_dtype_change(self, fn) -> None:
        """The storage is one buffer of 4-byte words, each table packed in its own data_type: a
        cast (``.half()``, ``.double()``, ``.to(dtype)``) would convert the words' values, not the
        rows. Refused before anything changes; device moves pass."""
        converted = fn(torch.empty(0, dtype=torch.float32, device=self._tables.device))
        if converted.dtype != torch.float32:
            raise TypeError(
                f"{type(self).__name__}: cannot convert its tables to {converted.dtype} (module.half(), "
                ".bfloat16(), .double() or .to(dtype)): each table stores its rows in its config's data_type "
                "(torchrec.DataType.FP32, FP16 or BF16) and its optimizer state in float32. Set data_type on "
                "the table configs, and convert the other submodules only (e.g. model.over_arch.half())"
            )

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
        return dict(zip(self._param_names(), self._table_weights()))

    def _param_names(self) -> list[str]:
        return [f"{self._container}.{m.name}.weight" for m in self._tables.meta]

    def _chosen_spec(self) -> OptimizerSpec | None:
        """The optimizer chosen for the tables: apply_optimizer_in_backward's when set, else the
        constructor's (or fuse_embedding_optimizer's); None when none was chosen."""
        where = type(self).__name__
        weights = self._table_weights()
        # Each table's latest (class, kwargs) marker: read every step, resolved only when one
        # changed since the last call (a comprehension: no Python call per table).
        markers = [
            (p._optimizer_classes[-1], p._optimizer_kwargs[-1]) if getattr(p, "_optimizer_classes", None) else None
            for p in weights
        ]
        cached = self.__dict__.get("_chosen_markers")
        if cached is not None and cached[0] == markers:
            return cached[1] if cached[1] is not None else self._optimizer_spec
        specs = {name: spec_from_parameter(p, where) for name, p in zip(self._param_names(), weights)}
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
        found = next(iter(chosen)) if chosen else None
        # (kwargs copied deeply: a dict, or a list in it, changed in place since is a change)
        self._chosen_markers = ([m if m is None else (m[0], kwargs_copy(m[1])) for m in markers], found)
        return found if found is not None else self._optimizer_spec

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
        if self._fused is not None and self._fused.spec == spec:
            return self._fused
        params = self._table_params()
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
            param._optimizer_kwargs = [kwargs_copy(kwargs) if isinstance(cls, type) else spec.torch_kwargs()]
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

    def _lookup_rows(self, batch: LookupInput, backward_follows: bool) -> RowLookup:
        """The rows of ``batch``'s ids (inserting them in training); ``backward_follows``: the
        forward's ``_backward_follows()``, taken once a step."""
        self._tables.check_ready(type(self).__name__)
        if self._replica_check_pending and backward_follows and self.training:
            self._replica_check_pending = not check_unsharded_replica(self)
        if self.training or backward_follows:
            fused = self._ensure_optimizer(default=backward_follows)
            if backward_follows and fused is not None:
                fused.hyperparams()  # settings written since (by a scheduler) are refused before any id is inserted
        return self._tables.lookup(batch.ids, batch.segment_offsets, self.training, backward_follows=backward_follows)

    def _backward_follows(self) -> bool:
        """Whether a backward will follow this forward's lookup (a table weight it reads requires
        grad). ``len``, not ``bool`` of the list: torch 2.11's Dynamo cannot trace ``bool(list)``."""
        return len(self._differentiable_params()) > 0

    def _differentiable_params(self) -> list[Tensor]:
        if not torch.is_grad_enabled():
            return []
        params = self._table_weights()
        # (a list, not a generator: a generator is a Python call per table)
        return params if any([p.requires_grad for p in params]) else []  # noqa: C419
