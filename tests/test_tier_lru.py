"""The least recently used order of a tiered table's cache slots (torchrec_ext/modules/tier_lru.py).

Oracle: brute force over every slot's ``last_used``: the slots ``oldest`` takes are occupied, not
pinned, last used before the clock given, distinct, as many as asked for (or all there are), and
none of the slots left is less recently used than one taken.
"""

import torch

from torchrec_ext.modules.tier_lru import SlotOrder


def _check_taken(taken, k, last_used, row_of, before, pinned):
    eligible = (row_of >= 0) & (last_used < before) & ~pinned
    taken_list = taken.tolist()
    assert len(set(taken_list)) == len(taken_list), "a slot taken twice"
    assert bool(eligible[taken].all()), "took a slot that is empty, pinned or used at this clock"
    assert taken.numel() == min(k, int(eligible.sum()))
    left = eligible.clone()
    left[taken] = False
    if taken.numel() and bool(left.any()):
        assert int(last_used[taken].max()) <= int(last_used[left].min()), "left a less recently used slot"


def test_oldest_takes_the_least_recently_used_slots_around_pins_and_empty_slots():
    slots = 64
    gen = torch.Generator().manual_seed(3)
    order = SlotOrder(slots)
    last_used = torch.zeros(slots, dtype=torch.int64)
    row_of = torch.full((slots,), -1, dtype=torch.int64)
    free = list(range(slots))
    for clock in range(1, 400):
        # a lookup's hits: occupied slots used again (each slot at most once a clock)
        occupied = (row_of >= 0).nonzero().squeeze(1)
        hits = occupied[
            torch.randperm(occupied.numel(), generator=gen)[: int(torch.randint(0, 12, (1,), generator=gen))]
        ]
        order.touch(hits, clock, last_used, row_of)
        pinned = torch.zeros(slots, dtype=torch.bool)
        if clock % 3 == 0:  # a batch in flight holds some slots, old ones among them
            pinned[occupied[torch.randperm(occupied.numel(), generator=gen)[:10]]] = True
        # slots for new rows: free ones first, then the least recently used
        k = int(torch.randint(0, 14, (1,), generator=gen))
        from_free = torch.tensor(free[:k], dtype=torch.int64)
        free = free[k:]
        before_taking = last_used.clone()
        taken = order.oldest(k - from_free.numel(), last_used, row_of, clock, pinned)
        assert torch.equal(last_used, before_taking)  # taking does not change the clocks
        _check_taken(taken, k - from_free.numel(), last_used, row_of, clock, pinned)
        victims = torch.cat([from_free, taken])
        if clock % 5 == 0 and victims.numel():  # some are left empty (a stage freeing slots for new rows)
            emptied, victims = victims[:2], victims[2:]
            row_of[emptied] = -1
            free += emptied.tolist()
        row_of[victims] = victims + 1000 * clock
        order.touch(victims, clock, last_used, row_of)
        assert order.entries <= 2 * slots
    # every occupied slot can still be taken, oldest first
    occupied = int((row_of >= 0).sum())
    no_pins = torch.zeros(slots, dtype=torch.bool)
    taken = order.oldest(slots, last_used, row_of, 10**6, no_pins)
    _check_taken(taken, slots, last_used, row_of, 10**6, no_pins)
    assert taken.numel() == occupied
    assert torch.equal(last_used[taken], last_used[taken].sort().values)


def test_the_queue_is_rebuilt_when_hits_pile_up_and_keeps_its_order():
    slots = 32
    order = SlotOrder(slots)
    last_used = torch.zeros(slots, dtype=torch.int64)
    row_of = torch.arange(slots)
    order.touch(torch.arange(slots), 1, last_used, row_of)
    for clock in range(2, 200):  # the same hot slots hit every clock: stale entries pile up
        order.touch(torch.arange(8), clock, last_used, row_of)
        assert order.entries <= 2 * slots
    assert order.nbytes() == 4 * order.entries
    taken = order.oldest(slots, last_used, row_of, 10**6, None)
    assert taken.tolist()[: slots - 8] == list(range(8, slots))  # the cold slots first, in slot order
    assert sorted(taken.tolist()[slots - 8 :]) == list(range(8))
