"""The serving replica over HTTP (stdlib ``http.server``, one thread per connection):

    POST /predict   {"dense": [[float] * dense_in] * batch,
                     "sparse": {feature: [[id, ...] per sample]}}   (features left out: no ids)
                 -> {"scores": [float] * batch, "step": k, "seq": n}  (click probabilities)
    GET  /status -> Server.status(): generation, applied export and step, live rows, lag, last error

A malformed request is answered 400 with {"error": why}; 503 until the server has a model.
"""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext.serve.server import Server

MAX_BODY = 64 << 20


def batch_from_json(request: Any, feature_names: list[str], dense_in: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    """(dense features [batch, dense_in], the sparse features' KJT) of a /predict body; ValueError
    naming the field otherwise."""
    if not isinstance(request, dict) or "dense" not in request:
        raise ValueError('the body must be a JSON object with "dense" (and "sparse")')
    try:
        dense = torch.tensor(request["dense"], dtype=torch.float32, device="cpu")
    except (TypeError, ValueError) as e:
        raise ValueError(f'"dense" must be a list of lists of numbers ({e})') from None
    if dense.dim() != 2 or dense.shape[1] != dense_in or dense.shape[0] < 1:
        raise ValueError(f'"dense" must be [batch >= 1][{dense_in}] numbers, got shape {list(dense.shape)}')
    if not bool(torch.isfinite(dense).all()):
        raise ValueError('"dense" must hold finite numbers')
    batch = dense.shape[0]
    sparse = request.get("sparse", {})
    if not isinstance(sparse, dict):
        raise ValueError('"sparse" must be an object: feature name -> one list of ids per sample')
    unknown = sorted(set(sparse) - set(feature_names))
    if unknown:
        raise ValueError(
            f'"sparse" names features {unknown[:5]} the model does not have (it has {feature_names[:3]}...)'
        )
    lengths, values = [], []
    for name in feature_names:
        bags = sparse.get(name, [[]] * batch)
        if not isinstance(bags, list) or len(bags) != batch:
            raise ValueError(f'"sparse"[{name!r}] must be {batch} lists of ids (one per sample)')
        for bag in bags:
            if not isinstance(bag, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in bag):
                raise ValueError(f'"sparse"[{name!r}] must hold lists of integer ids')
            if any(not -(2**63) <= i < 2**63 for i in bag):
                raise ValueError(f'"sparse"[{name!r}] ids must be int64')
            lengths.append(len(bag))
            values.extend(bag)
    kjt = KeyedJaggedTensor(
        keys=feature_names,
        values=torch.tensor(values, dtype=torch.int64, device="cpu"),
        lengths=torch.tensor(lengths, dtype=torch.int64, device="cpu"),
        stride=batch,
    )
    return dense, kjt


def make_http_server(server: Server, host: str = "127.0.0.1", port: int = 8080) -> ThreadingHTTPServer:
    """An HTTP server answering for ``server`` (port 0: any free one; ``.server_address`` says which).
    Run it with ``serve_forever()`` (in a thread of its own if the caller goes on)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise
            pass

        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/status":
                self._reply(200, server.status())
            else:
                self._reply(404, {"error": f"no {self.path}: GET /status, POST /predict"})

        def do_POST(self) -> None:
            if self.path != "/predict":
                self._reply(404, {"error": f"no {self.path}: GET /status, POST /predict"})
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._reply(400, {"error": f"Content-Length must be in [1, {MAX_BODY}], got {length}"})
                return
            body = self.rfile.read(length)
            if not server.ready:
                self._reply(503, {"error": "no model yet"})
                return
            try:
                request = json.loads(body)
                dense, kjt = batch_from_json(request, server.feature_names(), server.dense_in_features())
            except ValueError as e:  # json errors are ValueErrors too
                self._reply(400, {"error": str(e)})
                return
            scores = server.predict(dense, kjt)
            self._reply(200, {"scores": scores.tolist(), "step": server.step, "seq": server.seq})

    return ThreadingHTTPServer((host, port), Handler)
