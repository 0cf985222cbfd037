"""A train pipeline for DistributedModelParallel models, built on TorchRec's
``TrainPipelineSparseDist`` (model rewriting, pipelined forwards, fused input-dist splits) and
adding what it leaves on the table:

(a) a pool of threads that pull batches ahead, pin them and copy them to the device on their
    own copy streams (``BatchPrefetcher``);
(b) the sparse input distribution of batch i+1 launched from a helper thread, overlapping batch
    i's step, after the batch's copy, on a stream of its own (batch i's forward waits for batch
    i's input dist by its event, not for batch i+1's) and its own process group (a clone of the
    modules' group: two threads issuing collectives on one group would interleave them
    differently on each rank; borrowed from a per-process pool, so a pipeline per segment does
    not add a group per segment). Not where those collectives run on NCCL with peers (CUDA,
    world size > 1): NCCL needs every rank to launch the collectives of all communicators of a
    GPU in one order, which two threads cannot keep; there the train thread launches it, on
    its own stream, in TorchRec's pipeline's order: the counts' exchange before batch i's
    forward, their wait (a host read) and the data's exchange after it;
(c) the dense gradients all-reduced in one flat buffer instead of by DDP's buckets, that work (and
    the dense optimizer step when capturable) captured in a CUDA graph, and chosen dense
    submodules' forward + backward captured too (static shapes; other shapes run eagerly); the
    graphs belong to the model (shared by its pipelines), and each capture parks the helper
    threads first (``device_gate.DEVICE_WORK``, which the tiered tables' stage worker takes too);
(d) the embedding backward and fused update, run by autograd as usual;
(e) each step's outputs copied to pinned host memory on a side stream and surfaced by
    ``pop_host_outputs()`` once copied: no device-wide synchronisation per step;
(f) tiered tables (host or file backing): batch i+1's rows staged into each table's cache while
    batch i computes (``stage_next``: a worker thread, started once batch i's lookup has its
    rows), so batch i+1's lookup finds them cached; ``tier_step_stats()`` tells what moved.

On CPU the same API gives the same results: the threads still overlap batch preparation and
input distribution; streams, graphs and pinned memory are skipped. Every stage can be switched
off to bisect a problem. Losses and parameters equal a plain ``loss.backward(); opt.step()``
loop on the same data.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _rewrite_model,
    _start_data_dist,
    use_context_for_postprocs,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext.modules.tiered_tables import TieredTables
from torchrec_ext.pipeline import groups
from torchrec_ext.pipeline.dense_sync import DdpTakeover, FlatGradSync, GraphedForward
from torchrec_ext.pipeline.host_outputs import HostOutputs
from torchrec_ext.pipeline.prefetch import BatchPrefetcher, ReadyBatch, copy_to_device
from torchrec_ext.pipeline.quiesce import DEVICE_WORK
from torchrec_ext.pipeline.streams import device_streams, record_event
from torchrec_ext.pipeline.worker import HelperThread

logger = logging.getLogger(__name__)
_CLOSE_ON_ERROR_S = 5.0  # wait for the threads when a with-block exits on an exception


@dataclasses.dataclass
class PipelineOptions:
    """Switches for each stage (defaults: everything on that the device supports)."""

    # (a) threads loading batches ahead; 0: load inline on the train thread. (b) launch input
    # dists from a helper thread. None: on where they have a core to run on — always on CUDA
    # (the train thread mostly waits on the GPU); on CPU only if this rank has cores beyond its
    # intra-op threads (measured on 2 cores / 2 ranks: helper threads there cost 2-6 %). (b) is
    # off, and True refused, where the input dist runs on NCCL with peers (see the module doc).
    prefetch_threads: int | None = None
    prefetch_depth: int | None = None  # batches ahead; default 2 per thread
    threaded_input_dist: bool | None = None
    # (c) all-reduce dense grads in one flat buffer after the backward (False: DDP's buckets).
    # None: on CUDA, where the flat buffer is what a graph can capture; on CPU DDP's buckets
    # overlap their all-reduce with the backward, which a flat one cannot.
    flat_dense_allreduce: bool | None = None
    graph_dense_sync: bool = True  # (c) CUDA only: capture that all-reduce in a CUDA graph
    graph_optimizer_step: bool = False  # (c) CUDA only: capture the dense optimizer step too
    graph_modules: Sequence[str] = dataclasses.field(default_factory=tuple)  # (c) dense submodules to capture
    pinned_outputs: bool = True  # (e) CUDA only: pinned D2H copies of step outputs
    timeout_s: float = 600.0  # bound on every wait for a worker
    # (f) stage the next batch's rows into the caches of tiered tables (host or file backing)
    tier_prefetch: bool = True


def _spare_cores(device: torch.device) -> bool:
    """Whether helper threads get a core of their own: always on CUDA; on CPU when this rank's
    share of the machine's cores exceeds its intra-op threads."""
    if device.type == "cuda":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return cores // max(local_ranks, 1) > torch.get_num_threads()


class _InputDistAbandoned(RuntimeError):
    """A deferred input dist's second half that will never run (the pipeline closed after a
    forward raised): the stage waiting for it stages nothing, rather than fail the tables' next call."""


def _sharding_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group the model's sharded modules (and so their input dists) run on: DMP's, else the
    default group (None when there is none)."""
    group = getattr(getattr(model, "_env", None), "process_group", None)
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return group


def _input_dist_on_nccl(model: nn.Module, device: torch.device) -> bool:
    """Whether the input dist's collectives run on NCCL with peers: then only the train thread
    may launch them (one launch order on every rank, as NCCL requires across communicators)."""
    return groups.runs_on_nccl(_sharding_group(model), device)


def _find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    wrapped = getattr(model, "_dmp_wrapped_module", model)
    return wrapped if isinstance(wrapped, DistributedDataParallel) else None


def _unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # DMP.module is the user's model


class TrainPipeline(TrainPipelineSparseDist):
    """``progress(dataloader_iter)`` runs one training step and returns the model output,
    raising ``StopIteration`` once the iterator is drained; ``close()`` joins its threads.

    The model's forward takes a batch and returns ``(loss, output)``, as TorchRec pipelines
    expect; batches are TorchRec ``Pipelineable`` (e.g. ``torchrec.datasets.utils.Batch``).
    With ``graph_modules`` on CUDA, the output's tensors that a graphed module made (its result,
    detached) are views of the graph's static outputs, which the next step's replay overwrites:
    read them before the next ``progress``, or take the copies ``pop_host_outputs()`` gives.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        options: PipelineOptions | None = None,
        execute_all_batches: bool = True,
    ) -> None:
        super().__init__(
            model, optimizer, device, execute_all_batches=execute_all_batches, dmp_collection_sync_interval_batches=None
        )
        options = options or PipelineOptions()
        if options.prefetch_threads is not None and options.prefetch_threads < 0:
            raise ValueError(f"TrainPipeline: prefetch_threads must be >= 0, got {options.prefetch_threads}")
        spare = _spare_cores(device)
        one_thread = _input_dist_on_nccl(model, device)
        if options.threaded_input_dist and one_thread:
            group = _sharding_group(model)
            raise ValueError(
                f"TrainPipeline: threaded_input_dist must be False or None where the input dist runs on NCCL "
                f"with peers, got True (backend {dist.get_backend(group)!r}, {dist.get_world_size(group)} ranks, "
                f"{device}): a helper thread's all-to-all on its own communicator would race the train thread's "
                "collectives, in a different order on each rank, and NCCL needs one order on every rank (else a hang)"
            )
        self.options = options = dataclasses.replace(
            options,
            prefetch_threads=(2 if spare else 0) if options.prefetch_threads is None else options.prefetch_threads,
            threaded_input_dist=(spare and not one_thread)
            if options.threaded_input_dist is None
            else options.threaded_input_dist,
        )
        cuda = device.type == "cuda"
        self._memcpy_stream = None  # copies are ours (prefetcher or inline); they hand over events instead
        self._streams = device_streams(device, self._data_dist_stream)
        # Input dists launched a step ahead run here, not on the main thread's data-dist stream.
        self._ahead_dist_stream = self._streams.new_stream() if self._streams is not None else None
        self._inline_copy_stream = self._streams.new_stream() if self._streams is not None else None
        self._ready: deque[ReadyBatch] = deque()  # parallel to self.batches / self.contexts
        self._prefetcher: BatchPrefetcher | None = None
        self._prefetch_source: Iterator[Any] | None = None
        self._gate = DEVICE_WORK  # CUDA graph captures hold the helper threads off the device with it
        self._dist_worker = HelperThread("torchrec_ext-input-dist", self._gate) if options.threaded_input_dist else None
        self._dist_future: Future | None = None  # batch i+1's input dist, resolving to its event
        # NCCL with peers: the input dist's second half, run by the train thread after the forward
        self._defer_dist_wait = one_thread
        self._dist_finish: Any = None
        self._dist_groups: dict[Any, dist.ProcessGroup] = {}  # the modules' group -> ours, borrowed
        self._moved_input_dists: list[tuple[Any, dist.ProcessGroup]] = []
        self._ddp = _find_ddp(model)
        self._grad_sync: FlatGradSync | None = None
        self._takeover: DdpTakeover | None = None
        flat = cuda if options.flat_dense_allreduce is None else options.flat_dense_allreduce
        if flat and self._ddp is not None:
            capture = cuda and options.graph_dense_sync
            captured_optimizer = optimizer if (capture and options.graph_optimizer_step) else None
            if captured_optimizer is not None and not all(g.get("capturable", False) for g in optimizer.param_groups):
                raise ValueError("TrainPipeline: graph_optimizer_step needs an optimizer built with capturable=True")
            self._takeover = DdpTakeover.of(self._ddp)
            self._grad_sync = FlatGradSync.of(self._ddp, capture=capture, optimizer=captured_optimizer)
        graph_modules = self._resolve_modules(options.graph_modules)
        self._graphed_forwards: list[GraphedForward] = []
        if graph_modules and cuda:
            self._graphed_forwards = [GraphedForward.install(module) for module in graph_modules]
            for graphed in self._graphed_forwards:
                graphed.gate, graphed.capture_timeout_s = self._gate, options.timeout_s
                # (a deferred input dist first: the capture, inside the forward, joins the stage waiting on it)
                graphed.join_before_capture = (self._finish_input_dist, self._join_stages)
        elif graph_modules:
            logger.info("TrainPipeline: graph_modules run eagerly on %s (CUDA graphs need a GPU)", device)
        self._host_outputs = HostOutputs(device, pinned=options.pinned_outputs)
        self._tiered: list[nn.Module] | None = None  # modules with tiered tables, found at the first step
        self._step = 0
        self._closed = False
        self._failed: str | None = None  # why progress() is refused (a forward raised mid input dist)

    # ------------------------------------------------------------------ public API

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if self._closed:
            raise RuntimeError("TrainPipeline: progress() after close(); build a new pipeline")
        if self._failed is not None:  # (as TorchRec's: a step that raised leaves the pipeline unusable)
            raise RuntimeError(f"TrainPipeline: progress() after {self._failed}; close() it and build a new pipeline")
        self._ensure_prefetcher(dataloader_iter)
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(dataloader_iter)
        self._join_input_dist()  # batch i's input dist, launched during step i-1
        if not self.batches:
            raise StopIteration
        self._set_module_context(self.contexts[0])
        training = self._model.training
        if training:
            # Graph replays read the gradients in place: keep their storage across steps.
            self._optimizer.zero_grad(set_to_none=self._grad_sync is None or not self.options.graph_dense_sync)
        self._ready[0].wait(self._current_stream())
        if len(self.batches) >= 2:
            self._launch_input_dist(self._ready[1], self.batches[1], self.contexts[1])
        self.enqueue_batch(dataloader_iter)  # batch i+2 (already prefetched, usually)

        if self._takeover is not None:
            self._takeover.skip = True  # DDP's buckets leave the all-reduce to _grad_sync
        if self.options.tier_prefetch and len(self.batches) >= 2:
            self._stage_next(self._ready[1], self.contexts[1])  # runs once batch i's lookup has its rows
        try:
            try:
                losses, output = self._model_fwd(self.batches[0])
            except BaseException:
                self._abandon_input_dist("a forward raised before the input dist finished")
                raise
            self._finish_input_dist()  # (a deferred one: after the forward's collectives, as on every rank)
            if training:
                self._backward(losses)
        finally:
            if self._takeover is not None:
                self._takeover.skip = False
        if training:
            if self._grad_sync is not None:
                self._grad_sync(self._gate, self.options.timeout_s, (self._join_stages,))
            if self._grad_sync is None or not self._grad_sync.steps_optimizer:
                self._optimizer.step()
        copied = self._host_outputs.push(self._step, output)
        if copied is not None:
            for graphed in self._graphed_forwards:  # the output may alias a graph's static outputs
                graphed.outputs_read.read_by(copied)
        self._step += 1
        self.dequeue_batch()
        return output

    def tier_step_stats(self) -> dict[str, dict[str, int]]:
        """Per tiered table (host or file backing), the last step's tier traffic: cache ``hits``
        and ``misses`` at step time, rows ``staged`` ahead of it by the pipeline, ``write_backs``
        (``staged_write_backs`` of them off the step), ``bytes_moved``. Empty without tiered tables."""
        stats: dict[str, dict[str, int]] = {}
        for module in self._tiered_modules() + self._sharded_staging_modules():
            stats.update(module.tier_step_stats())  # (a sharded module's: this rank's shares)
        return stats

    def pop_host_outputs(self) -> list[tuple[int, Any]]:
        """(step, output on the host) for every step whose device-to-host copy has finished."""
        return self._host_outputs.pop_ready()

    def drain_host_outputs(self) -> list[tuple[int, Any]]:
        """Like pop_host_outputs, but first waits for the copies still in flight."""
        return self._host_outputs.drain()

    def close(self, timeout_s: float | None = None) -> None:
        """Joins the prefetch and input-dist threads (waiting at most ``timeout_s`` for each; default:
        the prefetcher's own bound and ``options.timeout_s``), gives back the input-dist process
        groups and gives the model back as it was (its sharded modules' forwards and input-dist
        groups restored), so it can be trained or evaluated without the pipeline. Safe to call twice."""
        self._closed = True
        if self._prefetcher is not None:
            if timeout_s is None:
                self._prefetcher.close()
            else:
                self._prefetcher.close(timeout_s)
            self._prefetcher = None
        self._abandon_input_dist("closed before the input dist finished")
        worker_done = True
        if self._dist_worker is not None:
            worker_done = self._dist_worker.close(self.options.timeout_s if timeout_s is None else timeout_s)
        for kjt_all_to_all, pg in self._moved_input_dists:
            kjt_all_to_all._pg = pg
        self._moved_input_dists.clear()
        for source, group in self._dist_groups.items():
            if worker_done:
                groups.give_back(source, group)
            else:  # a helper thread left behind may still use its group: never reused
                groups.abandon(source, "a pipeline's input-dist thread did not stop within its close timeout")
        self._dist_groups.clear()
        if self._model_attached and self._pipelined_modules:
            self.detach()

    def __enter__(self) -> TrainPipeline:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Leaving on an error: the job is failing, and a helper thread stuck in a collective whose
        # peer is gone must not hold the error back for the full timeout.
        self.close(None if exc_type is None else min(self.options.timeout_s, _CLOSE_ON_ERROR_S))

    # ------------------------------------------------------------------ batches

    def _ensure_prefetcher(self, dataloader_iter: Iterator[Any]) -> None:
        if dataloader_iter is self._prefetch_source:
            return
        if self._prefetcher is not None:
            self._prefetcher.close()
        self._prefetch_source = dataloader_iter
        self._prefetcher = (
            BatchPrefetcher(
                dataloader_iter,
                self._device,
                num_threads=self.options.prefetch_threads,
                depth=self.options.prefetch_depth,
                timeout_s=self.options.timeout_s,
                streams=self._streams,
                gate=self._gate,
            )
            if self.options.prefetch_threads > 0
            else None
        )

    def _next_ready(self, dataloader_iter: Iterator[Any]) -> ReadyBatch | None:
        if self._prefetcher is not None:
            try:
                return self._prefetcher.next()
            except StopIteration:
                return None
        batch = self._next_batch(dataloader_iter)  # inline: TorchRec's own exhaustion handling
        if batch is None:
            return None
        return copy_to_device(
            batch, self._device, self._streams, self._inline_copy_stream, pin=self._device.type == "cuda"
        )

    def enqueue_batch(self, dataloader_iter: Iterator[Any]) -> bool:
        ready = self._next_ready(dataloader_iter)
        if ready is None:
            return False
        self._batch_count += 1
        self._ready.append(ready)
        self.batches.append(ready.batch)
        self.contexts.append(self._create_context())
        return True

    def dequeue_batch(self) -> None:
        self._ready.popleft()
        super().dequeue_batch()

    # ------------------------------------------------------------------ tiered tables

    def _tiered_modules(self) -> list[nn.Module]:
        if self._tiered is None:
            self._tiered = [
                m
                for m in _unwrapped(self._model).modules()
                if hasattr(m, "stage_next") and isinstance(getattr(m, "_tables", None), TieredTables)
            ]
        return self._tiered

    def _sharded_staging_modules(self) -> list[nn.Module]:
        """The pipelined sharded modules that stage their shares of tiered tables (ours)."""
        return [m for m in self._pipelined_modules if hasattr(m, "stage_next_dist")]

    def _stage_next(self, ready: ReadyBatch, context: TrainPipelineContext) -> None:
        """Asks each module with tiered tables to stage the rows of ``ready``'s batch, the next
        one: an unsharded module from the batch's KJT, a sharded one from the ids its input dist
        (in flight, launched for ``context``) brings to this rank, waited for on the stage's worker."""
        for module in self._sharded_staging_modules():
            module.stage_next_dist(self._dist_input_of(context, module.forward.name))
        modules = self._tiered_modules()
        if not modules:
            return
        batch = ready.wait(self._current_stream())
        candidates = [
            v for v in (vars(batch).values() if hasattr(batch, "__dict__") else ()) if isinstance(v, KeyedJaggedTensor)
        ]
        for module in modules:
            features = [kjt for kjt in candidates if set(module._plan.features) <= set(kjt.keys())]
            if features:  # else the model builds the module's KJT itself: its batch runs unstaged
                module.stage_next(features[0])

    def _join_stages(self) -> None:
        """Waits for the tiered tables' stages in flight (before a CUDA graph capture). The gate
        already keeps their worker off the device during a capture; joining first also orders the
        train stream after the rows a stage brought in and surfaces its error outside the capture.
        Deadlock-free wherever a capture runs: a stage waits only for its lookup's hand-over,
        complete once that lookup returns, and for an input dist on the gate's threads, still
        open here. Results do not change; the stage just overlaps less that step."""
        local = [m.local_module for m in self._sharded_staging_modules()]
        for module in self._tiered_modules() + [m for m in local if m is not None]:
            if isinstance(module._tables, TieredTables):
                module._tables.wait_for_stage()

    def _dist_input_of(self, context: TrainPipelineContext, name: str):
        """A call giving module ``name``'s input dist result for ``context`` (waiting for the
        input dist launched on the helper thread first), or None once its forward has taken it
        (the stage then stages nothing: a stage only moves rows ahead, results do not depend on it),
        or None when that input dist raised (the train thread raises its error, at its join)."""
        launched, timeout_s, gate = self._dist_future, self.options.timeout_s, self._gate

        def dist_input():
            if launched is not None:
                with gate.stepped_aside():  # the stage holds the gate; the helper may be parked at it
                    try:
                        launched.result(timeout=timeout_s)
                    except Exception:  # noqa: BLE001 - the train thread raises it at its join
                        # (a batch refused, a step that raised then close: nothing to stage; an
                        # error kept by the stage would fail the tables' next entry after close)
                        return None
            request = context.input_dist_tensors_requests.get(name)
            return None if request is None else request.wait()

        return dist_input

    def _current_stream(self) -> torch.cuda.Stream | None:
        return self._streams.current() if self._streams is not None else None

    def _ready_of(self, context: TrainPipelineContext) -> ReadyBatch:
        for ready, queued in zip(self._ready, self.contexts):
            if queued is context:
                return ready
        raise AssertionError(f"TrainPipeline: no queued batch for context {context.index}")

    # ------------------------------------------------------------------ input dist

    def start_sparse_data_dist(self, batch: Any | None, context: TrainPipelineContext) -> None:
        """TorchRec's entry (fill_pipeline: the first batch's, a new iterator's input dist), on
        the main thread's data-dist stream, ordered after the batch's host-to-device copy."""
        if batch is not None:
            self._start_input_dist(self._ready_of(context), batch, context, self._main_dist_stream())

    def wait_sparse_data_dist(self, context: TrainPipelineContext) -> None:
        self._wait_input_dist(context, self._main_dist_stream())

    def _start_input_dist(
        self, ready: ReadyBatch, batch: Any, context: TrainPipelineContext, stream: torch.cuda.Stream | None
    ) -> None:
        """As TorchRec's start_sparse_data_dist, on ``stream``, after the batch's copy."""
        with self._on(stream):
            ready.wait(stream)
            with use_context_for_postprocs(self._pipelined_postprocs, context):
                _start_data_dist(self._pipelined_modules, batch, context)

    def _wait_input_dist(self, context: TrainPipelineContext, stream: torch.cuda.Stream | None) -> None:
        """As TorchRec's wait_sparse_data_dist, on ``stream``."""
        with self._on(stream):
            for names, awaitable in context.fused_splits_awaitables:
                for name, request in zip(names, awaitable.wait()):
                    context.input_dist_tensors_requests[name] = request
        context.input_dist_splits_requests.clear()
        context.fused_splits_awaitables.clear()

    def _main_dist_stream(self) -> torch.cuda.Stream | None:
        return self._streams.main_dist if self._streams is not None else None

    def _on(self, stream: torch.cuda.Stream | None):
        return self._streams.use(stream) if self._streams is not None and stream is not None else nullcontext()

    def _launch_input_dist(self, ready: ReadyBatch, batch: Any, context: TrainPipelineContext) -> None:
        """Batch i+1's input dist, during batch i's step, on the ahead stream; resolves to an
        event the main data-dist stream waits for once batch i+1 is up. Deferred (NCCL with
        peers): only its first half here; ``_finish_input_dist`` runs the rest after the forward."""
        stream = self._ahead_dist_stream

        def start() -> None:
            self._start_input_dist(ready, batch, context, stream)

        def finish() -> Any:
            self._wait_input_dist(context, stream)
            return record_event(self._streams, stream) if self._streams is not None else None

        if self._dist_worker is not None:
            self._dist_future = self._dist_worker.submit(lambda: (start(), finish())[1])
            return
        self._dist_future = Future()
        if self._defer_dist_wait:
            start()
            self._dist_finish = finish
            return
        try:
            self._dist_future.set_result((start(), finish())[1])
        except BaseException as e:  # (a batch refused on any rank): the next progress() fails at once
            self._input_dist_raised(e)
            raise

    def _abandon_input_dist(self, why: str) -> None:
        """A deferred input dist that will never finish (a forward raised, or close): a tiered
        stage waiting for it stops at once, staging nothing, and progress() is refused (this
        rank's collectives no longer match its peers')."""
        if self._dist_finish is None:
            return
        self._dist_finish = None
        self._failed = self._failed or why
        self._dist_future.set_exception(_InputDistAbandoned(f"TrainPipeline: {why}"))

    def _finish_input_dist(self) -> None:
        """The deferred second half of the input dist in flight, if any, on the train thread: at
        the same point of the step on every rank (after the forward, or before a capture)."""
        finish, self._dist_finish = self._dist_finish, None
        if finish is None:
            return
        try:
            self._dist_future.set_result(finish())
        except BaseException as e:
            self._input_dist_raised(e)  # a tiered stage waiting for it gets the error too
            raise

    def _input_dist_raised(self, error: BaseException) -> None:
        """The input dist in flight raised (its batch refused on some rank): the batches queued
        have no input dist, so progress() is refused from now on, at once, not after a wait for a
        future no one sets."""
        self._failed = self._failed or f"an input dist that raised {type(error).__name__}"
        if self._dist_future is not None and not self._dist_future.done():
            self._dist_future.set_exception(error)

    def _join_input_dist(self) -> None:
        self._finish_input_dist()  # (a forward that raised left it pending)
        if self._dist_future is not None:
            future, self._dist_future = self._dist_future, None
            try:
                done = future.result(timeout=self.options.timeout_s)  # re-raises the worker's exception
            except BaseException as e:
                self._input_dist_raised(e)
                raise
            if done is not None:
                self._streams.main_dist.wait_event(done)

    def _pipeline_model(self, batch, context, pipelined_forward=None) -> None:
        # As TorchRec's, plus: once the input dists exist (the first start creates them), move
        # their collectives to a clone of their process group when a helper thread issues them.
        if self._dist_worker is not None:
            groups.check_pools_open()  # before the model is rewritten: a refusal leaves it as it was
        (self._pipelined_modules, self._model, self._original_forwards, self._pipelined_postprocs, _) = _rewrite_model(
            model=self._model,
            context=context,
            dist_stream=self._data_dist_stream,
            default_stream=torch.get_device_module(self._device).current_stream(),
            batch=batch,
            apply_jit=self._apply_jit,
            pipelined_forward=pipelined_forward or self._pipelined_forward_type,
            pipeline_postproc=self._pipeline_postproc,
        )
        self.start_sparse_data_dist(batch, context)
        if self._dist_worker is not None:
            self._move_input_dists_to_own_groups()
        self._original_kjt_dist_forwards = _override_input_dist_forwards(self._pipelined_modules)

    def _move_input_dists_to_own_groups(self) -> None:
        for module in self._pipelined_modules:
            for child in module.modules():
                for input_dist in getattr(child, "_input_dists", []):
                    kjt_all_to_all = getattr(input_dist, "_dist", None)
                    if kjt_all_to_all is None or getattr(kjt_all_to_all, "_pg", None) is None:
                        continue
                    pg = kjt_all_to_all._pg
                    if groups.runs_on_nccl(pg, self._device):  # a module on another group than DMP's
                        raise RuntimeError(
                            f"TrainPipeline: an input dist runs on NCCL with peers ({dist.get_backend(pg)!r}, "
                            f"{dist.get_world_size(pg)} ranks): pass PipelineOptions(threaded_input_dist=False)"
                        )
                    if pg not in self._dist_groups:
                        # May create a group (a collective): every rank builds the same pipelines.
                        self._dist_groups[pg] = groups.borrow(pg)
                    self._moved_input_dists.append((kjt_all_to_all, pg))
                    kjt_all_to_all._pg = self._dist_groups[pg]

    # ------------------------------------------------------------------ CUDA graphs

    def _resolve_modules(self, names: Sequence[str]) -> list[nn.Module]:
        root = _unwrapped(self._model)
        modules = []
        for name in names:
            try:
                modules.append(root.get_submodule(name))
            except AttributeError:
                raise ValueError(
                    f"TrainPipeline: graph_modules names {name!r}, which the model does not have"
                ) from None
        return modules
