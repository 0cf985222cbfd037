"""Incremental checkpoints against full ones, in one process: the time to save a delta link when
`changed` of the rows changed since the previous link, against a full `save_checkpoint` of the
same state; and the time to load the chain (base + that delta) against loading the full save.

Model: as benchmarks/bench_checkpoint.py (TorchRec's DLRM over `tables` dynamic tables of `rows`
live rows x `dim`, fused Adagrad, dense Adagrad), tables filled by one step over every id. Then,
per repeat: a base link (`IncrementalCheckpoints(full_every=2)`), one training step over
`changed` x rows distinct ids per table, a delta link and a full save of that step (both
blocking, timed, `state_dict()` building included), and the two loads (verification included,
into the model, whose `state_dict()` is checked to be the same after both). Medians over `repeats`.

    python benchmarks/bench_checkpoint_incremental.py                      # saves results/checkpoint_incremental_cpu.*
    python benchmarks/bench_checkpoint_incremental.py --rows 20000 --repeats 1 --no-save   # smoke
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpoint import ModelConfig, batch, build, train_step
from common import markdown_table, parse_config, save, tensor_bytes


@dataclasses.dataclass
class Config(ModelConfig):
    changed: float = 0.01  # the share of every table's rows the step between the links writes
    repeats: int = 3
    dir: str = ""  # where checkpoints go (default: a temporary directory under /tmp)


def changed_rows_batch(cfg: Config, gen: torch.Generator):
    """One batch whose bags hold `changed` x rows distinct live ids of every table."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    n = max(1, int(cfg.changed * cfg.rows))
    ids = torch.cat([torch.randperm(cfg.rows, generator=gen)[:n] for _ in range(cfg.tables)])
    per_bag = torch.full((cfg.batch,), n // cfg.batch, dtype=torch.int64)
    per_bag[: n % cfg.batch] += 1
    return Batch(
        dense_features=torch.randn(cfg.batch, 13, generator=gen),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(cfg.tables)], values=ids, lengths=per_bag.repeat(cfg.tables)
        ),
        labels=torch.randint(0, 2, (cfg.batch,), generator=gen).float(),
    )


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    from torchrec_ext.distributed.checkpoint import ensure_process_group, load_checkpoint, save_checkpoint
    from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints

    ensure_process_group()
    root = cfg.dir or tempfile.mkdtemp(prefix="bench_checkpoint_incremental_")
    gen = torch.Generator().manual_seed(0)
    model, dense_opt = build(cfg)
    train_step(model, dense_opt, batch(cfg, gen, fill=True))
    full_bytes = tensor_bytes({"model": model.state_dict(), "dense_optim": dense_opt.state_dict()})
    delta_s, full_s, chain_load_s, full_load_s, delta_bytes = [], [], [], [], []
    step = 0
    for _ in range(cfg.repeats):
        ckpts = IncrementalCheckpoints(os.path.join(root, "inc"), model, full_every=2, keep=2)
        step += 1
        ckpts.save(step, {"dense_optim": dense_opt.state_dict()})  # the base
        train_step(model, dense_opt, changed_rows_batch(cfg, gen))
        step += 1
        start = time.perf_counter()
        link = ckpts.save(step, {"dense_optim": dense_opt.state_dict()})
        delta_s.append(time.perf_counter() - start)
        delta_bytes.append(os.path.getsize(os.path.join(link, "tables.rank0-of-1.pt")))
        start = time.perf_counter()
        full = save_checkpoint(
            os.path.join(root, "full"),
            step,
            {"model": model.state_dict(), "dense_optim": dense_opt.state_dict()},
            keep=1,
        )
        full_s.append(time.perf_counter() - start)
        expected = model.state_dict()
        start = time.perf_counter()
        ckpts.load(link, {"dense_optim": dense_opt.state_dict()})
        chain_load_s.append(time.perf_counter() - start)
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
        start = time.perf_counter()
        loaded = load_checkpoint(full, {"model": model.state_dict(), "dense_optim": dense_opt.state_dict()})
        model.load_state_dict(loaded["model"])
        full_load_s.append(time.perf_counter() - start)
    shutil.rmtree(root, ignore_errors=True) if not cfg.dir else None

    med = statistics.median
    rec = dict(
        config=dataclasses.asdict(cfg),
        full_bytes=full_bytes,
        delta_file_bytes=med(delta_bytes),
        delta_save_s=med(delta_s),
        full_save_s=med(full_s),
        chain_load_s=med(chain_load_s),
        full_load_s=med(full_load_s),
    )
    text = [
        f"# Incremental checkpoints: {full_bytes / 1e9:.2f} GB of tensors ({cfg.tables} tables x {cfg.rows} rows "
        f"x dim {cfg.dim}, Adagrad state), {100 * cfg.changed:g}% of the rows changed between the links",
        "",
        markdown_table(
            ["", "incremental", "full", "full / incremental"],
            [
                [
                    "save (s)",
                    f"{rec['delta_save_s']:.3f}",
                    f"{rec['full_save_s']:.3f}",
                    f"{rec['full_save_s'] / rec['delta_save_s']:.1f}x",
                ],
                [
                    "load (s; chain: base + delta)",
                    f"{rec['chain_load_s']:.3f}",
                    f"{rec['full_load_s']:.3f}",
                    f"{rec['full_load_s'] / rec['chain_load_s']:.2f}x",
                ],
            ],
        ),
        "",
        f"Delta link's table file: {rec['delta_file_bytes'] / 1e6:.1f} MB.",
        "",
        f"`python benchmarks/bench_checkpoint_incremental.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
    ]
    print("\n".join(text))
    if save_results:
        save("checkpoint_incremental_cpu", rec, "\n".join(text))


if __name__ == "__main__":
    main()
