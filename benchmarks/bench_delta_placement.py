"""The cost of applying a delta to a replica of a full table, where the greedy insert of the
delta's new ids fails and the replica re-places its whole table (modules/delta_placement.py),
against a replica with room to spare (the greedy insert), in one process.

Source: one DynamicEmbeddingBagCollection table of `capacity` rows x `dim` (LRU, fused SGD),
filled to capacity by training-mode forwards of ids drawn from 2 x capacity (it evicts). Then
`token = delta_token()`, two replicas load its state_dict: `full` (the source's capacity) and
`roomy` (twice it), and for each of `deltas` steps the source trains on `changed` x capacity ids
(half of them new: it evicts as many), exports the delta, and each replica applies it (timed).
The full replica's time splits into the placement search (`place_exactly`: the index exported,
the ids placed by place_keys from the held ids' rows, a new index built) and the rest (greedy
attempt, moves of the held ids on augmenting paths, row writes). Medians over the deltas; the replicas' rows are checked against the source's.

    python benchmarks/bench_delta_placement.py                   # saves results/delta_placement_cpu.*
    python benchmarks/bench_delta_placement.py --capacities 65536 --deltas 3 --no-save   # smoke
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save


@dataclasses.dataclass
class Config:
    capacities: str = "65536,1048576,4194304"
    dim: int = 64
    changed: float = 0.01
    deltas: int = 5
    fill_batch: int = 1 << 18


def kjt(ids: torch.Tensor):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(ids.numel(), dtype=torch.int64))


def module(capacity: int, dim: int):
    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    table = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=dim, num_embeddings=capacity, feature_names=["f"], eviction_policy="lru"
    )
    return DynamicEmbeddingBagCollection([table], optimizer="sgd", optimizer_kwargs={"lr": 0.01})


def rows_by_id(m) -> tuple[torch.Tensor, torch.Tensor]:
    sd = m.state_dict()
    ids = sd["embedding_bags.t.weight_id"]
    order = ids.argsort()
    return ids[order], sd["embedding_bags.t.weight"][order]


def measure(capacity: int, cfg: Config, gen: torch.Generator) -> dict[str, object]:
    from torchrec_ext.modules import delta_placement

    searches: list[float] = []
    moved: list[int] = []
    exact = delta_placement.place_exactly

    def timed_exact(*args):
        start = time.perf_counter()
        out = exact(*args)
        searches.append(time.perf_counter() - start)
        moved.append(out.moved_from.numel())
        return out

    delta_placement.place_exactly = timed_exact
    try:
        source = module(capacity, cfg.dim)
        universe = torch.randperm(2 * capacity, generator=gen) * 0x9E3779B97F4A7C15 % (1 << 62)
        with torch.no_grad():
            for lo in range(0, 2 * capacity, cfg.fill_batch):
                source(kjt(universe[lo : lo + cfg.fill_batch]))
        assert source.num_live_rows() == capacity, source.num_live_rows()
        token = source.delta_token()
        base = source.state_dict()
        full, roomy = module(capacity, cfg.dim), module(2 * capacity, cfg.dim)
        for replica in (full, roomy):
            replica.load_state_dict(base)
            replica.follow_deltas(token)
        del base
        n = int(cfg.changed * capacity)
        times: dict[str, list[float]] = {"full": [], "roomy": []}
        replaced = 0
        for _ in range(cfg.deltas):
            live = rows_by_id(source)[0]
            fresh = torch.randint(1 << 62, (n // 2,), generator=gen)  # new ids: the source evicts as many
            touched = live[torch.randperm(live.numel(), generator=gen)[: n - n // 2]]
            source(kjt(torch.cat([touched, fresh]))).values().sum().backward()
            delta = source.export_delta(since=token)
            token = delta.token
            for name, replica in (("full", full), ("roomy", roomy)):
                before = len(searches)
                start = time.perf_counter()
                replica.apply_delta(delta)
                times[name].append(time.perf_counter() - start)
                replaced += name == "full" and len(searches) > before
        want = rows_by_id(source)
        for replica in (full, roomy):
            got = rows_by_id(replica)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "a replica's rows differ"
        return dict(
            capacity=capacity,
            dim=cfg.dim,
            delta_ids=int(delta.tables["t"].ids.numel()),
            tombstones=int(delta.tables["t"].tombstones.numel()),
            deltas=cfg.deltas,
            replaced=replaced,
            full_s=statistics.median(times["full"]),
            search_s=statistics.median(searches) if searches else 0.0,
            moved_rows=statistics.median(moved) if moved else 0,
            roomy_s=statistics.median(times["roomy"]),
        )
    finally:
        delta_placement.place_exactly = exact


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    gen = torch.Generator().manual_seed(0)
    load_before = os.getloadavg()
    records = [measure(int(c), cfg, gen) for c in cfg.capacities.split(",")]
    rows = [
        [
            f"{r['capacity']:,}",
            f"{r['delta_ids']:,} / {r['tombstones']:,}",
            f"{r['replaced']} of {r['deltas']}",
            f"{r['moved_rows']:,}",
            f"{1e3 * r['full_s']:.1f}",
            f"{1e3 * r['search_s']:.1f}",
            f"{1e3 * r['roomy_s']:.1f}",
            f"{r['full_s'] / r['roomy_s']:.1f}x",
        ]
        for r in records
    ]
    text = [
        f"# apply_delta to a replica of a full table (LRU, dim {cfg.dim}, fused SGD: rows are vectors only), "
        f"{cfg.changed:.0%} of the rows changed per delta, half of them new ids",
        "",
        markdown_table(
            [
                "capacity",
                "delta ids / tombstones",
                "re-placed",
                "held ids moved",
                "full replica ms",
                "of which placement search ms",
                "replica at 2x capacity ms",
                "full / 2x",
            ],
            rows,
        ),
        "",
        f"Medians over {cfg.deltas} deltas. Load average (1, 5, 15 min) before "
        f"{tuple(round(x, 2) for x in load_before)}, after {tuple(round(x, 2) for x in os.getloadavg())} "
        f"on {os.cpu_count()} cores.",
        "",
        f"`python benchmarks/bench_delta_placement.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
    ]
    print("\n".join(text))
    if save_results:
        for r in records:
            save("delta_placement_cpu", dict(config=dataclasses.asdict(cfg), **r), "\n".join(text))


if __name__ == "__main__":
    main()
