"""The read-only serving index ops (``serving_index_update``, ``serving_find``) against their
reference (``torchrec_ext.reference.serving_index``: the index decoded bucket by bucket into a
dict, no hashing), at loads up to full, with edge keys, repeats and erases; both compare paths
(AVX-512 and portable); bad input refused with nothing changed."""

import os
import subprocess
import sys

import pytest
import torch

from torchrec_ext import ops
from torchrec_ext import reference as ref

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EDGE_KEYS = torch.tensor([0, -1, 1, INT64_MIN, INT64_MAX, INT64_MIN + 1, 2**32, -(2**32)], dtype=torch.int64)


def _empty(buckets: int) -> torch.Tensor:
    return torch.zeros(buckets * ref.SERVING_BUCKET_WORDS, dtype=torch.int64)


def _built(keys: torch.Tensor, buckets: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, 2**31 - 1, (keys.numel(),), generator=gen)
    return ops.serving_index_update(_empty(buckets), keys[:0], keys, rows), rows


def _find_all(index: torch.Tensor, ids: torch.Tensor, default: int = -7) -> torch.Tensor:
    return ops.serving_find([index], ids, torch.tensor([0, ids.numel()]), [default])


@pytest.mark.parametrize("load", [0.3, 0.6, 0.9, 1.0])
def test_update_holds_the_reference_entries_and_every_key_is_found(load):
    gen = torch.Generator().manual_seed(int(load * 10))
    buckets = 37
    n = int(buckets * ref.SERVING_KEYS_PER_BUCKET * load)
    keys = torch.cat([EDGE_KEYS, torch.randint(INT64_MIN, INT64_MAX, (n - EDGE_KEYS.numel(),), generator=gen)])
    empty = _empty(buckets)
    index, rows = _built(keys, buckets, gen)
    assert torch.equal(empty, _empty(buckets)), "the input index was changed"
    assert ref.serving_index_entries(index) == ref.serving_index_update(empty, keys[:0], keys, rows)
    assert ref.serving_index_reachable(index)
    absent = torch.randint(INT64_MIN, INT64_MAX, (500,), generator=gen)
    absent = absent[~torch.isin(absent, keys)]
    ids = torch.cat([keys, absent, keys.flip(0)])
    assert torch.equal(_find_all(index, ids), ref.serving_find([index], ids, torch.tensor([0, ids.numel()]), [-7]))
    assert torch.equal(_find_all(index, keys), rows)


def test_erases_repeats_and_reassignments_follow_the_dict_model():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randint(INT64_MIN, INT64_MAX, (120,), generator=gen)
    index, _ = _built(keys, 30, gen)  # load 0.8: chains across buckets
    for step in range(6):
        erase = torch.cat([keys[step::5], torch.tensor([12345, INT64_MIN])])  # absent ones skipped
        new = torch.cat([keys[step::7], torch.randint(INT64_MIN, INT64_MAX, (10,), generator=gen)])
        new = torch.cat([new, new[:3]])  # repeated: the last row wins
        rows = torch.randint(0, 1000, (new.numel(),), generator=gen)
        want = ref.serving_index_update(index, erase, new, rows)
        updated = ops.serving_index_update(index, erase, new, rows)
        assert ref.serving_index_entries(updated) == want
        assert ref.serving_index_reachable(updated)
        probe = torch.cat([torch.tensor(list(want)), erase])
        assert torch.equal(
            _find_all(updated, probe), torch.tensor([want.get(k, -7) for k in probe.tolist()], dtype=torch.int64)
        )
        index = updated


def test_find_over_several_tables_gives_each_tables_row_or_default():
    gen = torch.Generator().manual_seed(4)
    indexes, ids = [], []
    for t, (buckets, n) in enumerate([(4, 15), (1, 0), (50, 200), (1, 5)]):  # an empty one, a full one
        keys = torch.randint(-1000, 1000, (n,), generator=gen).unique()
        indexes.append(_built(keys, buckets, gen)[0])
        ids.append(torch.cat([keys, torch.randint(-2000, 2000, (40 * (t != 1),), generator=gen)]))
    offsets = torch.tensor([0] + [i.numel() for i in ids]).cumsum(0)
    ids = torch.cat(ids)
    for defaults in ([-1, -1, -1, -1], [5, 0, 2**31 - 1, -1]):
        got = ops.serving_find(indexes, ids, offsets, defaults)
        assert torch.equal(got, ref.serving_find(indexes, ids, offsets, defaults))
    assert ops.serving_find(indexes, ids[:0], torch.zeros(5, dtype=torch.int64), [0] * 4).numel() == 0


def test_a_large_batch_crosses_parallel_chunks_and_tables():
    gen = torch.Generator().manual_seed(5)
    keys = [torch.randint(INT64_MIN, INT64_MAX, (3000,), generator=gen) for _ in range(3)]
    built = [_built(k, 1000, gen) for k in keys]
    ids = [k[torch.randint(0, 3000, (15000,), generator=gen)] for k in keys]
    want = [r[k.sort().indices][torch.searchsorted(k.sort().values, i)] for k, (_, r), i in zip(keys, built, ids)]
    offsets = torch.tensor([0, 15000, 30000, 45000])
    assert torch.equal(ops.serving_find([b[0] for b in built], torch.cat(ids), offsets, [0, 0, 0]), torch.cat(want))


_CASE = r"""
import torch, torchrec_ext
from torchrec_ext import ops
g = torch.Generator().manual_seed(11)
keys = torch.randint(-2**63, 2**63 - 1, (4000,), generator=g)
index = ops.serving_index_update(torch.zeros(8 * 900, dtype=torch.int64), keys[:0], keys, torch.arange(4000))
ids = torch.cat([keys, torch.randint(-2**63, 2**63 - 1, (4000,), generator=g)])
rows = ops.serving_find([index], ids, torch.tensor([0, 8000]), [-1])
result = [rows.tolist() == list(range(4000)) + [-1] * 4000, int((rows * torch.arange(8000)).sum())]
"""


def test_the_portable_compare_gives_the_avx512_rows():
    """TORCHREC_EXT_NO_AVX512=1 (chosen when the library loads: a child process) gives the rows
    this process gives, at load 0.89 (chains)."""
    here: dict = {}
    exec(_CASE, here)
    done = subprocess.run(
        [sys.executable, "-c", _CASE + "print(result)"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), TORCHREC_EXT_NO_AVX512="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert here["result"][0] and done.stdout.strip().splitlines()[-1] == str(here["result"])


# ----------------------------------------------------------------------------- bad input


def test_a_full_index_refuses_the_update_and_changes_nothing():
    index = ops.serving_index_update(_empty(2), EDGE_KEYS[:0], EDGE_KEYS[:7], torch.arange(7))
    before = index.clone()
    with pytest.raises(RuntimeError, match=r"serving_index_update: index is full \(2 buckets of 5 keys\)"):
        ops.serving_index_update(index, EDGE_KEYS[:0], torch.arange(100, 104), torch.arange(4))
    assert torch.equal(index, before)
    # Erasing first makes room: the same update then succeeds.
    out = ops.serving_index_update(index, EDGE_KEYS[:3], torch.arange(100, 103), torch.arange(3))
    assert ref.serving_index_entries(out) == ref.serving_index_update(
        index, EDGE_KEYS[:3], torch.arange(100, 103), torch.arange(3)
    )


@pytest.mark.parametrize(
    "case, match",
    [
        (dict(index=torch.zeros(12, dtype=torch.int64)), "index must hold a positive multiple of 8 words.*got 12"),
        (dict(index=torch.zeros(16, dtype=torch.int32)), "index must be int64, got Int"),
        (dict(keys=torch.tensor([1.0])), "keys must be int64, got Float"),
        (dict(rows=torch.tensor([1, 2])), r"rows must have one entry per key \(1\), got 2"),
        (dict(rows=torch.tensor([2**31])), r"rows must be in \[0, 2\^31 - 1\], got 2147483648 at position 0"),
        (dict(rows=torch.tensor([-1])), r"rows must be in \[0, 2\^31 - 1\], got -1"),
        (dict(erase_keys=torch.zeros(2, 2, dtype=torch.int64)), "erase_keys must be 1-D"),
    ],
)
def test_update_refuses_bad_input_naming_the_argument(case, match):
    args = dict(index=_empty(2), erase_keys=EDGE_KEYS[:0], keys=torch.tensor([7]), rows=torch.tensor([1]))
    args.update(case)
    with pytest.raises(RuntimeError, match="serving_index_update: " + match):
        ops.serving_index_update(**args)


def test_an_index_with_a_bad_bucket_count_is_refused():
    index = ops.serving_index_update(_empty(2), EDGE_KEYS[:0], EDGE_KEYS[:3], torch.arange(3))
    index.view(torch.int32)[15] = 9  # bucket 0 claims 9 keys
    with pytest.raises(RuntimeError, match="index is not a serving index: bucket 0 says it holds 9 keys"):
        ops.serving_index_update(index, EDGE_KEYS[:0], EDGE_KEYS[:1], torch.arange(1))


@pytest.mark.parametrize(
    "case, match",
    [
        (dict(default_rows=[0, 0]), r"default_rows must have one entry per index \(1\), got 2"),
        (dict(id_offsets=torch.tensor([0, 1, 3])), r"id_offsets must have len\(indexes\) \+ 1 = 2 entries, got 3"),
        (dict(id_offsets=torch.tensor([0, 2])), r"id_offsets must run from 0 to the number of ids \(3\), got 0 to 2"),
        (dict(ids=torch.tensor([1, 2, 3], dtype=torch.int32)), "ids must be int64, got Int"),
        (dict(indexes=[torch.zeros(7, dtype=torch.int64)]), r"indexes\[t\] must hold a positive multiple of 8"),
    ],
)
def test_find_refuses_bad_input_naming_the_argument(case, match):
    args = dict(indexes=[_empty(1)], ids=torch.tensor([1, 2, 3]), id_offsets=torch.tensor([0, 3]), default_rows=[0])
    args.update(case)
    with pytest.raises(RuntimeError, match="serving_find: " + match):
        ops.serving_find(**args)


def test_find_refuses_descending_offsets():
    with pytest.raises(RuntimeError, match="serving_find: id_offsets must be ascending, got 2 then 1 at 1"):
        ops.serving_find([_empty(1)] * 3, torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]), [0, 0, 0])
