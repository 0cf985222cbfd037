"""``python -m torchrec_ext.serve D``: serve the model the training job writes into D
(``python -m torchrec_ext.train --export-deltas-every N --serve-dir D``) over HTTP, following
its exports (see torchrec_ext.serve.http for the endpoints)."""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from torchrec_ext.serve.http import make_http_server
from torchrec_ext.serve.server import Server


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchrec_ext.serve", description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("serve_dir", help="the job's --serve-dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0: any free port (printed)")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between looks for new exports")
    p.add_argument("--wait", action="store_true", help="wait for the job's first model instead of failing")
    p.add_argument("--wait-timeout", type=float, default=None, help="with --wait: give up after this many seconds")
    p.add_argument(
        "--data-type",
        default=None,
        choices=("fp32", "fp16", "bf16", "int8"),
        help="how rows are kept (default: as trained; fp32 rows serve the trained outputs bit for bit)",
    )
    p.add_argument("--capacity-factor", type=float, default=1.25, help="replica rows per table / trained capacity")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.poll_interval <= 0:
        build_parser().error(f"--poll-interval must be > 0, got {args.poll_interval}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    server = Server(args.serve_dir, data_type=args.data_type, capacity_factor=args.capacity_factor)
    try:
        if args.wait:
            server.wait(args.wait_timeout)
        elif not server.load():
            print(
                f"torchrec_ext.serve: error: {args.serve_dir} has no manifest.json yet (the job writes it at "
                "its start; --wait waits for it)",
                file=sys.stderr,
            )
            return 2
        server.poll()
    except (ValueError, TimeoutError) as e:  # DeltaError is a ValueError
        print(f"torchrec_ext.serve: error: {e}", file=sys.stderr)
        return 2
    server.start_following(args.poll_interval)
    http = make_http_server(server, args.host, args.port)
    host, port = http.server_address[:2]
    print(f"torchrec_ext.serve: serving {args.serve_dir} (step {server.step}) on http://{host}:{port}", flush=True)
    try:
        http.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        http.server_close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
