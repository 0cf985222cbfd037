"""Where a delta's ids go in a replica's index: the rows a replica gives them, planned on a copy.

A replica holds exactly the source's live ids, but not at the source's rows: the source placed
its keys one insert at a time, evicting as it went, so its buckets hold what its own history left
there. Inserting a delta's new ids greedily (``insert_or_assign``, after erasing the tombstones)
mostly works, yet in a full or nearly full table a new id's two buckets can both be full in the
replica while the source's were not: the greedy insert then refuses (or evicts) a live id. The
source's placement proves that one holding every id exists, so the replica then re-places its
table (``place_exactly``): ``place_keys``, the placement a load uses, started from the held ids'
rows, finds a bucket assignment whenever one exists, moving only the held ids on the augmenting
paths that make room. Every held id keeps its score (later evictions on the replica, a source in
turn, rank them as the source's did); the rows of the ids that move are given so the caller moves
their vectors, optimizer state and per-row metadata with them.

Nothing here touches the index it is given: the plan is built on copies, and the caller publishes
it (swaps in ``DeltaRows.index``, moves and writes rows) only once every table has one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext.table import HashTable, place_keys


class NoRowError(ValueError):
    """Some ids of a delta have no row in any placement of the replica's table: it is too small."""

    def __init__(self, lost: int, total: int, capacity: int):
        super().__init__(
            f"{lost} of {total} ids find no row at capacity {capacity} (the ids held after the delta's "
            f"tombstones and its new ones)"
        )
        self.lost = lost


@dataclass
class DeltaRows:
    """A replica table's index after a delta, and where its rows go.

    ``index``: the new index (a copy; the replica's own is unchanged). ``rows``: each delta id's
    row in it; ``inserted``: True where the id was not held before the delta. ``moved_from`` /
    ``moved_to``: rows of held ids that a re-placement moved (None: nothing moved), to copy
    before the delta's rows are written (``view[moved_to] = view[moved_from]``)."""

    index: HashTable
    rows: Tensor
    inserted: Tensor
    moved_from: Tensor | None = None
    moved_to: Tensor | None = None


def place_delta(index: HashTable, ids: Tensor, tombstones: Tensor, scores: Tensor | None = None) -> DeltaRows:
    """The rows of distinct ``ids`` once ``tombstones`` are erased from ``index``: the greedy
    insert when it keeps every held id, else ``place_exactly``. ``scores``: stored as given
    (else each id's score is what ``insert_or_assign`` leaves). Raises ``NoRowError``."""
    plan = index.clone()
    if tombstones.numel():
        plan.erase(tombstones)  # an id not held here is not an error: nothing to remove
    result = plan.insert_or_assign(ids, scores)
    if not bool((result.rows < 0).any()) and result.evicted_keys.numel() == 0:
        return DeltaRows(plan, result.rows, result.inserted)
    return place_exactly(index, ids, tombstones, scores)


def place_exactly(index: HashTable, ids: Tensor, tombstones: Tensor, scores: Tensor | None = None) -> DeltaRows:
    """``place_delta`` by re-placing the table: the ids held after the tombstones, with their
    scores, from their rows, and the delta's new ids, placed by ``place_keys``; the clock, epoch
    and every score end as the greedy insert would have left them."""
    plan = index.clone()
    if tombstones.numel():
        plan.erase(tombstones)
    held = plan.find(ids)[1]
    fresh = None if scores is not None else plan.new_key_score()
    # Touches the held ids (their scores as the insert leaves them; the clock moves one call on,
    # as the insert's would): no id is inserted, so none can be refused.
    plan.insert_or_assign(ids[held], None if scores is None else scores[held])
    state = plan.state_dict()
    new = ~held
    new_scores = scores[new] if scores is not None else torch.full_like(ids[new], fresh)
    keys = torch.cat([state["keys"], ids[new]])
    key_scores = torch.cat([state["scores"], new_scores])
    # From the held ids' slots: only the ids on the augmenting paths that make room move.
    start = state.get("slots", state["rows"])
    rows = place_keys(keys, key_scores, index.capacity, torch.cat([start, torch.full_like(ids[new], -1)]))
    lost = int((rows < 0).sum())
    if lost:
        raise NoRowError(lost, keys.numel(), index.capacity)
    placed = HashTable(index.capacity, policy=index.policy, device=index.device)
    if "slots" in state:  # a grown index: slots map to rows, so held ids keep theirs, new ids take free ones
        used = torch.zeros(index.capacity, dtype=torch.bool, device=index.device)
        used[state["rows"]] = True
        free = (~used).nonzero().squeeze(1)[: int(new.sum())]
        row_ids = torch.cat([state["rows"], free])
        placed.load_state_dict({**state, "keys": keys, "rows": row_ids, "slots": rows, "scores": key_scores})
        return DeltaRows(placed, placed.find(ids)[0], new)
    placed.load_state_dict({**state, "keys": keys, "rows": rows, "scores": key_scores})
    old_rows, new_rows = state["rows"], rows[: state["rows"].numel()]
    moved = old_rows != new_rows
    return DeltaRows(placed, placed.find(ids)[0], new, old_rows[moved], new_rows[moved])
