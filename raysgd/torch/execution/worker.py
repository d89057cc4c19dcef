"""One worker: joins the process group, builds the operator, keeps the persistent iterators, runs an epoch.

Layer 5: imports torch.distributed and layers 0-4, never Ray's actor API. The same class runs as a
Ray actor or, with ``use_local=True``, as a plain object inside the driver process.

Example:
    >>> from raysgd.torch.training_operator import TrainingOperator
    >>> import torch
    >>> class Counting(TrainingOperator):
    ...     def setup(self, config):
    ...         model = torch.nn.Linear(1, 1)
    ...         self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
    ...         self.register_data(train_loader=range(3))
    ...     def train_epoch(self, iterator, info=None):
    ...         return {"seen": len(list(iterator))}
    >>> worker = TorchWorker(Counting, {}, is_local=True)
    >>> worker.setup_operator()  # what the strategy tells the group
    {'sharded_state': False}
    >>> worker.train_epoch(num_steps=2), worker.train_epoch(num_steps=2)
    ({'epoch': 1, 'seen': 2}, {'epoch': 2, 'seen': 2})
"""
import contextlib
import datetime
import functools
import importlib
import itertools
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from raysgd import logs
from raysgd.torch.restart_points import call_start, restart_point
from raysgd.torch.restart_points.transport import out_of_band
from raysgd.torch.state import checkpoint
from raysgd.torch.sharding import loaders as _data
from raysgd.torch.operator import evaluation
from raysgd.torch.operator.tracing import TraceRecorder
from raysgd.torch.state import model_copy
from raysgd.torch.commits import preemption
from raysgd.torch.state import training_state as _state
from raysgd.torch.commits.committer import Committer
from raysgd.torch.state.checkpoint import serialise
from raysgd.timers import TimerCollection
from raysgd.torch.constants import COMMIT_LATENCY, NUM_STEPS, USE_FP16
from raysgd.torch.execution.epoch_iterators import CallBatches, PersistentIterator
from raysgd.torch.errors import CollectiveError, is_collective_failure
from typing import Any

logger = logging.getLogger(__name__)


def guard_collectives(method):
    """Turn a torch.distributed timeout or lost peer into :class:`CollectiveError` naming this rank."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except CollectiveError:
            raise
        except Exception as err:
            if self.world_size > 1 and is_collective_failure(err):
                raise CollectiveError(self.world_rank, f"{type(err).__name__}: {err}") from err
            raise

    return wrapper


class TorchWorker:
    """One data-parallel replica (see the module docstring). Its methods are what the worker group calls."""

    #: Its train and validate calls take the call-start snapshot beside them (``snapshot=``, :meth:`call_start_snapshot`).
    overlaps_snapshots = True

    def __init__(self, operator_cls, config, *, use_gpu=False, use_fp16=False, use_tqdm=False, wrap_ddp=True,
                 add_dist_sampler=True, scheduler_step_freq=None, backend="gloo", num_cpus=1, world_size=1,
                 is_local=False, strategy="ddp", fsdp_args=None, log_levels=None):
        self.operator_cls = operator_cls
        self.config = config
        self.use_gpu = use_gpu
        self.backend = backend
        self.world_size = world_size
        self.world_rank = 0
        self.operator: Any = None  # the user's operator (TrainingOperator's methods), built by setup_operator
        self.timers = TimerCollection()
        self._traces = TraceRecorder()  # torch.profiler traces of train calls (TorchTrainer.profile)
        self.timers.disable()
        self._is_local = is_local
        self._handoff = call_start.Handoff()  # the call-start snapshot's capture, from the call to its serialiser
        self._snapshot_group = None  # a sharded state's snapshot threads' process group (made at the first call)
        self._options = dict(use_fp16=use_fp16, use_tqdm=use_tqdm, wrap_ddp=wrap_ddp,
                             add_dist_sampler=add_dist_sampler, scheduler_step_freq=scheduler_step_freq,
                             strategy=strategy, fsdp_args=fsdp_args)
        self._fresh_group_state()
        if not is_local and num_cpus:
            torch.set_num_threads(max(1, int(num_cpus)))
        if not is_local:
            logs.as_worker(log_levels)  # WARNING and up by default: Ray forwards them to the driver's stderr
            preemption.install()  # Ray runs __init__ on the main thread: SIGTERM commits first
        if world_size > 1:
            importlib.import_module("torch._dynamo")  # the first DDP wrap imports it: pay at start-up

    def _fresh_group_state(self):
        """What belongs to one group: the commit bookkeeping (an agreed cadence) and the persistent iterators."""
        self.epochs = 0
        self.committer = Committer()
        self._train_iter = PersistentIterator(self._train_loader, self._on_new_train_epoch, self.committer.after_iter,
                                               on_abandon=self._rewind_train_epoch,
                                               resuming=lambda: self.committer.resume is not None)
        self._val_iter = PersistentIterator(self._validation_loader, lambda loader: None)

    # ----------------------------------------------------------------- start-up
    def rejoin(self, config, world_rank, world_size):
        """A survivor of a failed group joins a re-formed one as ``world_rank`` of ``world_size``: leave the old
        process group, drop the operator and the old group's call state; ``setup_process_group`` and
        ``setup_operator`` follow, with ``config`` (its batch size split for the new size). The process, its
        imports and its hook's effects stay."""
        self.committer.flush(timeout_s=5.0)  # a commit still being sent belongs to the old group
        self.shutdown()
        self.operator, self.config = None, config
        self.world_rank, self.world_size = world_rank, world_size  # setup_process_group sets them again (size > 1)
        self._fresh_group_state()

    def run_hook(self, hook):
        """Run the trainer's ``initialization_hook`` in this process."""
        if hook is not None:
            hook()

    def warm_up(self, hook):
        """Make this process a warm spare (:mod:`raysgd.torch.execution.spares`): import what the first DDP wrap
        imports (``torch._dynamo`` and DDP's module: the whole of the first wrap's 1-2.5 s; measured, the wrap after
        them takes no time), then run ``hook``. No rank, no process group, no operator: ``setup()`` may read the
        rank, so it runs when the spare takes one (:meth:`take_rank`). Returns ``(process id, node id)``: the
        node's commit holder is started before the spare takes a rank.

        Nothing is wrapped here on purpose: a throwaway DDP model in a one-rank group, as this did before, could
        hang the spare for good when its Reducer was freed after its group was destroyed (the group's destructor
        joining a gloo thread, seen in a native stack)."""
        started = time.perf_counter()
        if dist.is_available():
            try:
                for module in ("torch._dynamo", "torch.nn.parallel.distributed"):  # the import is the warming
                    importlib.import_module(module)
            except Exception as err:  # noqa: BLE001 (a cold spare still saves the process start-up)
                logger.debug("warming DDP's imports in a spare failed: %s", err)
        self.run_hook(hook)
        logger.debug("spare warm in %.2f s", time.perf_counter() - started)
        return os.getpid(), restart_point.this_node()

    def take_rank(self, config, world_rank, world_size, hook=None):
        """A warm spare becomes ``world_rank`` of a re-formed group of ``world_size`` (with ``config``), as a
        survivor does (:meth:`rejoin`); ``hook``, when given (the trainer's hook changed since the spare ran it), runs
        first. ``setup_process_group`` and ``setup_operator`` follow."""
        self.run_hook(hook)
        self.rejoin(config, world_rank, world_size)

    def node_ip(self):
        import ray  # noqa: PLC0415 (only for the address; the worker itself needs no Ray)

        return ray.util.get_node_ip_address()

    def place(self):
        """``(ip, node id)`` of this worker's node: where its process group connects and its commits are held."""
        return self.node_ip(), restart_point.this_node()

    def setup_address(self):
        """``tcp://<this node's ip>:<free port>`` for the process group's rendezvous."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{self.node_ip()}:{port}"

    @guard_collectives
    def setup_process_group(self, url, world_rank, world_size, timeout_s):
        """Join the ``backend`` process group as ``world_rank`` of ``world_size``."""
        self.world_rank, self.world_size = world_rank, world_size
        if self.backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")  # a dead peer raises instead of hanging
            os.environ.setdefault("NCCL_BLOCKING_WAIT", "1")
        if dist.is_initialized():
            dist.destroy_process_group()
        self._snapshot_group = None  # (destroyed with the old group)
        dist.init_process_group(self.backend, init_method=url, rank=world_rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def _device(self, local_rank):
        if self.use_gpu and torch.cuda.is_available():
            index = 0 if not self._is_local else torch.cuda.current_device()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        if self.use_gpu:
            logger.warning("use_gpu=True, but rank %d's torch sees no CUDA device (CUDA_VISIBLE_DEVICES=%r, torch "
                           "%s): it trains on the CPU", self.world_rank, os.environ.get("CUDA_VISIBLE_DEVICES"),
                           torch.__version__)
        return torch.device("cpu")

    @guard_collectives
    def setup_operator(self, local_rank=0):
        """Build the user's operator (its ``setup`` registers models and data); returns what its strategy tells the
        group (:attr:`~raysgd.torch.execution.worker_group.WorkerGroup.setup_report`): ``sharded_state``, whether the
        state is one part per rank (``strategy="fsdp"``), so a restart point asks every rank for its part at once."""
        self.operator = self.operator_cls(
            self.config, world_rank=self.world_rank, local_rank=local_rank, is_distributed=self.world_size > 1,
            use_gpu=self.use_gpu, device=self._device(local_rank), world_size=self.world_size, **self._options)
        self.operator.timers = self.timers
        return {"sharded_state": _state.is_sharded(self.operator)}

    # ----------------------------------------------------------------- epochs
    def _train_loader(self):
        return self.operator.registered_loader("train")

    def _train_loader_if_any(self):
        return self.operator.registered_loader("train", required=False)

    def _validation_loader(self):
        return self.operator.registered_loader("validation")

    def _on_new_train_epoch(self, loader):
        _data.set_sampler_epoch(loader, self.epochs)
        self.committer.begin_epoch(loader)
        self.epochs += 1

    def _rewind_train_epoch(self):
        self.epochs -= 1  # an error abandoned this epoch mid-way: the next call starts it again

    def _begin(self, profile):
        if profile:
            self.timers.enable()
            self.timers.reset()
        else:
            self.timers.disable()

    @guard_collectives
    def train_epoch(self, num_steps=None, profile=False, info=None, iterator=None, progress=None, commit=None,
                    trace=False, snapshot=None):
        """Train ``num_steps`` batches (default: the rest of the epoch); returns ``{"epoch", **metrics}``.

        ``iterator`` (e.g. a Ray Data shard) replaces the registered loader for this call and
        counts as one epoch. ``progress`` (rank 0 with ``use_tqdm``) is a
        :class:`~raysgd.torch.integrations.progress.ProgressReporter` fed by the operator's per-batch hook.
        ``commit`` (a :class:`~raysgd.torch.commits.committer.CommitPlan`) commits between batches.
        The operator's iterator has ``end_epoch()``: the epoch ends with this call (Lightning's ``-1``).
        ``trace``: record the call with ``torch.profiler`` (:meth:`take_trace` hands the trace out).
        When a commit of this rank was stored during the call, the result also holds its latency
        (``COMMIT_LATENCY``: the driver takes it out). ``snapshot`` (a
        :class:`~raysgd.torch.restart_points.call_start.SnapshotPlan`): the call-start snapshot is taken beside the call.
        """
        with self._call_start(snapshot):
            return self._train_epoch(num_steps, profile, info, iterator, progress, commit, trace)

    def _train_epoch(self, num_steps, profile, info, iterator, progress, commit, trace):
        self._begin(profile)
        commits_before = self.committer.stats.count
        if iterator is not None and self.committer.resume is not None:
            raise ValueError("train(dataset=...) cannot run while a loaded state waits to resume an epoch of the "
                             f"registered train loader (cursor {self.committer.resume['cursor']}): call train() first")
        info = {**(info or {}), NUM_STEPS: num_steps, USE_FP16: self.operator.use_fp16, "epoch_idx": self.epochs}
        with self._traces.record(trace), self.timers.record("train_epoch"):
            if iterator is not None:
                self.epochs += 1
                batches = iterator if num_steps is None else itertools.islice(iterator, num_steps)
            else:
                batches = self._train_iter.take(num_steps)
            batches = CallBatches(self.committer.batches(self, batches, commit if iterator is None else None,
                                                          self._train_loader_if_any))
            reporting = contextlib.nullcontext() if progress is None else progress.attach(
                self.operator, num_steps, iterator if iterator is not None else self._train_loader_if_any())
            fresh = self._train_iter.fresh_after_error() if iterator is None else contextlib.nullcontext()
            with reporting, fresh, contextlib.closing(batches):  # its cleanup runs now, even after an error
                stats = self.committer.merge_carried(self.operator.train_epoch(batches, info))
        if batches.ended and iterator is None:
            self._train_iter.reset()  # the rest of the epoch is dropped: the next call starts a new one
        result = {"epoch": self._epoch_now(), **stats}
        if profile:
            result["profile"] = self.timers.stats()
        if self.committer.stats.count > commits_before:  # the latest one stored (one being sent is not counted)
            result[COMMIT_LATENCY] = self.committer.stats.latency_s
        return result

    @guard_collectives
    def validate(self, num_steps=None, profile=False, info=None, snapshot=None):
        """Validate on ``num_steps`` batches (default: the rest of the validation set); returns metrics.
        ``snapshot``: as for :meth:`train_epoch`."""
        with self._call_start(snapshot):
            return self._validate(num_steps, profile, info)

    def _validate(self, num_steps, profile, info):
        self._begin(profile)
        self.operator.registered_loader("validation")  # a clear error before anything else
        with self.timers.record("validation"), self._val_iter.fresh_after_error(), _state.preserved_rng(), \
                evaluation.quiet_forward(evaluation.ddp_modules(self.operator)), \
                self.operator.validating(self._val_iter.take(num_steps), info) as batches:  # FSDP: in lockstep
            stats = self.operator.validate(batches, dict(info or {}))
        if profile:
            stats = {**stats, "profile": self.timers.stats()}
        return stats

    # ----------------------------------------------------------------- state
    def _call_start(self, plan):
        """The call-start snapshot beside the call (see :mod:`raysgd.torch.restart_points.call_start`); nothing when ``plan``
        is None."""
        if plan is None:
            return contextlib.nullcontext()
        sharded_state = _state.is_sharded(self.operator)
        if sharded_state and self.world_size > 1 and self._snapshot_group is None:
            self._snapshot_group = dist.new_group(backend="gloo")  # the snapshot threads' own (every rank, here)
        return call_start.overlapped(plan, self._handoff, rank=self.world_rank, world_size=self.world_size,
                                     own_rng=self.rng_state(),
                                     capture_state=self._sharded_capture if sharded_state else self.state_dict,
                                     parts=self.operator.state_parts())

    def _sharded_capture(self, rngs):
        """A sharded state at the call's start (every rank): this rank's shards as DCP state dicts (rank 0's buffers
        taken first) and, on rank 0, the rest of the state with every rank's random streams."""
        state = {"shards": _state.capture_shards(self.operator)}
        if self.world_rank == 0:
            state["rest"] = self._with_call_state(_state.capture_rest(self.operator, self._epoch_now()), rngs)
        return state

    def _write_sharded(self, state):
        """``(part, head)`` of a sharded capture, written in the snapshot thread: this rank's DCP part (a collective of
        the snapshot threads, over their own process group) and rank 0's head."""
        from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: sharded strategies only)

        part = sharded.save_parts(state["shards"], process_group=self._snapshot_group)
        head = None if "rest" not in state else bytes(serialise({"rest": state["rest"], "metadata": part.metadata,
                                                                 "layout": part.layout}))
        return part, head

    def call_start_snapshot(self, token, timeout_s):
        """``(info, state bytes)`` of the call-start snapshot that the call with ``token`` captured (rank 0, in the
        ``"snapshot"`` concurrency group, beside the call): as :meth:`state_snapshot`, serialised while it trains. A
        sharded state: every rank answers its part, rank 0's info also holding the head."""
        if _state.is_sharded(self.operator):
            part, head = call_start.snapshot_bytes(self._handoff, token, timeout_s, write=self._write_sharded)
            info = {"bytes": part.nbytes, "node": restart_point.this_node(), **({"head": head} if head else {})}
            return info, out_of_band(part.blob)
        view = call_start.snapshot_bytes(self._handoff, token, timeout_s)
        return {"bytes": view.nbytes, "node": restart_point.this_node()}, out_of_band(view)

    def _epoch_now(self):
        """The epoch count a state holds: a loaded cursor still waiting for its epoch counts that epoch (as the
        commit it came from did)."""
        pending = self.committer.pending_state()
        return pending[_state.CURSOR]["epoch"] if pending else self.epochs

    def state_dict(self, rngs=None):
        """This worker's state (see :mod:`raysgd.torch.state.training_state`) with the random streams of every rank: ``rngs``
        (``{rank: rng_state}`` the driver gathered) in rank order, this rank's own in its place.

        While a loaded mid-epoch state waits for its epoch (no batch of it trained yet), the state holds its
        cursor, committed metrics and random streams: whatever restarts from it resumes at the same point."""
        return self._with_call_state(_state.capture(self.operator, self._epoch_now()), rngs)

    def _with_call_state(self, state, rngs):
        """``state`` with every rank's random streams and, while a loaded commit waits or an epoch was left mid-way,
        its cursor (and committed metrics)."""
        streams = {**(rngs or {}), self.world_rank: self.rng_state()}
        state[_state.RNG] = [streams.get(rank) for rank in range(max(streams) + 1)]
        pending = self.committer.pending_state()
        if pending is not None:
            state.update(pending)
        elif self._train_iter.mid_epoch:  # train(num_steps=...) stopped inside an epoch: say where
            cursor = self.committer.cursor_now(self.epochs, self._train_loader_if_any())
            if cursor is not None:
                state[_state.CURSOR] = cursor
        return state

    def load_state_dict(self, state):
        """Load a state (a snapshot, a checkpoint or a commit); a new epoch starts at the next train call.

        A commit's ``cursor`` makes that epoch resume where the commit was taken, with this rank's
        random streams from it (applied once the epoch's iterator exists, as in the original run).
        Under ``strategy="fsdp"`` a whole state (``load_state_dict``, ``load``) is a collective: each rank keeps its
        shard of it; a sharded state's rest arrives here after its parts were loaded (:meth:`load_restart_point`).
        """
        epoch = _state.restore(self.operator, state)
        cursor = state.get(_state.CURSOR)
        self.epochs = cursor["epoch"] - 1 if cursor else epoch
        self.committer.load(cursor, _state.rank_rng(state, self.world_rank), state.get(_state.METERS),
                            self.world_rank, self.world_size)
        self._train_iter.reset()
        self._val_iter.reset()

    def state_stream(self, rngs=None):
        """:meth:`state_dict` as ``torch.save`` bytes."""
        return checkpoint.state_to_bytes(self.state_dict(rngs))

    def state_snapshot(self, rngs=None):
        """``(info, state bytes)`` of a restart point, called with two return values: the driver waits for the small
        ``info`` (``{"bytes": n, "node": node id}``) and keeps the bytes' ref without fetching them. The state is
        serialised once, into a buffer handed to Ray's object store without a copy.

        A sharded state (``strategy="fsdp"``) is a collective: every rank is called at once and answers its own part
        (its shards, in DCP's format), rank 0's ``info`` also holding the ``head`` (:meth:`sharded_state`)."""
        if _state.is_sharded(self.operator):
            part, head = self.sharded_state(rngs)
            info = {"bytes": part.nbytes, "node": restart_point.this_node(), "head": head}
            return info, out_of_band(part.blob)
        view = serialise(self.state_dict(rngs))
        return {"bytes": view.nbytes, "node": restart_point.this_node()}, out_of_band(view)

    def sharded_state(self, rngs=None):
        """``(part, head)`` of a sharded state, a collective of every rank: ``part`` this rank's shards of the models
        and optimizers (:class:`raysgd.torch.state.sharded.Part`, one file of a DCP checkpoint); ``head`` on rank 0
        the rest of the state with every rank's random streams and the DCP metadata (bytes), None elsewhere."""
        from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: sharded strategies only)

        part = sharded.save_parts(_state.capture_shards(self.operator))
        if self.world_rank != 0:
            return part, None
        rest = self._with_call_state(_state.capture_rest(self.operator, self._epoch_now()), rngs)
        return part, bytes(serialise({"rest": rest, "metadata": part.metadata, "layout": part.layout}))

    def load_restart_point(self, refs, weights_only=False, overlay=None, timeout_s=600):
        """Load the first still available copy of a restart point (``refs``: the
        :class:`~raysgd.torch.restart_points.restart_point.RestartPoint`'s refs, fetched here from their nodes), updated with
        its ``overlay`` (a commit's random streams, metrics and cursor). A sharded one (``refs`` a
        :class:`~raysgd.torch.restart_points.restart_point.ShardedRefs`, or a checkpoint's
        :class:`~raysgd.torch.storage.parts.ShardedFiles`) is a collective of every rank, at any number of ranks:
        each reads, of the parts its new shard overlaps, only the rows it takes and the replicated values."""
        location = self.operator.device if self.operator.use_gpu else "cpu"
        if hasattr(refs, "source"):  # a sharded point: its parts in object stores or in a checkpoint's files
            from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: sharded strategies only)

            head = checkpoint.state_from_bytes(refs.head, weights_only=weights_only)
            shards = _state.capture_shards(self.operator, metadata=head["metadata"])  # what the parts fill
            sharded.load_parts(shards, head["metadata"], refs.source(timeout_s), weights_only=weights_only,
                               layout=head.get("layout"))  # only the rows of this rank's new shard
            _state.restore_shards(self.operator, shards)
            state = head["rest"]
        else:
            stream = restart_point.first_available(refs, timeout_s)
            state = checkpoint.state_from_bytes(stream, map_location=location, weights_only=weights_only)
            del stream
        self.load_state_dict({**state, **overlay} if overlay else state)

    def rng_state(self):
        """This process's random streams (see :func:`raysgd.torch.state.training_state.rng_state`), or those of a loaded state
        still waiting for its epoch (they apply when it starts)."""
        pending = self.committer.pending_rng()
        return pending if pending is not None else _state.RANDOM_STREAMS.state_dict()

    def load_state_stream(self, stream, weights_only=False):
        """Load :meth:`state_stream` bytes onto this worker's own device. The default trusts them (this job's own
        snapshots and commits); ``weights_only=True`` for bytes a user handed in (see ``TorchTrainer.load_state_dict``)."""
        location = self.operator.device if self.operator.use_gpu else "cpu"
        self.load_state_dict(checkpoint.state_from_bytes(stream, map_location=location, weights_only=weights_only))

    # ----------------------------------------------------------------- access
    def take_trace(self):
        """The Chrome trace (bytes) of the latest call recorded with ``trace=True``, or None; handed out once."""
        return self._traces.take()

    def get_models(self, to_cpu=False):
        """The unwrapped models; with ``to_cpu`` CPU copies (the worker's own models never move)."""
        models = self.operator.registered_models()
        return [model_copy.cpu_copy(model) for model in models] if to_cpu else models

    def full_models(self):
        """The whole models on CPU on rank 0, None on the others: under FSDP a collective, so the driver calls it on
        every rank (see ``TrainingOperator.full_models``)."""
        models = self.operator.full_models()
        return models if self.world_rank == 0 else None

    def apply(self, fn):
        return fn()

    def request_resize(self, call_id, attempt):
        """The driver asks the running call to stop at the next agreed commit point (to grow the group).

        Answered from the ``"control"`` concurrency group while a call trains (see :mod:`raysgd.torch.commits.preemption`).
        """
        preemption.request_resize(call_id, attempt)

    def apply_operator(self, fn):
        return fn(self.operator)

    def update_scheduler(self, metric):
        schedulers = self.operator.state_parts()["schedulers"]
        if not schedulers:
            raise TypeError("update_scheduler needs registered schedulers: pass register(schedulers=...) in setup()")
        for scheduler in schedulers:
            scheduler.step(metric)

    def shutdown(self):
        """Drop the iterators and leave the process group."""
        self._train_iter.reset()
        self._val_iter.reset()
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as err:  # a broken group can fail to close; the process is going anyway
                logger.debug("destroy_process_group failed: %s", err)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
