"""Inside the training function: the worker's context, ``report``, ``get_checkpoint`` and ``get_dataset_shard``.

Part of :mod:`raysgd.train`. The function worker (:mod:`raysgd.train.function_worker`) opens one
:class:`Session` per run of the training function (:func:`running`); the module functions read it, so they work
only inside ``train_loop_per_worker``. ``report(metrics, checkpoint=...)`` on rank 0 copies the checkpoint's
directory to ``storage_path/name/checkpoint_NNNNNN`` (marker last, see :mod:`raysgd.train.run_storage`), with the
metrics and the data cursors of the loaders made by ``prepare_data_loader`` (their ``exactly_once`` flag); the
other ranks' checkpoints are not copied (DDP replicas hold the same state).

Example:
    >>> get_context()
    Traceback (most recent call last):
    ...
    RuntimeError: raysgd.train.get_context() works only inside the training function that TorchTrainer runs on its workers
"""
import contextlib
import logging
import numbers

from raysgd.train.checkpoint import Checkpoint
from raysgd.train.run_storage import RunFolder

logger = logging.getLogger(__name__)

_current = []  # the running session (at most one per process)


class TrainContext:
    """Where this worker stands: ``get_world_size()``, ``get_world_rank()``, ``get_local_rank()``, ...

    Example:
        >>> TrainContext(world_size=2, world_rank=1, local_rank=1, local_world_size=2, node_rank=0,
        ...              experiment_name="exp", storage_path="/tmp").get_world_rank()
        1
    """

    def __init__(self, world_size, world_rank, local_rank, local_world_size, node_rank, experiment_name,
                 storage_path):
        self._values = dict(world_size=world_size, world_rank=world_rank, local_rank=local_rank,
                            local_world_size=local_world_size, node_rank=node_rank, experiment_name=experiment_name,
                            storage_path=storage_path)

    def get_world_size(self):
        """How many workers run the training function."""
        return self._values["world_size"]

    def get_world_rank(self):
        """This worker's rank among all workers."""
        return self._values["world_rank"]

    def get_local_rank(self):
        """This worker's rank among the workers of its node."""
        return self._values["local_rank"]

    def get_local_world_size(self):
        """How many workers run on this worker's node."""
        return self._values["local_world_size"]

    def get_node_rank(self):
        """The index of this worker's node among the run's nodes."""
        return self._values["node_rank"]

    def get_experiment_name(self):
        """The run's ``RunConfig(name=...)``."""
        return self._values["experiment_name"]

    def get_trial_name(self):
        """The run's name (there are no Tune trials here)."""
        return self._values["experiment_name"]

    def get_storage_path(self):
        """The run's ``RunConfig(storage_path=...)``."""
        return self._values["storage_path"]

    def get_metadata(self):
        """Ray Train's run metadata: always ``{}`` here."""
        return {}

    def __repr__(self):
        return f"TrainContext({self._values})"


class Session:
    """One run of the training function on one worker: its context, device, the checkpoint it started from, the
    loaders it prepared and what it reported."""

    def __init__(self, context, device, run_folder, resume=None, dataset_shards=None, num_to_keep=None):
        self.context, self.device, self.run_folder = context, device, run_folder
        self.resume = resume  # (uri, marker) of the checkpoint this run starts from, or None
        self.dataset_shards = dataset_shards or {}
        self.num_to_keep = num_to_keep
        self.loaders = []  # the PreparedLoaders, in the order they were made
        self.last_metrics, self.last_checkpoint, self.reports = None, None, 0

    def restored_cursor(self, index):
        """The data cursor the ``index``-th prepared loader had when the starting checkpoint was reported."""
        cursors = (self.resume[1].get("cursors") or []) if self.resume else []
        return cursors[index] if index < len(cursors) else None

    def add_loader(self, loader):
        """Register a prepared loader; returns its index (the cursors are saved in this order)."""
        self.loaders.append(loader)
        return len(self.loaders) - 1

    def report(self, metrics, checkpoint=None):
        if not isinstance(metrics, dict) or not all(isinstance(key, str) for key in metrics):
            raise TypeError(f"raysgd.train.report(metrics=...) expects a dict with str keys; got "
                            f"{type(metrics).__name__} {metrics!r}")
        if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"raysgd.train.report(checkpoint=...) expects a raysgd.train.Checkpoint "
                            f"(Checkpoint.from_directory(path)); got {type(checkpoint).__name__} {checkpoint!r}")
        self.reports += 1
        metrics = {key: (value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value)
                   for key, value in metrics.items()}
        if self.context.get_world_rank() != 0:
            return
        if checkpoint is not None:
            if not checkpoint.is_local:
                raise ValueError(f"raysgd.train.report: the checkpoint must be a local directory of this worker; "
                                 f"got {checkpoint.path!r}")
            cursors = [loader.cursor_state() for loader in self.loaders]
            uri = self.run_folder.write(checkpoint.path, {"metrics": _plain(metrics), "cursors": cursors,
                                                          "world_size": self.context.get_world_size(),
                                                          "report": self.reports}, self.num_to_keep)
            self.last_checkpoint = uri
            metrics = {**metrics, "checkpoint_dir_name": uri.rstrip("/").split("?")[0].rsplit("/", 1)[-1]}
        self.last_metrics = metrics


def _plain(metrics):
    """The JSON-friendly part of ``metrics`` (numbers, strings, bools; others as their repr)."""
    return {key: value if isinstance(value, (numbers.Number, str, bool, type(None))) else repr(value)
            for key, value in metrics.items()}


@contextlib.contextmanager
def running(session):
    """Make ``session`` the current one while the training function runs."""
    _current.append(session)
    try:
        yield session
    finally:
        _current.remove(session)


def is_running():
    """Whether a training function runs in this process (a :class:`Session` is open).

    Example:
        >>> is_running()
        False
    """
    return bool(_current)


def current(what="this function"):
    """The running :class:`Session`; a clear error outside the training function."""
    if not _current:
        raise RuntimeError(f"raysgd.train.{what} works only inside the training function that TorchTrainer runs on "
                           f"its workers")
    return _current[-1]


def report(metrics, checkpoint=None):
    """Report ``metrics`` (a dict) and optionally a :class:`Checkpoint`: rank 0's directory is copied to
    ``storage_path/name/checkpoint_NNNNNN`` (marker last) with the metrics and the prepared loaders' data cursors.

    Example:
        >>> def train_func(config):  # inside TorchTrainer(train_func, ...)  # doctest: +SKIP
        ...     with tempfile.TemporaryDirectory() as folder:
        ...         torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
        ...         raysgd.train.report({"loss": 0.1}, checkpoint=Checkpoint.from_directory(folder))
    """
    current("report()").report(metrics, checkpoint)


def get_checkpoint():
    """The latest reported checkpoint when this run of the training function started (after a failure, or when a
    script re-runs with the same ``name`` and ``storage_path``), or None.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     checkpoint = raysgd.train.get_checkpoint()
        ...     if checkpoint:
        ...         with checkpoint.as_directory() as folder:
        ...             model.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    """
    session = current("get_checkpoint()")
    return Checkpoint(session.resume[0]) if session.resume else None


def get_context():
    """This worker's :class:`TrainContext`.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     rank = raysgd.train.get_context().get_world_rank()
    """
    return current("get_context()").context


def get_dataset_shard(name="train"):
    """This worker's shard of ``TorchTrainer(datasets={name: ray_dataset})``: a Ray Data ``DataIterator``
    (``iter_torch_batches(batch_size=...)``). Ray Data shards have no data cursor: a restart re-reads the epoch.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     for batch in raysgd.train.get_dataset_shard("train").iter_torch_batches(batch_size=32): ...
    """
    shards = current("get_dataset_shard()").dataset_shards
    if name not in shards:
        raise KeyError(f"raysgd.train.get_dataset_shard({name!r}): no dataset of that name was passed to "
                       f"TorchTrainer(datasets=...); it has {sorted(shards)}")
    return shards[name]


def open_run_folder(storage_path, name):
    """The :class:`~raysgd.train.run_storage.RunFolder` of a run (on a worker)."""
    return RunFolder(storage_path, name)
