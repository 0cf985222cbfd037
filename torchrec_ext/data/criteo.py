"""Reader of Criteo-format TSV files (the Kaggle display-ads / Criteo 1TB click logs).

Each line: label, 13 integer features (may be empty or negative), 26 categorical features
written as hex strings of 32-bit hashes (may be empty), tab-separated, no header. A batch is a
`torchrec.datasets.utils.Batch`:

- dense_features [B, 13] float32: log(1 + max(x, 0)), an empty field counting as 0;
- sparse_features: KeyedJaggedTensor with keys cat_0..cat_25, one id per non-empty field (the
  hex value as a raw int64; values in [2^63, 2^64) wrap to negative), an empty field giving an
  empty bag;
- labels [B] float32.

    for batch in CriteoTsvReader(["day_0.tsv", "day_1.tsv"], batch_size=4096, drop_last=True):
        ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset

INT_FEATURE_COUNT = 13
CAT_FEATURE_COUNT = 26
DEFAULT_INT_NAMES = [f"int_{i}" for i in range(INT_FEATURE_COUNT)]
DEFAULT_CAT_NAMES = [f"cat_{i}" for i in range(CAT_FEATURE_COUNT)]


def parse_criteo_lines(lines: Sequence[str], has_label: bool = True, locate: Callable[[int], str] | None = None):
    """One Batch from Criteo TSV lines (trailing newlines allowed). Without a label column
    (Kaggle's test.txt) labels are zeros. `locate(i)` names lines[i] in error messages (default:
    "line <i + 1>")."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    locate = locate or (lambda i: f"line {i + 1}")
    ncol = INT_FEATURE_COUNT + CAT_FEATURE_COUNT + int(has_label)
    rows = []
    for i, line in enumerate(lines):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != ncol:
            raise ValueError(
                f"{locate(i)}: expected {ncol} tab-separated fields "
                f"({'label, ' if has_label else ''}13 integers, 26 categories), got {len(fields)}"
            )
        rows.append(fields)
    n = len(rows)
    cols: list[tuple[str, ...]] = list(zip(*rows)) if rows else [()] * ncol
    first = int(has_label)

    def column(c: int, what: str, convert: Callable[[str], object]) -> list:
        try:
            return [convert(s) for s in cols[c]]
        except ValueError:
            for i, s in enumerate(cols[c]):
                try:
                    convert(s)
                except ValueError:
                    raise ValueError(f"{locate(i)}: field {c} ({what}) is not valid: {s!r}") from None
            raise

    labels = (
        torch.tensor(column(0, "label", float), dtype=torch.float32, device="cpu")
        if has_label
        else torch.zeros(n, device="cpu")
    )
    ints = torch.tensor(
        [column(first + j, f"integer feature {j}", lambda s: int(s) if s else 0) for j in range(INT_FEATURE_COUNT)],
        dtype=torch.float64,
        device="cpu",
    ).reshape(INT_FEATURE_COUNT, n)
    dense = torch.log1p(ints.clamp(min=0)).t().contiguous().float()

    values, lengths = [], []
    for j in range(CAT_FEATURE_COUNT):
        c = first + INT_FEATURE_COUNT + j
        col = cols[c]
        ids = column(c, f"category {j}", lambda s: int(s, 16) if s else None)
        present = [v for v in ids if v is not None]
        if any(v < 0 or v >> 64 for v in present):
            i = next(i for i, v in enumerate(ids) if v is not None and (v < 0 or v >> 64))
            raise ValueError(f"{locate(i)}: field {c} (category {j}) must be hex in [0, 2^64), got {col[i]!r}")
        values.append(np.array(present, dtype=np.uint64).view(np.int64))
        lengths.append([v is not None for v in ids])
    sparse = KeyedJaggedTensor(
        keys=list(DEFAULT_CAT_NAMES),
        values=torch.from_numpy(np.concatenate(values)) if n else torch.empty(0, dtype=torch.int64, device="cpu"),
        lengths=torch.tensor(lengths, dtype=torch.int32, device="cpu").reshape(-1),
    )
    return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


class CriteoTsvReader(IterableDataset):
    """Batches of `batch_size` rows read in order from one or more Criteo TSV files (a batch may
    span two files); blank lines are skipped. `drop_last` drops a final partial batch.

    Sharding: rank r of `world_size` gets global batches r, r + world_size, ... and every rank
    gets the same number (needs drop_last=True, and one counting pass over the files);
    DataLoader workers split a rank's batches the same way.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        batch_size: int,
        *,
        drop_last: bool = False,
        has_label: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not paths:
            raise ValueError("CriteoTsvReader: paths must name at least one file, got none")
        for p in paths:
            if not os.path.isfile(p):
                raise ValueError(f"CriteoTsvReader: paths: no such file: {os.fspath(p)!r}")
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"CriteoTsvReader: batch_size must be an int >= 1, got {batch_size!r}")
        if not (isinstance(world_size, int) and world_size >= 1):
            raise ValueError(f"CriteoTsvReader: world_size must be an int >= 1, got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"CriteoTsvReader: rank must be an int in [0, world_size = {world_size}), got {rank!r}")
        if world_size > 1 and not drop_last:
            raise ValueError(
                "CriteoTsvReader: world_size > 1 needs drop_last=True (every rank must get "
                "the same number of full batches)"
            )
        self.paths = [os.fspath(p) for p in paths]
        self.batch_size, self.drop_last, self.has_label = batch_size, drop_last, has_label
        self.rank, self.world_size = rank, world_size
        self._rows: int | None = None

    def num_rows(self) -> int:
        """Non-blank lines over all files (counted once)."""
        if self._rows is None:
            rows = 0
            for p in self.paths:
                with open(p, "rb") as f:
                    rows += sum(1 for line in f if line.strip(b"\r\n"))
            self._rows = rows
        return self._rows

    def _num_global_batches(self) -> int:
        """Global batches to hand out: all of them for one rank, a multiple of world_size otherwise."""
        full, rest = divmod(self.num_rows(), self.batch_size)
        if self.world_size > 1:
            return full - full % self.world_size
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return len(range(self.rank, self._num_global_batches(), self.world_size))

    def __iter__(self) -> Iterator:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        limit = self._num_global_batches() if self.world_size > 1 else None
        step = self.world_size * workers
        mine = self.rank + self.world_size * worker  # global batch g is ours when g % step == mine
        lines: list[str] = []
        where: list[tuple[str, int]] = []  # (path, line number) of each buffered line, for errors
        g = 0
        for path in self.paths:
            with open(path, encoding="utf-8", newline="") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip("\r\n"):
                        continue
                    lines.append(line)
                    where.append((path, lineno))
                    if len(lines) == self.batch_size:
                        if limit is not None and g >= limit:
                            return
                        if g % step == mine:
                            yield parse_criteo_lines(lines, self.has_label, _locator(where))
                        g += 1
                        lines, where = [], []
        if lines and not self.drop_last and limit is None and g % step == mine:
            yield parse_criteo_lines(lines, self.has_label, _locator(where))


def _locator(where: list[tuple[str, int]]) -> Callable[[int], str]:
    return lambda i: f"{where[i][0]}:{where[i][1]}"
