"""The training job, ``python -m torchrec_ext.train``: DLRM_DCN on dynamic embedding tables in
DistributedModelParallel, with evals, checkpoints, ``--resume`` and a run report (``job``), its
pieces (``args``: the command line; ``runtime``: process groups and device; ``data``: train and
held-out streams; ``model``: the model, its sharding and optimizer; ``loop``: the train loops;
``metrics``: AUC and log loss; ``resume``: what a checkpoint holds; ``run_lock``: the run
directory; ``progress``, ``report``: the console and the files left behind) and its torchx
component (``components.py``) and its feed to serving (``serve_export``). Only torchrec_ext.serve,
above it, imports it.

Importing the package imports none of them (a spawned rank that needs only ``runtime`` does not
pay for torchrec): ``from torchrec_ext.train.job import main``."""
