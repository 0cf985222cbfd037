"""Online serving: a replica of the training job's model that follows its deltas.

``python -m torchrec_ext.serve D`` (``Server`` in ``server.py``, the HTTP endpoint in
``http.py``) builds the serving model (``torchrec_ext.inference``) from the base checkpoint the
job wrote into D (``python -m torchrec_ext.train --export-deltas-every N --serve-dir D``, see
torchrec_ext.train.serve_export for the layout), then follows D: it applies each new export (every
rank's row delta and the dense parameters) in order, refusing a missing or out-of-order one, while
it answers requests. The top layer: it imports the job's format; nothing in torchrec_ext imports it.
"""

from torchrec_ext.serve.server import Server

__all__ = ["Server"]
