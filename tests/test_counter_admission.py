"""CounterAdmission.admit (issue 18, the exact counter) against a model on the dict hash table of
torchrec_ext/reference/: the same admissions, side-table ids and counts after every batch, with
a side table large enough to keep every id and one so small that ids are evicted and refused."""

import random

import pytest
import torch

from torchrec_ext import reference as ref
from torchrec_ext.modules import admission as adm


class PyCounter:
    """Exact counts in an LFU side table (the dict model): a pending id is counted in its row (a
    row new to the counter from 0), admitted at ``admit_after`` and then forgotten; an id the side
    table refuses (no row) is not counted."""

    def __init__(self, admit_after, capacity):
        self.admit_after, self.table, self.seen = admit_after, ref.ReferenceHashTable(capacity, "lfu"), {}
        self.refused = 0

    def batch(self, keys, counts, unseen):
        pending = [(k, c) for k, c, u in zip(keys, counts, unseen) if u]
        rows, inserted, _, _ = self.table.upsert([k for k, _ in pending], [c for _, c in pending])
        ready = set()
        for (key, count), row, new in zip(pending, rows, inserted):
            if row < 0:
                self.refused += 1
                continue
            self.seen[row] = (0 if new else self.seen[row]) + count
            if self.seen[row] >= self.admit_after:
                ready.add(key)
        self.table.erase([k for k, _ in pending if k in ready])
        return [u and k in ready for k, u in zip(keys, unseen)]

    def state(self):
        return sorted((key, self.seen[row]) for key, row, _ in self.table.export())


@pytest.mark.parametrize("compact_on_cpu", [True, False], ids=["compacting", "fixed_size"])
@pytest.mark.parametrize("capacity, universe", [(4096, 600), (64, 400)])
def test_counter_admission_matches_the_dict_model(capacity, universe, compact_on_cpu, monkeypatch):
    monkeypatch.setattr(adm.CounterAdmission, "compact_on_cpu", compact_on_cpu)
    rng = random.Random(capacity)
    strategy = adm.CounterAdmission(3, capacity, torch.device("cpu"))
    model = PyCounter(3, capacity)
    for step in range(1, 16):
        keys = rng.sample(range(-universe, universe), 150)  # distinct, as the tables pass them
        counts = [rng.choice([1, 1, 2, 5]) for _ in keys]
        unseen = [rng.random() < 0.85 for _ in keys]
        want = model.batch(keys, counts, unseen)
        got = strategy.admit(torch.tensor(keys), torch.tensor(counts), torch.tensor(unseen), step)
        assert got.tolist() == want, f"step {step}"
        state = strategy.state()
        assert sorted(zip(state["admission_id"].tolist(), state["admission_count"].tolist())) == model.state()
    if capacity == 64:
        assert model.refused > 0  # the small side table refused ids (the masked write-back ran)
    else:
        assert model.refused == 0
