"""Pieces of the main training job (``python -m torchrec_ext.train``): process groups and
device, data streams, model building and sharding, evaluation, checkpoints and the run report."""
