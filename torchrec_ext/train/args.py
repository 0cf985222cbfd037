"""The job's command line: ``build_parser()`` (every flag, grouped as ``--help`` shows them) and
``parse_args()``, which checks the values and resolves defaults that depend on other flags
(``--embedding-lr``, the held-out data)."""

from __future__ import annotations

import argparse
import math

from torchrec.modules.embedding_configs import DataType

from torchrec_ext.modules import DynamicEmbeddingBagConfig
from torchrec_ext.modules.configs import check_tables
from torchrec_ext.train.board import tensorboard_missing
from torchrec_ext.train.data import parse_data_spec

DESCRIPTION = (
    "The main training job: TorchRec's DLRM_DCN on torchrec_ext.DynamicEmbeddingBagCollection (26 dynamic tables, "
    "one per sparse feature, keyed by raw 64-bit ids), wrapped in DistributedModelParallel, trained with fused "
    "Adagrad on the tables and dense Adagrad."
)
PIPELINES = ("ours", "torchrec", "plain")
DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer sizes, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer sizes must be >= 1, got {text!r}")
    return sizes


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of the job, in the groups ``--help`` shows."""
    p = argparse.ArgumentParser(
        prog="python -m torchrec_ext.train", description=DESCRIPTION, formatter_class=_DefaultsHelpFormatter
    )
    _add_data_args(p.add_argument_group("data"))
    _add_model_args(p.add_argument_group("model"))
    _add_training_args(p.add_argument_group("training"))
    _add_output_args(p.add_argument_group("evaluation, checkpoints, output"))
    return p


def table_options(args: argparse.Namespace) -> dict:
    """The dynamic-table fields the table flags set (DynamicEmbeddingBagConfig keywords), checked by
    building one config (its error names the field and value)."""
    counted = args.admission in ("counter", "bloom")
    if args.admit_after is not None and not counted:
        raise ValueError(f"--admit-after applies to --admission counter or bloom, got --admission {args.admission}")
    if args.admit_probability is not None and args.admission != "probabilistic":
        raise ValueError(f"--admit-probability applies to --admission probabilistic, got --admission {args.admission}")
    if args.bloom_fpr is not None and args.admission != "bloom":
        raise ValueError(f"--bloom-fpr applies to --admission bloom, got --admission {args.admission}")
    options = _backing_options(args)
    if args.round_to_nearest and args.data_type == "fp32":
        raise ValueError("--round-to-nearest applies to --data-type fp16 or bf16, got --data-type fp32")
    options["data_type"] = DATA_TYPES[args.data_type]
    if args.round_to_nearest:
        options["stochastic_rounding"] = False
    if args.admission != "none":
        options["admission"] = args.admission
    if counted:
        options["admit_after"] = 2 if args.admit_after is None else args.admit_after
    if args.admission == "bloom":
        options["bloom_fpr"] = 0.01 if args.bloom_fpr is None else args.bloom_fpr
    if args.fallback_rows is not None:
        options["fallback_rows"] = args.fallback_rows
    if args.admission == "probabilistic":
        if args.admit_probability is None:
            raise ValueError("--admission probabilistic needs --admit-probability (in (0, 1])")
        options["admit_probability"] = args.admit_probability
    probe = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=args.embedding_dim, num_embeddings=max(1, args.capacity), feature_names=["f"], **options
    )
    check_tables([probe], DynamicEmbeddingBagConfig, "the tables")
    return options


def _backing_options(args: argparse.Namespace) -> dict:
    """``--backing`` / ``--cache-load-factor`` / ``--cache-algorithm`` as config fields (none for the
    default, device backing)."""
    backing, factor, algorithm = args.backing, args.cache_load_factor, args.cache_algorithm
    if not (backing in ("device", "host") or (backing.startswith("file:") and len(backing) > len("file:"))):
        raise ValueError(f"--backing must be device, host or file:<dir>, got --backing {backing!r}")
    if backing == "device":
        for flag, value in (("--cache-load-factor", factor), ("--cache-algorithm", algorithm)):
            if value is not None:
                raise ValueError(
                    f"{flag} applies to --backing host or file:<dir>, got {flag} {value} with --backing device"
                )
        return {}
    if factor is not None and not (math.isfinite(factor) and 0 < factor <= 1):
        raise ValueError(f"--cache-load-factor must be a number in (0, 1], got --cache-load-factor {factor}")
    options = {"backing": backing}
    if factor is not None:
        options["cache_load_factor"] = factor
    if algorithm is not None:
        options["cache_algorithm"] = algorithm
    return options


def _add_data_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data", default="synthetic", help="'synthetic' or 'criteo-tsv:PATH[,PATH...]'")
    g.add_argument(
        "--eval-data",
        default=None,
        help="held-out data, same forms as --data (default: synthetic: a held-out stream of the same "
        "hidden model; criteo-tsv: the last --eval-batches batches of each rank's share of --data)",
    )
    g.add_argument("--batch-size", type=int, default=512, help="samples per step per rank")
    g.add_argument(
        "--eval-batch-size",
        type=int,
        default=2048,
        help="samples per eval batch per rank (criteo-tsv held out of --data: --batch-size)",
    )
    g.add_argument("--eval-batches", type=int, default=8, help="eval batches per rank (0: no eval)")
    g.add_argument("--truth-seed", type=int, default=0, help="synthetic: the hidden click model")
    g.add_argument("--eval-seed", type=int, default=999_999, help="synthetic: the held-out stream")


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--embedding-dim", type=int, default=16, help="every table's vector width")
    g.add_argument("--capacity", type=int, default=100_000, help="rows per dynamic table")
    g.add_argument(
        "--eviction",
        default="lru",
        choices=("lru", "lfu", "epoch_lru", "epoch_lfu", "none"),
        help="which row a full table gives a new id (none: it refuses new ids)",
    )
    g.add_argument(
        "--fallback-rows",
        type=int,
        default=None,
        help="K learned fallback rows per table, read by ids without a row (default: none, they read zeros)",
    )
    g.add_argument("--dense-arch", type=_sizes, default=[64], help="dense arch hidden sizes (then embedding-dim)")
    g.add_argument("--over-arch", type=_sizes, default=[128, 64], help="over arch hidden sizes (then 1)")
    g.add_argument("--dcn-layers", type=int, default=2, help="DCN cross layers")
    g.add_argument("--dcn-rank", type=int, default=16, help="DCN low-rank dimension")
    g.add_argument("--data-type", default="fp32", choices=tuple(DATA_TYPES), help="the tables' row storage")
    g.add_argument(
        "--round-to-nearest",
        action="store_true",
        help="fp16 / bf16: the fused update rounds rows to nearest (default: stochastically)",
    )
    g.add_argument(
        "--backing",
        default="device",
        help="where each table's rows live: device (all in the module's buffer), host (host memory) or "
        "file:<dir> (files in an existing directory); host and file keep only --cache-load-factor of the "
        "rows hot in a cache, staged ahead of each step by --pipeline ours",
    )
    g.add_argument(
        "--cache-load-factor",
        type=float,
        default=None,
        help="--backing host / file:<dir>: the fraction of each table's rows kept in its cache (default: chosen "
        "by the planner from the memory budget)",
    )
    g.add_argument(
        "--cache-algorithm",
        default=None,
        choices=("lru", "lfu"),
        help="--backing host / file:<dir>: which rows leave the cache first: the least recently used (lru, "
        "the default) or the least often used (lfu; CacheParams.algorithm)",
    )
    g.add_argument(
        "--admission",
        default="none",
        choices=("none", "counter", "bloom", "probabilistic"),
        help="which unseen ids get a row (DynamicEmbeddingBagConfig.admission)",
    )
    g.add_argument(
        "--admit-after", type=int, default=None, help="counter / bloom: sightings before an id gets a row (default 2)"
    )
    g.add_argument("--admit-probability", type=float, default=None, help="probabilistic: the fraction admitted")
    g.add_argument(
        "--bloom-fpr", type=float, default=None, help="bloom: the filter's false-positive target (default 0.01)"
    )


def _add_training_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--steps", type=int, default=2000, help="total training steps (a resumed run continues to it)")
    g.add_argument("--lr", type=float, default=0.02, help="dense Adagrad learning rate")
    g.add_argument("--embedding-lr", type=float, default=None, help="fused Adagrad learning rate (default: --lr)")
    g.add_argument("--seed", type=int, default=0, help="model initialisation and the synthetic train stream")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    g.add_argument(
        "--pipeline",
        default="ours",
        choices=PIPELINES,
        help="ours: torchrec_ext.pipeline.TrainPipeline; torchrec: TrainPipelineSparseDist; "
        "plain: forward, backward, step",
    )
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads per rank (default: torch's)")
    g.add_argument(
        "--collective-timeout",
        type=float,
        default=300.0,
        help="seconds a rank waits in a collective for its peers before the job fails",
    )


def _add_output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--eval-every", type=int, default=250, help="eval every N steps (0: only at start and end)")
    g.add_argument("--run-dir", default=None, help="output directory (default: runs/<timestamp>)")
    g.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps and at the end (0: never)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (0: all)")
    g.add_argument(
        "--checkpoint-incremental",
        type=int,
        default=0,
        metavar="N",
        help="write checkpoints as a base, then deltas holding only the rows changed since the previous "
        "checkpoint; a new base every N checkpoints (0: every checkpoint whole). Incremental checkpoints "
        "block (see torchrec_ext.distributed.checkpoint_incremental)",
    )
    g.add_argument(
        "--blocking-checkpoints",
        action="store_true",
        help="write each checkpoint before training goes on (default: the tables are copied at the step "
        "and written in the background while training continues; the one at the end always blocks)",
    )
    g.add_argument(
        "--export-deltas-every",
        type=int,
        default=0,
        help="feed a serving replica: every N steps each rank writes its row delta and rank 0 the dense "
        "parameters into --serve-dir, after a base checkpoint at the start (0: never; see "
        "torchrec_ext.train.serve_export, and python -m torchrec_ext.serve to follow it)",
    )
    g.add_argument(
        "--serve-dir", default=None, help="where --export-deltas-every writes (a serving process follows it)"
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --run-dir (from step 0 when there is none)",
    )
    g.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="rank 0 writes TensorBoard event files into DIR: train loss, evals and the tables' stats through "
        "TorchRec's RecMetricModule (needs the tensorboard package)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--verbose", action="store_true", help="keep TorchRec's and torch's advisory warnings")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, low in (
        ("steps", 0),
        ("batch_size", 1),
        ("eval_batch_size", 1),
        ("eval_batches", 0),
        ("embedding_dim", 1),
        ("capacity", 1),
        ("dcn_layers", 0),
        ("dcn_rank", 1),
        ("eval_every", 0),
        ("checkpoint_every", 0),
        ("keep_checkpoints", 0),
        ("checkpoint_incremental", 0),
        ("export_deltas_every", 0),
    ):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.fallback_rows is not None and args.fallback_rows < 1:
        parser.error(f"--fallback-rows must be >= 1, got {args.fallback_rows}")
    if args.tensorboard is not None and tensorboard_missing():
        parser.error(tensorboard_missing())
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if not (math.isfinite(args.collective_timeout) and args.collective_timeout > 0):
        parser.error(f"--collective-timeout must be a finite number > 0, got {args.collective_timeout}")
    for name in ("lr", "embedding_lr"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.embedding_lr is None:
        args.embedding_lr = args.lr
    try:
        args.data_spec = parse_data_spec(args.data, "--data")
        args.eval_spec = parse_data_spec(args.eval_data, "--eval-data") if args.eval_data else None
    except ValueError as e:
        parser.error(str(e))
    if args.data_spec.kind == "synthetic":
        if args.eval_spec is None:
            args.eval_spec = args.data_spec
        if args.eval_spec == args.data_spec and args.eval_seed == args.seed:
            parser.error(
                f"--eval-seed must differ from --seed (the held-out stream would be the train stream), "
                f"both are {args.seed}"
            )
    elif args.eval_spec is None:
        args.eval_spec = args.data_spec  # held out: the last --eval-batches batches of each rank
    try:
        args.table_options = table_options(args)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    if args.export_deltas_every and not args.serve_dir:
        parser.error(f"--export-deltas-every {args.export_deltas_every} needs --serve-dir (where the deltas go)")
    if args.serve_dir and not args.export_deltas_every:
        parser.error("--serve-dir applies with --export-deltas-every N (N >= 1)")
    if args.resume and args.run_dir is None:
        parser.error("--resume needs --run-dir (the directory of the run to continue)")
    return args
