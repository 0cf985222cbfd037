"""Oracles for the dynamic modules: TorchRec's own EBC / EC holding copies of our live rows."""

from collections.abc import Sequence

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor


def live_rows(module, container: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """table -> (ids, vectors) of its live rows, read from the module's state_dict."""
    sd = module.state_dict()
    names = {k.split(".")[1] for k in sd if k.startswith(container + ".")}
    return {t: (sd[f"{container}.{t}.weight_id"], sd[f"{container}.{t}.weight"]) for t in names}


def _index_maps(rows: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[int, int]]:
    return {t: {k: i for i, k in enumerate(ids.tolist())} for t, (ids, _) in rows.items()}


def remap_kjt(
    kjt: KeyedJaggedTensor, feature_table: dict[str, str], maps: dict[str, dict[int, int]]
) -> KeyedJaggedTensor:
    """Raw ids -> indices of the copied rows; unknown ids -> the table's extra all-zero row."""
    values, start = [], 0
    lengths = kjt.lengths().view(len(kjt.keys()), -1) if kjt.stride() else None
    for i, key in enumerate(kjt.keys()):
        n = int(lengths[i].sum()) if lengths is not None else 0
        m = maps[feature_table[key]]
        values += [m.get(v, len(m)) for v in kjt.values()[start : start + n].tolist()]
        start += n
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.tensor(values, dtype=torch.int64),
        lengths=kjt.lengths(),
        weights=kjt.weights_or_none(),
        stride=kjt.stride(),
    )


def copied_ebc(module) -> tuple[EmbeddingBagCollection, dict[str, dict[int, int]]]:
    """A TorchRec EBC whose rows are our live rows (plus one zero row per table for unseen ids)."""
    rows = live_rows(module, "embedding_bags")
    configs, weights = [], {}
    for cfg in module.embedding_bag_configs():
        ids, vecs = rows[cfg.name]
        configs.append(
            EmbeddingBagConfig(
                name=cfg.name,
                embedding_dim=cfg.embedding_dim,
                num_embeddings=ids.numel() + 1,
                feature_names=list(cfg.feature_names),
                pooling=cfg.pooling,
            )
        )
        weights[cfg.name] = torch.cat([vecs, torch.zeros(1, cfg.embedding_dim)])
    ebc = EmbeddingBagCollection(configs, is_weighted=module.is_weighted())
    with torch.no_grad():
        for name, w in weights.items():
            ebc.embedding_bags[name].weight.copy_(w)
    return ebc, _index_maps(rows)


def copied_ec(module) -> tuple[EmbeddingCollection, dict[str, dict[int, int]]]:
    rows = live_rows(module, "embeddings")
    configs = []
    for cfg in module.embedding_configs():
        ids, _ = rows[cfg.name]
        configs.append(
            EmbeddingConfig(
                name=cfg.name,
                embedding_dim=cfg.embedding_dim,
                num_embeddings=ids.numel() + 1,
                feature_names=list(cfg.feature_names),
            )
        )
    ec = EmbeddingCollection(configs)
    with torch.no_grad():
        for cfg in module.embedding_configs():
            ids, vecs = rows[cfg.name]
            ec.embeddings[cfg.name].weight.copy_(torch.cat([vecs, torch.zeros(1, cfg.embedding_dim)]))
    return ec, _index_maps(rows)


def random_kjt(
    keys: Sequence[str],
    batch_size: int,
    id_pool: torch.Tensor,
    max_len: int = 4,
    weighted: bool = False,
    allow_empty: bool = True,
) -> KeyedJaggedTensor:
    lengths = torch.randint(0 if allow_empty else 1, max_len + 1, (len(keys) * batch_size,))
    n = int(lengths.sum())
    values = id_pool[torch.randint(0, id_pool.numel(), (n,))]
    return KeyedJaggedTensor(
        keys=list(keys), values=values, lengths=lengths, weights=torch.rand(n) if weighted else None, stride=batch_size
    )


def feature_tables(configs) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for cfg in configs:
        for f in cfg.feature_names:
            out.setdefault(f, []).append(cfg.name)
    return out


def brute_force_pooled(module, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """embedding name -> [B, dim], bag by bag from the live rows (zeros for ids without a row)."""
    rows = live_rows(module, "embedding_bags")
    vec = {t: dict(zip(ids.tolist(), v)) for t, (ids, v) in rows.items()}
    shared = {f for f, ts in feature_tables(module.embedding_bag_configs()).items() if len(ts) > 1}
    jts = kjt.to_dict()
    out = {}
    for cfg in module.embedding_bag_configs():
        for f in cfg.feature_names:
            jt = jts[f]
            bags = []
            for b, ids in enumerate(torch.split(jt.values(), jt.lengths().tolist())):
                w = (
                    jt.weights()[jt.offsets()[b] : jt.offsets()[b + 1]]
                    if module.is_weighted()
                    else torch.ones(len(ids))
                )
                acc = torch.zeros(cfg.embedding_dim)
                for i, k in enumerate(ids.tolist()):
                    acc = acc + w[i] * vec[cfg.name].get(k, torch.zeros(cfg.embedding_dim))
                if cfg.pooling.value == "MEAN" and len(ids):
                    acc = acc / len(ids)
                bags.append(acc)
            name = f"{f}@{cfg.name}" if f in shared else f
            out[name] = torch.stack(bags) if bags else torch.zeros(0, cfg.embedding_dim)
    return out
