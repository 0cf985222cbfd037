"""The cache size and algorithm of a tiered table (``backing="host"`` / ``"file:<dir>"``) as a plan gives them.

TorchRec sizes a table's cache with ``ParameterConstraints(cache_params=CacheParams(load_factor=f))``,
which its planner copies into the plan's ``ParameterSharding.cache_params``, and, for all the
tables of a sharder, with its ``fused_params["cache_load_factor"]``; our dynamic configs also have
``cache_load_factor``. One rule for the planner and the sharders: the table caches the plan's
(constraint's) load factor, else its config's, else the sharder's fused_params' (a default for
its tables, as in TorchRec), else (unsharded, or none of them) the default 0.2, or, planned, the
planner's choice. The plan's and the config's both given and different is an error naming the
two: two per-table settings that disagree are a mistake, not a precedence to guess. The planner
writes the factor it planned with into every tiered table's ``cache_params``, so the sharded
share caches what was planned.

The cache's algorithm (which cached rows leave first: LRU or LFU) follows the same rule:
``CacheParams(algorithm=CacheAlgorithm.LFU)``, else the config's ``cache_algorithm``, else the
sharder's ``fused_params["cache_algorithm"]``, else LRU (TorchRec's default).
"""

from __future__ import annotations

import numbers
from typing import Any

from torchrec_ext.modules.configs import check_cache_algorithm, options_of


def check_cache_load_factor(value: Any, where: str, what: str = "cache_params.load_factor") -> float:
    """A load factor as a float; raises unless it is a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(
            f"{where}: {what} must be a number in (0, 1] (the fraction of the table's "
            f"rows kept in its cache), got {value!r}"
        )
    return float(value)


def sharder_cache_load_factor(fused_params: dict[str, Any] | None, where: str) -> float | None:
    """A sharder's ``fused_params["cache_load_factor"]`` (checked), None when it has none."""
    value = (fused_params or {}).get("cache_load_factor")
    if value is None:
        return None
    return check_cache_load_factor(value, where, "the sharder's fused_params cache_load_factor")


def planned_cache_load_factor(
    config: Any, cache_params: Any, where: str, sharder_default: float | None = None
) -> float | None:
    """The load factor a table's share caches, given the plan's (or a constraint's) ``cache_params``
    (None, or a TorchRec ``CacheParams``): its ``load_factor``, else the config's
    ``cache_load_factor``, else (a tiered table) ``sharder_default`` (``sharder_cache_load_factor``);
    None when none is set. Raises when the plan sets one for a table without a tier
    (``backing="device"``), or one that is out of (0, 1] or differs from the config's."""
    planned = getattr(cache_params, "load_factor", None)
    planned = None if planned is None else check_cache_load_factor(planned, where)
    opts = options_of(config)
    return _plan_else_config("load_factor", planned, opts.cache_load_factor, opts.backing, sharder_default, where)


def sharder_cache_algorithm(fused_params: dict[str, Any] | None, where: str) -> str | None:
    """A sharder's ``fused_params["cache_algorithm"]`` as "lru" / "lfu", None when it has none."""
    return check_cache_algorithm(
        (fused_params or {}).get("cache_algorithm"), where, "the sharder's fused_params cache_algorithm"
    )


def planned_cache_algorithm(
    config: Any, cache_params: Any, where: str, sharder_default: str | None = None
) -> str | None:
    """The cache algorithm ("lru" / "lfu") a table's share uses, given the plan's (or a
    constraint's) ``cache_params``: its ``algorithm``, else the config's ``cache_algorithm``,
    else (a tiered table) ``sharder_default``; None (LRU) when none is set. Raises when the plan
    sets one for a table without a tier, or one that differs from the config's."""
    planned = check_cache_algorithm(getattr(cache_params, "algorithm", None), where, "cache_params.algorithm")
    opts = options_of(config)
    own = check_cache_algorithm(opts.cache_algorithm, where)
    return _plan_else_config("algorithm", planned, own, opts.backing, sharder_default, where)


def _plan_else_config(setting: str, planned: Any, own: Any, backing: str, sharder_default: Any, where: str) -> Any:
    """The module docstring's rule for ``cache_params.<setting>`` (``planned``, checked) and the
    config's ``cache_<setting>`` (``own``): the plan's, else the config's, else (a tiered table)
    ``sharder_default``. The plan's on a table without a tier, or differing from the config's, is
    an error naming both."""
    if planned is None:
        return sharder_default if own is None and backing != "device" else own
    if backing == "device":
        raise ValueError(
            f'{where}: cache_params.{setting}={planned!r} applies to tables with backing="host" or '
            f'"file:<dir>" (a cache over a backing store); this table has backing="device" (all its rows '
            "in the module's buffer)"
        )
    if own is not None and own != planned:
        raise ValueError(
            f"{where}: cache_params.{setting}={planned!r} (constraint / plan) differs from the config's "
            f"cache_{setting}={own!r}; set one of them (or both alike)"
        )
    return planned
