"""Registers a thread of the pooled lookup kernel takes on an H100 (sm_90), over every tile
``pooled_lookup`` launches: compiled here, without a GPU, by the installed Triton and its ptxas
(sm90.py). Registers bound the programs an SM holds, hence the row loads in flight.

    PYTHONPATH=$PWD python benchmarks/count_pooled_registers.py --save
    PYTHONPATH=/path/to/triton-3.7:$PWD python benchmarks/count_pooled_registers.py --save

The sweep: widest dims 1..512, mean bags 1..40, every ALIGN a dim allows, half tables or not;
the variants with the same tile, ALIGN and dtypes compile once. Per Triton version and kernel:
the largest and mean registers, the tiles that spill, that keep fewer than three programs of
their warps an SM (> 65536 / (3 x threads) registers) and that take over 96, and the worst five.
``--save`` appends the record to results/pooled_registers_sm90.jsonl and writes the .md with one
row per saved record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
from common import RESULTS_DIR, markdown_table, save
from sm90 import pooled_lookup_registers

from torchrec_ext.triton_kernels import embedding_lookup as el

DIMS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100, 128, 192, 256, 512]
MEAN_BAGS = [1, 2, 3, 5, 10, 20, 40]
NAME = "pooled_registers_sm90"


def variants() -> list[tuple[int, int, bool, int]]:
    """(widest dim, mean bag, half tables, ALIGN), one for each distinct compile."""
    first = {}
    for dim in DIMS:
        for bag in MEAN_BAGS:
            for align in (1, 2, 4, 8):
                for half in (True, False):
                    if dim % align == 0:
                        first.setdefault((el._pooled_blocks(dim, bag, align), align, half), (dim, bag, half, align))
    return list(first.values())


def summary(got: dict[str, list[int]]) -> dict[str, object]:
    regs = [r for r, _, _ in got.values()]
    return {
        "tiles": len(got),
        "max": max(regs),
        "mean": round(sum(regs) / len(regs), 1),
        "spilled": sum(1 for _, _, spilled in got.values() if spilled),
        "under_3_programs": sum(1 for r, warps, _ in got.values() if r * 3 * warps * 32 > 65536),
        "over_96": sum(1 for r in regs if r > 96),
        "worst": sorted(got.items(), key=lambda kv: -kv[1][0])[:5],
    }


def kernel_commit() -> str:
    """The commit of the kernel's file, with '+' when it differs from that commit."""
    path = el.__file__
    head = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", path], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", path]).returncode != 0
    return (head or "?") + ("+" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", action="store_true", help=f"append to results/{NAME}.jsonl, rewrite the .md")
    args = parser.parse_args()
    got = {",".join(map(str, v)): pooled_lookup_registers(*v) for v in variants()}
    record = {"triton": triton.__version__, "kernel": kernel_commit(), **summary(got)}
    header = [
        "triton",
        "kernel",
        "tiles",
        "max",
        "mean",
        "spilled",
        "< 3 programs/SM",
        "> 96",
        "worst (dim,bag,half,ALIGN: regs)",
    ]

    def row(r):
        worst = ", ".join(f"{k}: {v[0]}" for k, v in r["worst"])
        return [
            r["triton"],
            r["kernel"],
            r["tiles"],
            r["max"],
            r["mean"],
            r["spilled"],
            r["under_3_programs"],
            r["over_96"],
            worst,
        ]

    print(markdown_table(header, [row(record)]))
    if args.save:
        path = os.path.join(RESULTS_DIR, f"{NAME}.jsonl")
        earlier = []
        if os.path.exists(path):
            with open(path) as f:
                earlier = [json.loads(line) for line in f]
        text = "# Pooled lookup registers on sm_90, compiled without a GPU\n\n" + (__doc__.split("\n\n")[2]).strip()
        text += "\n\n" + markdown_table(header, [row(r) for r in [*earlier, record]])
        save(NAME, record, text)


if __name__ == "__main__":
    main()
