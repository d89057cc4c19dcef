"""Inside the training function: the worker's context, ``report``, ``get_checkpoint`` and ``get_dataset_shard``.

Part of :mod:`raysgd.train`. The function worker (:mod:`raysgd.train.function_worker`) opens one
:class:`Session` per run of the training function (:func:`running`); the module functions read it, so they work
only inside ``train_loop_per_worker``. ``report(metrics, checkpoint=...)`` is a collective of every rank and the
run's commit point (:mod:`raysgd.train.reporting`): every rank's checkpoint files go into one directory
``storage_path/name/checkpoint_NNNNNN``, written from the ranks' own nodes, its marker last, with the metrics and
the data cursors of the loaders made by ``prepare_data_loader`` (their ``exactly_once`` flag).

Example:
    >>> get_context()
    Traceback (most recent call last):
    ...
    RuntimeError: raysgd.train.get_context() works only inside the training function that TorchTrainer runs on its workers
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil

from raysgd.base.checks import expect
from raysgd.base.paths import is_uri
from raysgd.torch.restart_points import restart_point
from raysgd.torch.storage import rank_files
from raysgd.train.checkpoint import Checkpoint
from raysgd.train.errors import context_deprecation
from raysgd.train.reporting import Reporter
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

_current: list["Session"] = []  # the running session (at most one per process)


class TrainContext:
    """Where this worker stands: ``get_world_size()``, ``get_world_rank()``, ``get_local_rank()``, ...

    Example:
        >>> TrainContext(world_size=2, world_rank=1, local_rank=1, local_world_size=2, node_rank=0,
        ...              experiment_name="exp", storage_path="/tmp").get_world_rank()
        1
    """

    def __init__(self, world_size: int, world_rank: int, local_rank: int, local_world_size: int, node_rank: int,
                 experiment_name: str, storage_path: str) -> None:
        self._values: dict[str, Any] = dict(world_size=world_size, world_rank=world_rank, local_rank=local_rank,
                            local_world_size=local_world_size, node_rank=node_rank, experiment_name=experiment_name,
                            storage_path=storage_path)

    def get_world_size(self) -> int:
        """The number of workers (ranks) in the group now."""
        return self._values["world_size"]

    def get_world_rank(self) -> int:
        """This worker's rank in the group (0 to world size - 1)."""
        return self._values["world_rank"]

    def get_local_rank(self) -> int:
        """This worker's rank among the workers of its node."""
        return self._values["local_rank"]

    def get_local_world_size(self) -> int:
        """The number of workers on this worker's node."""
        return self._values["local_world_size"]

    def get_node_rank(self) -> int:
        """The rank of this worker's node among the group's nodes."""
        return self._values["node_rank"]

    def get_experiment_name(self) -> str:
        """The run's name (``RunConfig(name=...)``)."""
        return self._values["experiment_name"]

    def get_storage_path(self) -> str:
        """Where the run's folder is (``RunConfig(storage_path=...)``)."""
        return self._values["storage_path"]

    def get_trial_name(self) -> NoReturn:
        """Deprecated in Ray Train 2.x (a Ray Tune trial's): raises its ``DeprecationWarning``."""
        raise context_deprecation("get_trial_name")

    def get_trial_id(self) -> NoReturn:
        """Deprecated in Ray Train 2.x: raises its ``DeprecationWarning``."""
        raise context_deprecation("get_trial_id")

    def get_trial_resources(self) -> NoReturn:
        """Deprecated in Ray Train 2.x: raises its ``DeprecationWarning``."""
        raise context_deprecation("get_trial_resources")

    def get_trial_dir(self) -> NoReturn:
        """Deprecated in Ray Train 2.x: raises its ``DeprecationWarning``."""
        raise context_deprecation("get_trial_dir")

    def get_metadata(self) -> NoReturn:
        """Deprecated in Ray Train 2.x (``TorchTrainer(metadata=...)``'s): raises its ``DeprecationWarning``."""
        raise context_deprecation("get_metadata")

    def __repr__(self) -> str:
        return f"TrainContext({self._values})"


class Session:
    """One run of the training function on one worker: its context, device, the attempt's report plan (where the
    checkpoints go and which one it starts from), the loaders it prepared and its :class:`Reporter`."""

    def __init__(self, context, device, plan=None, dataset_shards=None, backend="gloo", progress=None):
        self.context, self.device, self.plan = context, device, plan
        self.progress = progress  # rank 0's progress bar feed, or None
        self.dataset_shards = dataset_shards or {}
        self.loaders: list = []  # the PreparedLoaders, in the order they were made
        self.reporter = Reporter(plan, context.get_world_rank(), context.get_world_size(), backend,
                                 cursors=lambda: [loader.cursor_state() for loader in self.loaders]) \
            if plan is not None else None
        self._fetched = None  # a local copy of the starting checkpoint read onto this node from the driver's

    @property
    def resume(self):
        """``(uri, directory, marker)`` of the checkpoint this attempt starts from, or None."""
        return self.plan.resume if self.plan is not None else None

    def restored_cursor(self, index):
        """The data cursor the ``index``-th prepared loader had when the starting checkpoint was reported."""
        marker = self.resume[2] if self.resume else None
        cursors = ((marker or {}).get("cursors") or [])
        return cursors[index] if index < len(cursors) else None

    def add_loader(self, loader):
        """Register a prepared loader; returns its index (the cursors are saved in this order)."""
        self.loaders.append(loader)
        return len(self.loaders) - 1

    def checkpoint(self):
        """The starting :class:`Checkpoint`: where it is, or a local copy on this node when it is a folder on the
        driver's disk and this rank runs on another node."""
        if not self.resume:
            return None
        uri, directory, marker = self.resume
        plan = self.plan
        if marker is None or plan.home is None or is_uri(plan.storage_root) or \
                plan.home == restart_point.this_node():
            return Checkpoint(uri)
        if self._fetched is None:
            self._fetched = rank_files.fetch(plan.storage_root, directory, sorted(marker.get("files") or {}),
                                             rank_files.scratch_folder(), home=plan.home)
            logger.info("Rank %d read the checkpoint %s from the driver's node into %s",
                        self.context.get_world_rank(), uri, self._fetched)
        return Checkpoint(self._fetched)

    def close(self):
        """Remove the local copy of the starting checkpoint, if one was made (the attempt is over)."""
        fetched, self._fetched = self._fetched, None
        if fetched is not None:
            shutil.rmtree(fetched, ignore_errors=True)

    def report(self, metrics, checkpoint=None, checkpoint_dir_name=None):
        how = {"caller": "raysgd.train.report", "call": True}
        expect(isinstance(metrics, dict) and all(isinstance(key, str) for key in metrics), "metrics",
               "a dict with str keys", metrics, TypeError, typed=True, **how)
        expect(checkpoint is None or isinstance(checkpoint, Checkpoint), "checkpoint",
               "a raysgd.train.Checkpoint (Checkpoint.from_directory(path))", checkpoint, TypeError, typed=True, **how)
        name = checkpoint_dir_name
        expect(name is None or (isinstance(name, str) and name and "/" not in name and not name.startswith(".")),
               "checkpoint_dir_name", "a folder name (no '/', not starting with '.')", name, **how)
        source = None
        if checkpoint is not None:
            where = "remote" if not checkpoint.is_local else "not a directory (any more)"
            expect(checkpoint.is_local and os.path.isdir(checkpoint.path), "checkpoint", "a checkpoint of a local "
                   "directory of this worker (Checkpoint.from_directory(folder))", checkpoint,
                   got=f"{checkpoint.path!r}, which is {where}", **how)
            source = checkpoint.path
        if self.reporter is None:  # a session without a plan (tests of the loaders): nothing to write
            return None
        return self.reporter.report(metrics, source, checkpoint_dir_name)


@contextlib.contextmanager
def running(session):
    """Make ``session`` the current one while the training function runs."""
    _current.append(session)
    try:
        yield session
    finally:
        _current.remove(session)


def last_metrics() -> dict[str, Any]:
    """The metrics this rank reported last in the running attempt (``{}`` before any, or outside a function)."""
    if not _current or _current[-1].reporter is None:
        return {}
    return _current[-1].reporter.last_metrics or {}


def is_running() -> bool:
    """Whether a training function runs in this process (a :class:`Session` is open).

    Example:
        >>> is_running()
        False
    """
    return bool(_current)


def current(what: str = "this function") -> Session:
    """The running :class:`Session`; a clear error outside the training function."""
    if not _current:
        raise RuntimeError(f"raysgd.train.{what} works only inside the training function that TorchTrainer runs on "
                           f"its workers")
    return _current[-1]


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None,
           checkpoint_dir_name: str | None = None) -> None:
    """Report ``metrics`` (a dict) and optionally a :class:`Checkpoint` of a local directory. A collective: every rank
    calls it the same number of times, and it returns once the checkpoint is durable. Every rank's directory is merged
    into ``storage_path/name/<checkpoint_dir_name or checkpoint_NNNNNN>`` (a file several ranks report is written
    once), its marker last, with the metrics and the prepared loaders' data cursors (see
    :mod:`raysgd.train.reporting`). The metrics reach ``Result`` and the callbacks as reported.

    Example:
        >>> def train_func(config):  # inside TorchTrainer(train_func, ...)  # doctest: +SKIP
        ...     with tempfile.TemporaryDirectory() as folder:
        ...         torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
        ...         raysgd.train.report({"loss": 0.1}, checkpoint=Checkpoint.from_directory(folder))
    """
    current("report()").report(metrics, checkpoint, checkpoint_dir_name)


def get_checkpoint() -> Checkpoint | None:
    """The latest reported checkpoint when this run of the training function started (after a failure, or when a
    script re-runs with the same ``name`` and ``storage_path``), or None.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     checkpoint = raysgd.train.get_checkpoint()
        ...     if checkpoint:
        ...         with checkpoint.as_directory() as folder:
        ...             model.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    """
    return current("get_checkpoint()").checkpoint()


def get_context() -> TrainContext:
    """This worker's :class:`TrainContext`.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     rank = raysgd.train.get_context().get_world_rank()
    """
    return current("get_context()").context


def get_dataset_shard(dataset_name: str | None = "train") -> Any:
    """This worker's shard of ``TorchTrainer(datasets={dataset_name: ray_dataset})``: a Ray Data ``DataIterator``
    (``iter_torch_batches(batch_size=...)``). ``dataset_name`` is Ray Train's argument; None or nothing reads
    ``"train"``. Ray Data shards have no data cursor: a restart re-reads the epoch.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     for batch in raysgd.train.get_dataset_shard("train").iter_torch_batches(batch_size=32): ...
    """
    shards = current("get_dataset_shard()").dataset_shards
    name = "train" if dataset_name is None else dataset_name
    if name not in shards:
        raise KeyError(f"raysgd.train.get_dataset_shard({name!r}): no dataset of that name was passed to "
                       f"TorchTrainer(datasets=...); it has {sorted(shards)}")
    return shards[name]
