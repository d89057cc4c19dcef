"""Ray Data input for ``train(dataset=...)``: one streaming-split shard per worker, read as torch batches.

Helper of layer 7 (:mod:`raysgd.torch.torch_trainer`): imports ray, and ``ray.data`` only when a
dataset is given. It replaces RaySGD 1.12's MLDataset input, which Ray removed.

``trainer.train(dataset=ds)`` splits ``ds`` with ``ds.streaming_split(num_workers, equal=True)``:
worker ``i`` iterates split ``i`` for that call, so each row is seen once per call by exactly one
worker (``equal=True`` keeps the batch counts equal, as DDP needs; it drops at most
``num_workers - 1`` rows when the count does not divide). ``num_steps`` stops each worker after
that many batches; the next call starts a new pass over ``ds`` on a new split (a reader still
blocked on the stopped pass could otherwise take rows of the next pass from the shared split). The
split is kept and reused while the dataset and the workers stay the same and each call reads a whole
pass; when a failure restarts the workers (possibly fewer), the retried epoch splits ``ds`` again
among the workers there are.

What a batch looks like (``DatasetInput`` options):

- ``label_column=None``: a dict ``{column: tensor}``; override ``train_batch`` to read it.
- ``label_column="y"``: a tuple ``(*features, label)`` for the default ``train_batch``: the
  ``feature_columns`` (default: every other column, in schema order), each a tensor; a scalar
  column becomes shape ``(batch, 1)``. The label keeps its shape (``(batch,)`` for a scalar
  column, as ``CrossEntropyLoss`` wants) unless ``label_shape`` is given (``(1,)`` for ``MSELoss``).
- float64 columns arrive as float32 unless ``dtypes`` (passed to ``iter_torch_batches``) names
  them in its ``{column: dtype}`` dict or is one dtype for every column.

Example:
    >>> import ray  # doctest: +SKIP
    >>> ds = ray.data.from_items([{"x": float(i), "y": 2.0 * i} for i in range(1000)])  # doctest: +SKIP
    >>> trainer.train(dataset=DatasetInput(ds, label_column="y", label_shape=(1,)))  # doctest: +SKIP
"""
import gc
import logging
import queue
import threading
from typing import Any, Mapping, cast

import ray
from ray.util.placement_group import get_current_placement_group

from raysgd import optional
from raysgd.base import environment
from raysgd.base.checks import expect, is_int, is_number, plain
from raysgd.torch.execution import cluster_state
from raysgd.torch.constants import BATCH_SIZE
from raysgd.torch.training_operator import TrainingOperator

logger = logging.getLogger(__name__)

#: Batch size per worker when neither ``DatasetInput(batch_size=...)`` nor the config gives one.
DEFAULT_BATCH_SIZE = 32
#: Seconds without a batch after which the worker logs a warning (Ray Data may lack free CPUs).
SLOW_BATCH_WARNING_S = 30.0


class DatasetInput:
    """A Ray Data ``Dataset`` with how to read it: batch size, columns, dtypes (see the module docstring).

    Args:
        dataset: a ``ray.data.Dataset`` (``from_numpy``, ``from_items``, ``read_parquet``, ...).
        label_column: the target column; None yields dict batches.
        feature_columns: the input columns, in order (default: all but the label).
        label_shape: view the label as ``(batch, *label_shape)``.
        batch_size: per worker; default ``config[BATCH_SIZE] // num_workers``, else
            ``config["batch_size"]``, else 32.
        dtypes: a torch dtype or ``{column: dtype}`` for ``iter_torch_batches``.
        drop_last, local_shuffle_buffer_size, prefetch_batches: passed to ``iter_torch_batches``.
        batch_timeout_s: a worker waiting longer than this for one batch raises ``TimeoutError``
            (default: the trainer's ``timeout_s``).
        repeat: read the shard again and again (a new pass each time it ends), for ``num_steps``
            beyond one pass; stops after a pass that yielded no batch.
        convert: ``convert(batch)`` on the worker turns each dict batch into what ``train_batch``
            gets, instead of the column handling above (``raysgd.data.Dataset`` uses it).

    Example:
        >>> import ray  # doctest: +SKIP
        >>> ds = ray.data.from_numpy(features).zip(ray.data.from_numpy(labels))  # doctest: +SKIP
        >>> trainer.train(dataset=DatasetInput(ds, label_column="data_1", batch_size=64))  # doctest: +SKIP
    """

    def __init__(self, dataset, *, label_column=None, feature_columns=None, label_shape=None, batch_size=None,
                 dtypes=None, drop_last=False, local_shuffle_buffer_size=None, prefetch_batches=1,
                 batch_timeout_s=None, repeat=False, convert=None):
        Dataset = optional.require("ray.data", "DatasetInput").Dataset  # noqa: N806 (Ray Data: optional until used)

        how = {"caller": "DatasetInput", "call": True}
        expect(isinstance(dataset, Dataset), "dataset", "a ray.data.Dataset", dataset, TypeError,
               got=type(dataset).__name__, **how)
        expect(label_column is None or isinstance(label_column, str), "label_column", "a column name (str) or None",
               label_column, TypeError, **how)
        if feature_columns is not None:
            expect(not isinstance(feature_columns, str) and all(isinstance(c, str) for c in feature_columns),
                   "feature_columns", "a list of column names", feature_columns, TypeError, **how)
            if label_column is None:
                raise ValueError("DatasetInput(feature_columns=...) needs label_column: without it batches are "
                                 "dicts of every column")
            feature_columns = list(feature_columns)
            expect(feature_columns, "feature_columns", "at least one column name (None: every column but the label)",
                   feature_columns, **how)
            expect(label_column not in feature_columns, "feature_columns", f"columns apart from the label column "
                   f"{label_column!r} (the model would see its target)", feature_columns, **how)
        expect(label_shape is None or (isinstance(label_shape, tuple) and all(is_int(d, 1) for d in label_shape)),
               "label_shape", "a tuple of ints > 0 such as (1,)", label_shape, TypeError, **how)
        expect(batch_size is None or is_int(batch_size, 1), "batch_size", "an int > 0 or None", batch_size, **how)
        expect(batch_timeout_s is None or is_number(batch_timeout_s, above=0), "batch_timeout_s",
               "seconds > 0 or None", batch_timeout_s, **how)
        _check_columns(dataset, label_column, feature_columns)
        _check_iter_options(dtypes, drop_last, local_shuffle_buffer_size, prefetch_batches, how)
        expect(repeat in (True, False), "repeat", "True or False", repeat, TypeError, **how)
        self.dataset = dataset
        self.label_column = label_column
        self.feature_columns = feature_columns
        self.label_shape = label_shape
        self.batch_size = batch_size
        self.batch_timeout_s = batch_timeout_s
        self.repeat = bool(repeat)
        expect(convert is None or callable(convert), "convert", "a callable or None", convert, TypeError, **how)
        self.convert = convert
        self.iter_options = dict(dtypes=dtypes, drop_last=bool(drop_last), prefetch_batches=plain(prefetch_batches),
                                 local_shuffle_buffer_size=plain(local_shuffle_buffer_size))


def _check_columns(dataset, label_column, feature_columns):
    """Refuse a label or feature column the dataset lacks when its schema is known without running it (read or
    built from memory; not after a ``map_batches``): otherwise each worker says so at its first batch."""
    if label_column is None:
        return
    try:
        columns = dataset.columns(fetch_if_missing=False)
    except (AttributeError, TypeError):  # a dataset of another kind or Ray: the workers check at the first batch
        return
    if columns is None:
        return
    missing = [column for column in [*(feature_columns or ()), label_column] if column not in columns]
    if missing:
        raise ValueError(f"DatasetInput names column(s) {missing} that the dataset lacks; its columns are {columns}")


def _check_iter_options(dtypes, drop_last, local_shuffle_buffer_size, prefetch_batches, how):
    """Refuse ``iter_torch_batches``' options up front, which Ray Data would check (or misread: a truthy
    ``drop_last="no"``) only on the workers, at the first batch."""
    import torch  # noqa: PLC0415 (loaded with the operator already)

    expect(drop_last in (True, False), "drop_last", "True or False", drop_last, TypeError, **how)
    expect(is_int(prefetch_batches, 0), "prefetch_batches", "an int >= 0", prefetch_batches, **how)
    expect(local_shuffle_buffer_size is None or is_int(local_shuffle_buffer_size, 1), "local_shuffle_buffer_size",
           "an int >= 1 (rows) or None", local_shuffle_buffer_size, **how)
    expect(dtypes is None or isinstance(dtypes, torch.dtype)
           or (isinstance(dtypes, Mapping) and all(isinstance(c, str) and isinstance(d, torch.dtype)
                                                   for c, d in dtypes.items())),
           "dtypes", "a torch.dtype, a {column: torch.dtype} dict or None", dtypes, TypeError, **how)


def as_input(dataset, operator_cls, num_steps=None):
    """``train(dataset=...)``'s value as a :class:`DatasetInput`, checked against the operator's loop.

    An object with ``as_dataset_input(repeat)`` (1.x's ``raysgd.data.Dataset``) is asked for its
    input, repeating its shards when ``num_steps`` is given.
    """
    Dataset = optional.require("ray.data", "TorchTrainer.train(dataset=...)").Dataset  # noqa: N806 (a class)
    if callable(getattr(dataset, "as_dataset_input", None)):
        dataset = dataset.as_dataset_input(repeat=num_steps is not None)
    if isinstance(dataset, Dataset):
        dataset = DatasetInput(dataset)
    else:
        expect(isinstance(dataset, DatasetInput), "dataset",
               "a ray.data.Dataset or a raysgd.torch.integrations.ray_data.DatasetInput", dataset, TypeError,
               caller="train", call=True, got=type(dataset).__name__)
    default_loop = (operator_cls.train_batch is TrainingOperator.train_batch
                    and operator_cls.train_epoch is TrainingOperator.train_epoch)
    if dataset.label_column is None and default_loop:
        raise ValueError("train(dataset=...) without a label column yields dict batches {column: tensor}, which the "
                         "default train_batch (*features, target = batch) cannot read: pass "
                         "DatasetInput(ds, label_column='<target column>'), or override train_batch.")
    return dataset


def no_cpu_left(held_cpus, most):
    """Why Ray Data's tasks can never get a CPU, as a sentence, or None when they can.

    ``held_cpus``: what the trainer holds (its workers, or a Tune trial's whole placement group); ``most``: the
    most CPUs and GPUs the cluster can ever have (:func:`raysgd.torch.execution.cluster_state.ceiling`; None: unknown).

    Example:
        >>> no_cpu_left(2, {"CPU": 2, "GPU": 0})
        "the trainer holds 2 of the cluster's 2 CPUs, and the cluster cannot grow"
        >>> no_cpu_left(2, {"CPU": 3, "GPU": 0}) is None, no_cpu_left(2, None) is None
        (True, True)
    """
    if most is None or most.get("CPU", 0) - held_cpus >= 1:
        return None
    return f"the trainer holds {held_cpus:g} of the cluster's {most.get('CPU', 0):g} CPUs, and the cluster cannot grow"


def _held_cpus(num_workers, cpus_per_worker):
    trial_pg = get_current_placement_group()  # in a Tune trial: the trainable's bundle too
    if trial_pg is not None:
        return cluster_state.held_by(trial_pg.bundle_specs).get("CPU", 0)
    return num_workers * cpus_per_worker


def rank_inputs(data, reporter, shard_cache, group, config, timeout_s, cpus_per_worker=1):
    """``rank_kwargs(num_workers)`` for ``train_epoch``: each rank's Ray Data shard, rank 0's progress reporter.

    None when there is neither. Called for every attempt, so a retry gets fresh shards. When the workers leave
    Ray Data no CPU (:func:`no_cpu_left`), a shard waits ``SGD_DATA_NO_CPU_S`` for its first batch, not
    ``timeout_s``: a dataset whose tasks need a CPU fails within seconds, saying what to free.
    """
    if data is None and reporter is None:
        return None

    def rank_kwargs(num_workers):
        extra: list[dict[str, Any]] = [{} for _ in range(num_workers)]
        if data is not None:
            starved = no_cpu_left(_held_cpus(num_workers, cpus_per_worker), cluster_state.ceiling())
            shards = shard_cache.shards(data, num_workers, group.generation, config, timeout_s, starved)
            for rank, shard in enumerate(shards):
                extra[rank]["iterator"] = shard
        if reporter is not None:
            extra[0]["progress"] = reporter
        return extra

    return rank_kwargs


def batch_size_per_worker(config, num_workers):
    """``config[BATCH_SIZE] // num_workers`` (at least 1), else ``config["batch_size"]``, else 32.

    Example:
        >>> batch_size_per_worker({"*batch_size": 128}, 2), batch_size_per_worker({}, 2)
        (64, 32)
    """
    if BATCH_SIZE in config:
        return max(1, int(config[BATCH_SIZE]) // num_workers)
    return int(config.get("batch_size", DEFAULT_BATCH_SIZE))


class ShardCache:
    """The trainer's current streaming split, reused while the dataset and the worker generation stay.

    Example:
        >>> cache = ShardCache()
        >>> # shards = cache.shards(DatasetInput(ds, label_column="y"), 2, group.generation, config, 60)
    """

    def __init__(self):
        self._dataset = None
        self._key = None
        self._splits: list | None = None  # the dataset's streaming_split

    def shards(self, data, num_workers, generation, config, default_timeout_s, starved=None):
        """One :class:`Shard` per rank for ``data`` on ``num_workers`` workers of that ``generation``.

        ``starved``: why Ray Data's tasks get no CPU (:func:`no_cpu_left`), or None."""
        key = (num_workers, generation)
        if self._dataset is not data.dataset or self._key != key:
            self.drop()
            if starved:  # once per split, not per call
                logger.warning("train(dataset=...): %s, so Ray Data's tasks get no CPU; a dataset that needs them "
                               "fails after %.0f s", starved, environment.get("SGD_DATA_NO_CPU_S"))
            self._splits = data.dataset.streaming_split(num_workers, equal=True)
            self._dataset, self._key = data.dataset, key
        batch_size = data.batch_size or batch_size_per_worker(config, num_workers)
        timeout_s = data.batch_timeout_s or default_timeout_s
        return [Shard(split, batch_size, data, timeout_s, starved) for split in cast(list, self._splits)]  # split above

    def drop(self):
        """Forget the split (after a failed call or a restart)."""
        self._dataset = self._key = self._splits = None

    def close(self):
        """Forget the split at shutdown, and release its coordinator actor now (its handles sit in cycles)."""
        held = self._splits is not None
        self.drop()
        if held:
            gc.collect()


class Shard:
    """One worker's part of the dataset for one call: an iterable of torch batches (see the module docstring).

    Each batch must arrive within ``timeout_s`` or iteration raises ``TimeoutError``; with ``starved`` (why Ray
    Data's tasks get no CPU) the first one within ``SGD_DATA_NO_CPU_S``, and the error says what to free.
    """

    def __init__(self, split, batch_size, data, timeout_s, starved=None):
        self._split = split
        self.batch_size = batch_size
        self._label = data.label_column
        self._features = data.feature_columns
        self._label_shape = data.label_shape
        self._options = dict(data.iter_options)
        self._timeout_s = timeout_s
        self._repeat, self._convert_fn = data.repeat, data.convert
        self._starved = starved

    def __iter__(self):
        while True:
            batches = self._split.iter_torch_batches(batch_size=self.batch_size, device="cpu", **self._options)
            empty = True
            for batch in _with_deadline(batches, self._timeout_s, self._starved):
                empty = False
                yield self._convert(batch)
            if not self._repeat or empty:
                return

    def _convert(self, batch):
        import torch  # noqa: PLC0415 (the worker has it loaded already)

        dtypes = self._options["dtypes"]
        if not isinstance(dtypes, torch.dtype):  # float64 columns that dtypes does not name arrive as float32
            named = dtypes or {}
            batch = {key: value.float() if value.dtype == torch.float64 and key not in named else value
                     for key, value in batch.items()}
        if self._convert_fn is not None:
            return self._convert_fn(batch)
        if self._label is None:
            return batch
        features = self._features or [column for column in batch if column != self._label]
        missing = [column for column in [*features, self._label] if column not in batch]
        if missing:
            raise ValueError(f"DatasetInput names column(s) {missing} that the dataset lacks; its columns are "
                             f"{list(batch)}")
        inputs = [batch[c].view(-1, 1) if batch[c].dim() == 1 else batch[c] for c in features]
        label = batch[self._label]
        if self._label_shape is not None:
            label = label.view(-1, *self._label_shape)
        return (*inputs, label)


def _free_cpus():
    try:
        return ray.available_resources().get("CPU", 0)
    except Exception:  # noqa: BLE001 (only for a message: Ray may be down)
        return "unknown"


def _no_batch(timeout_s, starved):
    if starved:
        return TimeoutError(
            f"no batch from this worker's Ray Data shard within {timeout_s:g} s, and none can come: {starved}, "
            f"and Ray Data runs the dataset's reads and transforms as tasks that need a CPU. Leave at least 1 CPU "
            f"free for them (more read faster): start Ray with more CPUs (ray.init(num_cpus=...)), or train on "
            f"fewer workers or fewer num_cpus_per_worker; or materialize the dataset (ds = ds.materialize()) "
            f"before the trainer starts (free CPUs now: {_free_cpus()}).")
    return TimeoutError(f"no batch from this worker's Ray Data shard within {timeout_s:g} s. Ray Data runs reads "
                        f"and transforms as Ray tasks: leave CPUs free for them beyond the workers' (free CPUs "
                        f"now: {_free_cpus()}).")


def _with_deadline(iterable, timeout_s, starved=None):
    """Yield from ``iterable`` (run in a helper thread), raising ``TimeoutError`` when an item takes too long.

    With ``starved`` (why Ray Data's tasks get no CPU), the first item gets ``SGD_DATA_NO_CPU_S`` at most.
    Stopping early (``num_steps``) stops the helper thread at its next hand-over.
    """
    handover: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    done = object()

    def put(item):
        while not stop.is_set():
            try:
                handover.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in iterable:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as err:  # noqa: BLE001 (handed to the consumer, which re-raises it)
            put((None, err))

    threading.Thread(target=produce, name="raysgd-ray-data", daemon=True).start()
    first = True
    try:
        while True:
            waited, warned = 0.0, False
            limit = min(timeout_s, environment.get("SGD_DATA_NO_CPU_S")) if first and starved else timeout_s
            while True:
                step = min(limit - waited, SLOW_BATCH_WARNING_S)
                if step <= 0:
                    raise _no_batch(limit, starved if first else None)
                try:
                    item, error = handover.get(timeout=step)
                    break
                except queue.Empty:
                    waited += step
                    if not warned and waited >= SLOW_BATCH_WARNING_S:
                        warned = True
                        logger.warning("Waited %.0f s for a batch from the Ray Data shard; Ray Data needs free CPUs "
                                       "for reads and transforms (free CPUs now: %s)", waited, _free_cpus())
            if error is not None:
                raise error
            if item is done:
                return
            first = False
            yield item
    finally:
        stop.set()
