"""Checkpoint throughput and the cost of a non-blocking checkpoint to training, in one process.

Model: TorchRec's DLRM over torchrec_ext's DynamicEmbeddingBagCollection (`tables` tables of
`rows` live rows x `dim`, fused Adagrad, so each row also carries its state) with dense Adagrad;
tables filled by one step over every id, then trained on batches of `batch` samples, bags of
1..7 ids drawn uniformly from the live ids (no inserts, so the state size stays fixed).

- save / load: `save_checkpoint` (building the state dict, DCP write, fsync, SHA-256 of every
  file, manifest) and `load_checkpoint` (verification included; into `state_template(model)`,
  which gathers no row) + `load_state_dict`, median of
  `repeats`, in GB/s of checkpointed tensor bytes, against a plain sequential write (+ fsync) and
  read of the same number of bytes to and from one file in the same directory, timed in the same
  run. Loads are timed twice: from the page cache (the files just written), and from the disk
  (every file's cached pages dropped first with posix_fadvise(DONTNEED), for ours and the plain
  file alike; where the kernel keeps them anyway both read from memory).
- overlap: median train-step time with no checkpoint, against the median over the steps run
  while a `save_checkpoint(blocking=False)` is in flight (the staging copy, taken at the call,
  counted as the first of them), over `repeats` saves.

    python benchmarks/bench_checkpoint.py                     # saves results/checkpoint_cpu.*
    python benchmarks/bench_checkpoint.py --rows 20000 --repeats 1 --no-save   # smoke
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
from common import markdown_table, parse_config, save, tensor_bytes


@dataclasses.dataclass
class ModelConfig:
    """The model ``build`` makes and the batches ``batch`` draws (bench_checkpoint_incremental's too)."""

    tables: int = 8
    rows: int = 262144
    dim: int = 64
    batch: int = 2048


@dataclasses.dataclass
class Config(ModelConfig):
    steps: int = 20
    repeats: int = 3
    dir: str = ""  # where checkpoints go (default: a temporary directory under /tmp)


def build(cfg: ModelConfig):
    from torchrec.models.dlrm import DLRM, DLRMTrain

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    tables = [
        DynamicEmbeddingBagConfig(name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{t}"])
        for t in range(cfg.tables)
    ]
    ebc = DynamicEmbeddingBagCollection(tables, optimizer="adagrad", optimizer_kwargs={"lr": 0.01})
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=[128, cfg.dim],
            over_arch_layer_sizes=[256, 128, 1],
        )
    )
    dense = [p for n, p in model.named_parameters() if "embedding_bag_collection" not in n]
    return model, torch.optim.Adagrad(dense, lr=0.01)


def batch(cfg: ModelConfig, gen: torch.Generator, fill: bool = False):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if fill:  # every id 0..rows-1 of every table once, spread over the bags
        lengths = torch.full((cfg.tables * cfg.batch,), -(-cfg.rows // cfg.batch), dtype=torch.int64)
        ids = torch.arange(int(lengths.sum()) // cfg.tables).remainder(cfg.rows).repeat(cfg.tables)
    else:
        lengths = torch.randint(1, 8, (cfg.tables * cfg.batch,), generator=gen)
        ids = torch.randint(0, cfg.rows, (int(lengths.sum()),), generator=gen)
    return Batch(
        dense_features=torch.randn(cfg.batch, 13, generator=gen),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{t}" for t in range(cfg.tables)], values=ids, lengths=lengths
        ),
        labels=torch.randint(0, 2, (cfg.batch,), generator=gen).float(),
    )


def train_step(model, dense_opt, b) -> float:
    start = time.perf_counter()
    dense_opt.zero_grad()
    loss, _ = model(b)
    loss.backward()
    dense_opt.step()
    return time.perf_counter() - start


def drop_cached(path: str) -> None:
    """Asks the kernel to drop the cached pages of a file, or of every file under a directory
    (written and fsynced, so clean): the next read comes from the disk."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(path: str, tensors: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            buf = bytearray(t.numel() * t.element_size())
            f.readinto(buf)
    return time.perf_counter() - start


def plain_write_read(path: str, tensors: list[torch.Tensor]) -> tuple:
    """Seconds to write the tensors' bytes sequentially to one file (+ fsync), to read them back
    (page cache), and to read them again from the disk."""
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    read = plain_read(path, tensors)
    drop_cached(path)
    cold = plain_read(path, tensors)
    os.remove(path)
    return write, read, cold


def leaves(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in leaves(v)]
    return []


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    from torchrec_ext.distributed.checkpoint import ensure_process_group, load_checkpoint, save_checkpoint
    from torchrec_ext.distributed.checkpoint_template import state_template

    ensure_process_group()
    root = cfg.dir or tempfile.mkdtemp(prefix="bench_checkpoint_")
    gen = torch.Generator().manual_seed(0)
    model, dense_opt = build(cfg)
    train_step(model, dense_opt, batch(cfg, gen, fill=True))
    for _ in range(3):  # warm-up
        train_step(model, dense_opt, batch(cfg, gen))

    def state():
        return {"model": model.state_dict(), "dense_optim": dense_opt.state_dict()}

    nbytes = tensor_bytes(state())
    step_no = 0
    save_s, load_s, cold_load_s, write_s, read_s, cold_read_s = [], [], [], [], [], []
    for _ in range(cfg.repeats):
        step_no += 1
        start = time.perf_counter()
        path = save_checkpoint(root, step_no, state(), keep=1)
        save_s.append(time.perf_counter() - start)
        for times in (load_s, cold_load_s):
            if times is cold_load_s:
                drop_cached(path)
            start = time.perf_counter()
            loaded = load_checkpoint(path, {"model": state_template(model), "dense_optim": dense_opt.state_dict()})
            model.load_state_dict(loaded["model"])
            times.append(time.perf_counter() - start)
        w, r, c = plain_write_read(os.path.join(root, "plain.bin"), leaves(state()))
        write_s.append(w)
        read_s.append(r)
        cold_read_s.append(c)

    batches = [batch(cfg, gen) for _ in range(cfg.steps)]
    quiet = [train_step(model, dense_opt, b) for b in batches]
    during: list[float] = []
    overlapped: list[int] = []
    for _ in range(cfg.repeats):
        step_no += 1
        start = time.perf_counter()
        pending = save_checkpoint(root, step_no, state(), keep=1, blocking=False)
        staging = time.perf_counter() - start
        times = []
        while not pending.done():
            times.append(train_step(model, dense_opt, batches[len(times) % len(batches)]))
        pending.wait()
        if times:
            times[0] += staging
        during += times
        overlapped.append(len(times))
    shutil.rmtree(root, ignore_errors=True) if not cfg.dir else None

    gb = nbytes / 1e9
    med = statistics.median
    rec = dict(
        config=dataclasses.asdict(cfg),
        checkpoint_bytes=nbytes,
        save_gbps=gb / med(save_s),
        load_gbps=gb / med(load_s),
        load_from_disk_gbps=gb / med(cold_load_s),
        plain_write_gbps=gb / med(write_s),
        plain_read_gbps=gb / med(read_s),
        plain_read_from_disk_gbps=gb / med(cold_read_s),
        step_quiet_s=med(quiet),
        step_during_save_s=med(during) if during else None,
        steps_overlapped=overlapped,
    )
    rows = [
        [
            "save (blocking)",
            f"{rec['save_gbps']:.3f}",
            f"{rec['plain_write_gbps']:.3f}",
            f"{rec['save_gbps'] / rec['plain_write_gbps']:.2f}",
        ],
        [
            "load (page cache)",
            f"{rec['load_gbps']:.3f}",
            f"{rec['plain_read_gbps']:.3f}",
            f"{rec['load_gbps'] / rec['plain_read_gbps']:.2f}",
        ],
        [
            "load (from disk)",
            f"{rec['load_from_disk_gbps']:.3f}",
            f"{rec['plain_read_from_disk_gbps']:.3f}",
            f"{rec['load_from_disk_gbps'] / rec['plain_read_from_disk_gbps']:.2f}",
        ],
    ]
    text = [
        f"# Checkpoints: {gb:.2f} GB of tensors ({cfg.tables} tables x {cfg.rows} rows x dim {cfg.dim}, "
        "Adagrad state, DLRM dense part)",
        "",
        markdown_table(["", "ours GB/s", "plain file GB/s", "ratio"], rows),
        "",
    ]
    if during:
        text += [
            markdown_table(
                ["train step", "median ms"],
                [
                    ["no checkpoint", f"{1e3 * rec['step_quiet_s']:.1f}"],
                    ["non-blocking checkpoint in flight", f"{1e3 * rec['step_during_save_s']:.1f}"],
                    ["ratio", f"{rec['step_during_save_s'] / rec['step_quiet_s']:.2f}"],
                ],
            ),
            "",
            f"Steps overlapped per save: {overlapped}.",
        ]
    else:
        text.append("The non-blocking saves ended before a step could run.")
    text += ["", f"`python benchmarks/bench_checkpoint.py {' '.join(sys.argv[1:])}`".replace(" `", "`")]
    print("\n".join(text))
    if save_results:
        save("checkpoint_cpu", rec, "\n".join(text))


if __name__ == "__main__":
    main()
