"""The parts of a model's state a checkpoint load or an incremental save needs, without
gathering the dynamic tables' rows.

``state_template(model)`` is ``model.state_dict()`` with every dynamic table's per-row entries
empty: ``load_checkpoint(path, {"model": state_template(model), ...})`` sizes them from the
checkpoint, so the load gathers no row only to overwrite it (a copy of every table otherwise).
``tables_left_out(modules)`` leaves the dynamic modules out of a model's ``state_dict()`` and
``load_state_dict`` altogether: the dense state alone (incremental checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn


def dynamic_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The outermost submodules of ``model`` with dynamic tables (unsharded or sharded), by name."""
    found: dict[str, nn.Module] = {}
    for name, sub in model.named_modules():
        if "" in found or any(name.startswith(outer + ".") for outer in found):
            continue
        if hasattr(sub, "delta_token") and hasattr(sub, "export_delta"):
            found[name] = sub
    return found


def local_tables(module: nn.Module):
    """This rank's DynamicTables of a dynamic module (a sharded one's share; None: no table here)."""
    local = module.local_module if hasattr(module, "local_module") else module
    return None if local is None else local._tables


def state_template(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with the dynamic tables' per-row entries empty (module doc).
    Collective for a sharded model, as ``state_dict()`` is."""
    with ExitStack() as stack:
        for module in dynamic_modules(model).values():
            tables = local_tables(module)
            if tables is not None:
                stack.enter_context(tables.rows_as_shapes())
        return model.state_dict()


def _skip_state(*args: Any, destination: Any = None, **kwargs: Any) -> Any:
    return destination


def _skip_load(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def tables_left_out(modules: list[nn.Module]) -> Iterator[None]:
    """Within it, a model's ``state_dict()`` leaves out these modules (their tables: the dense
    state, without gathering a row) and its ``load_state_dict`` passes them by (neither loaded nor
    reported missing). Shadows the methods on the instances."""
    shadowed = [(module, "state_dict", _skip_state) for module in modules]
    shadowed += [(sub, "_load_from_state_dict", _skip_load) for module in modules for sub in module.modules()]
    for module, name, replacement in shadowed:
        module.__dict__[name] = replacement
    try:
        yield
    finally:
        for module, name, _ in shadowed:
            module.__dict__.pop(name, None)
