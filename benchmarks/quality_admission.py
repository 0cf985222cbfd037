"""Held-out AUC on the Criteo sample with tables smaller than the ids they see: which ids earn a
row (admission strategies), what the others read (zeros, or learned fallback rows), against a
modulo-hashed TorchRec EmbeddingBagCollection holding the same bytes (issue 18's quality table).

Data: ../shared/data/criteo_kaggle_sample/train.tsv (7,200 labelled lines): the first `train`
lines train (`epochs` passes, in order), the rest evaluate. Model: TorchRec's
DLRM_DCN, embedding dim `dim`, dense Adagrad; tables fused Adagrad (TorchRec's: Adagrad over
their dense gradients, which leaves untouched rows as they are). Each of the 26 dynamic tables
holds `fraction` of its feature's distinct training ids (at least `min_rows`). The baseline's
table for a feature gets as many rows as the same bytes buy it (vectors + Adagrad state; ours
also pay for the hash index and the admission state), and reads id mod rows.

Arms: none (every id until the table is full, then LRU eviction), counter / bloom (an id gets a
row at its `admit_after`-th sighting), probabilistic (admit with probability `p`), each with
ids without a row reading zeros and, when the build has them, `fallback_rows` shared rows.
AUC: mean and standard deviation over `seeds` seeds (model init and the tables' seeds).

    python benchmarks/quality_admission.py            # writes results/quality_admission_cpu.*
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save

DATA = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "criteo_kaggle_sample", "train.tsv"
)


@dataclasses.dataclass
class Config:
    train: int = 6400  # lines; the rest (800) are held out
    epochs: int = 2
    batch: int = 128
    dim: int = 16
    fraction: float = 0.1
    min_rows: int = 8
    lr: float = 0.05
    admit_after: int = 2
    p: float = 0.3
    fallback_rows: int = 1  # per table; quality_fallback_rows_cpu.md compares 1, 4, 16, 64
    seeds: int = 10


def batches(cfg: Config):
    from torchrec_ext.data import CriteoTsvReader

    every = list(CriteoTsvReader(DATA, batch_size=cfg.batch))  # in file order
    train_batches = cfg.train // cfg.batch
    return every[:train_batches], every[train_batches:]


def distinct_ids(train) -> dict[str, int]:
    seen: dict[str, set] = {}
    for b in train:
        for key, jt in b.sparse_features.to_dict().items():
            seen.setdefault(key, set()).update(jt.values().tolist())
    return {k: len(v) for k, v in seen.items()}


def has_fallback_rows() -> bool:
    from torchrec_ext import DynamicEmbeddingBagConfig

    return "fallback_rows" in {f.name for f in dataclasses.fields(DynamicEmbeddingBagConfig)}


def arms(cfg: Config) -> list[dict[str, object]]:
    strategies = [
        ("none", {}),
        ("counter", {"admission": "counter", "admit_after": cfg.admit_after}),
        ("bloom", {"admission": "bloom", "admit_after": cfg.admit_after, "bloom_fpr": 0.01}),
        ("probabilistic", {"admission": "probabilistic", "admit_probability": cfg.p}),
    ]
    out = []
    for name, options in strategies:
        out.append({"name": name, "options": options, "fallback": False})
        if has_fallback_rows():
            out.append({"name": name, "options": dict(options, fallback_rows=cfg.fallback_rows), "fallback": True})
    return out


class ModuloEBC(torch.nn.Module):
    """TorchRec's EmbeddingBagCollection reading id mod its rows: the fixed-vocabulary baseline."""

    def __init__(self, rows: dict[str, int], dim: int):
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        super().__init__()
        self.rows = rows
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=n, feature_names=[k])
                for k, n in rows.items()
            ]
        )
        self.embedding_bag_configs = self.ebc.embedding_bag_configs

    def forward(self, features):
        from torchrec import KeyedJaggedTensor

        moduli = torch.cat(
            [
                torch.full((int(n),), self.rows[k], dtype=torch.int64)
                for k, n in zip(features.keys(), features.length_per_key())
            ]
        )
        return self.ebc(KeyedJaggedTensor(features.keys(), features.values() % moduli, lengths=features.lengths()))


def dlrm(ebc, dim: int):
    from torchrec.models.dlrm import DLRM_DCN, DLRMTrain

    from torchrec_ext.data import INT_FEATURE_COUNT

    return DLRMTrain(
        DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=INT_FEATURE_COUNT,
            dense_arch_layer_sizes=[64, dim],
            over_arch_layer_sizes=[128, 64, 1],
            dcn_num_layers=2,
            dcn_low_rank_dim=16,
        )
    )


def ours(cfg: Config, capacities: dict[str, int], options: dict[str, object], seed: int):
    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    tables = [
        DynamicEmbeddingBagConfig(
            name=f"t_{k}",
            embedding_dim=cfg.dim,
            num_embeddings=n,
            feature_names=[k],
            eviction_policy="lru",
            seed=seed,
            **options,
        )
        for k, n in capacities.items()
    ]
    return DynamicEmbeddingBagCollection(tables, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": cfg.lr})


def train_and_eval(cfg: Config, model, train, held, fused_tables: bool) -> float:
    """Held-out AUC after training; the tables' parameters join the dense Adagrad unless their
    optimizer is fused."""
    from torchrec_ext.train.metrics import rank_auc

    params = [p for n, p in model.named_parameters() if not (fused_tables and "embedding_bag_collection" in n)]
    opt = torch.optim.Adagrad(params, lr=cfg.lr)
    model.train()
    for _ in range(cfg.epochs):
        for b in train:
            loss, _ = model(b)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for b in held:
            _, (_, lg, lb) = model(b)
            logits.append(lg.flatten())
            labels.append(lb.flatten())
    return rank_auc(torch.cat(logits), torch.cat(labels))


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    if not os.path.isfile(DATA):
        sys.exit(f"quality_admission: the Criteo sample is not here ({DATA})")
    torch.set_num_threads(1)
    train, held = batches(cfg)
    distinct = distinct_ids(train)
    capacities = {k: max(cfg.min_rows, int(n * cfg.fraction)) for k, n in distinct.items()}
    results = []
    plain_bytes = None
    for arm in arms(cfg):
        aucs, nbytes = [], None
        for seed in range(cfg.seeds):
            torch.manual_seed(seed)
            ebc = ours(cfg, capacities, arm["options"], seed)
            nbytes = ebc.storage_bytes()
            aucs.append(train_and_eval(cfg, dlrm(ebc, cfg.dim), train, held, fused_tables=True))
        if arm["name"] == "none" and not arm["fallback"]:
            plain_bytes = nbytes
        results.append(dict(arm=arm["name"], fallback=arm["fallback"], bytes=nbytes, aucs=aucs))
    # The baseline: the bytes of our plain arm, as vectors + Adagrad state rows, in proportion.
    row_bytes = cfg.dim * 4 * 2
    total_capacity = sum(capacities.values())
    baseline_rows = {k: max(1, plain_bytes * n // (total_capacity * row_bytes)) for k, n in capacities.items()}
    aucs = []
    for seed in range(cfg.seeds):
        torch.manual_seed(seed)
        ebc = ModuloEBC(baseline_rows, cfg.dim)
        aucs.append(train_and_eval(cfg, dlrm(ebc, cfg.dim), train, held, fused_tables=False))
    results.append(
        dict(arm="TorchRec EBC, id mod rows", fallback=False, bytes=sum(baseline_rows.values()) * row_bytes, aucs=aucs)
    )

    def fmt(r):
        mean = statistics.mean(r["aucs"])
        sd = statistics.stdev(r["aucs"]) if len(r["aucs"]) > 1 else 0.0
        return [
            r["arm"],
            "rows" if r["fallback"] else ("-" if r["arm"].startswith("TorchRec") else "zeros"),
            f"{r['bytes'] / 1e6:.2f}",
            f"{mean:.4f} ± {sd:.4f}",
        ]

    text = [
        f"# Admission and fallback rows: held-out AUC on the Criteo sample ({cfg.train} train lines x "
        f"{cfg.epochs} epochs, {sum(b.labels.numel() for b in held)} held out)",
        "",
        f"Tables at {cfg.fraction:g} of each feature's distinct training ids ({total_capacity} rows over 26 "
        f"tables for {sum(distinct.values())} distinct ids), dim {cfg.dim}, LRU eviction; AUC mean ± sd over "
        f"{cfg.seeds} seeds.",
        "",
        markdown_table(["admission", "ids without a row read", "table MB", "held-out AUC"], [fmt(r) for r in results]),
        "",
    ]
    if not has_fallback_rows():
        text.append(
            "Fallback rows: not in this build (DynamicEmbeddingBagConfig has no fallback_rows), so no arm "
            "with them ran."
        )
    text.append(f"`python benchmarks/quality_admission.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print("\n".join(text))
    if save_results:
        save(
            "quality_admission_cpu",
            dict(config=dataclasses.asdict(cfg), capacities=capacities, baseline_rows=baseline_rows, results=results),
            "\n".join(text),
        )


if __name__ == "__main__":
    main()
