"""RaySGD 1.x's sharded ``Dataset`` for ``train(dataset=...)``, as a thin adapter over Ray Data.

Outside the core layers (an integration at the edge, like Tune): imports ray, torch, numpy and
:mod:`raysgd.torch.integrations.ray_data`, whose streaming split and shards do the work. RaySGD 1.12 built this
class on ``ray.util.iter`` (deprecated and unmaintained in Ray 2.x); here the items become a Ray
Data dataset of ``{"x", "y"}`` rows, ``download_func`` runs as a Ray Data ``map`` (at most
``max_concurrency`` tasks at a time), and the trainer splits it with ``streaming_split``.

As in 1.12:

* each worker reads its own shard (``train(dataset=...)`` splits it among the workers there are);
* a batch is ``batch_size`` items per worker, each item an ``(x, y)`` pair, turned into
  ``(torch.cat(xs), torch.cat(ys))``; ``transform`` runs on the worker, on each ``x`` only;
* ``train(dataset=ds, num_steps=N)`` trains exactly ``N`` batches on every worker: the shard is read
  again from its start whenever it runs out (1.12 repeated the items forever).

Differences: float64 values arrive as float32 (as with ``DatasetInput``); ``num_steps=None``
reads each shard once (1.12's endless shards never finished); a shard's last batch of a pass may
be short, where 1.12 batched across the repeat; each ``train()`` call starts a new pass.

Example:
    >>> import torch
    >>> to_mat = lambda v: torch.tensor([[v]])
    >>> ds = Dataset([i * 0.001 for i in range(1000)], batch_size=32, max_concurrency=2,
    ...              download_func=lambda v: (to_mat(v), to_mat(v)))
    >>> ds.batch_size, ds.max_concurrency
    (32, 2)
    >>> trainer.train(dataset=ds, num_steps=100)  # doctest: +SKIP
"""
import itertools

import numpy as np
import torch

from raysgd import optional
from raysgd.base.checks import expect, is_int
from raysgd.torch.integrations.ray_data import DatasetInput


def _as_array(value, what):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as err:  # noqa: BLE001 (re-raised with what was wrong)
        raise TypeError(f"raysgd.data.Dataset: the {what} of an item must be a tensor, an array or a number; "
                        f"got {type(value).__name__}") from err


def _pair_row(item):
    """An ``(x, y)`` item as a Ray Data row ``{"x": array, "y": array}``."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise TypeError(f"raysgd.data.Dataset: every item (after download_func) must be an (x, y) pair; "
                        f"got {type(item).__name__} {str(item)[:80]}")
    return {"x": _as_array(item[0], "input"), "y": _as_array(item[1], "label")}


class _Download:
    """The Ray Data ``map`` function: ``download_func`` on the item, then the ``(x, y)`` row."""

    def __init__(self, download_func):
        self.download_func = download_func

    def __call__(self, row):
        return _pair_row(self.download_func(row["item"]))


def _cat(parts):
    return torch.cat(parts) if parts[0].dim() > 0 else torch.stack(parts)


class ConcatBatch:
    """Worker side: a ``{"x", "y"}`` batch as 1.12's ``(torch.cat(xs), torch.cat(ys))``, ``transform`` on each x.

    Example:
        >>> x = torch.arange(6.0).view(3, 1, 2)  # 3 items of shape (1, 2)
        >>> [t.shape for t in ConcatBatch()({"x": x, "y": torch.zeros(3, 1)})]
        [torch.Size([3, 2]), torch.Size([3])]
    """

    def __init__(self, transform=None):
        self.transform = transform

    def __call__(self, batch):
        xs, ys = list(batch["x"].unbind(0)), list(batch["y"].unbind(0))
        if self.transform is not None:
            xs = [torch.as_tensor(self.transform(x)) for x in xs]
        return _cat(xs), _cat(ys)


class Dataset:
    """1.x's sharded dataset: ``Dataset(data, batch_size=32, download_func=None, max_concurrency=0, transform=None)``.

    Args:
        data: the items (any finite iterable; a list of paths, numbers ...). Without ``download_func``
            each item must be an ``(x, y)`` pair of tensors, arrays or numbers.
        batch_size: items per batch, per worker.
        download_func: ``item -> (x, y)``, run in Ray Data tasks (e.g. to fetch a file).
        max_concurrency: at most this many ``download_func`` tasks at a time (0: Ray Data decides).
        transform: ``x -> x``, run on the training worker on each input (not on labels).

    Example:
        >>> ds = Dataset([(torch.ones(1, 3), torch.zeros(1, 1))] * 8, batch_size=4)
        >>> ds.set_num_shards(2)  # what train(dataset=ds) does with 2 workers  # doctest: +SKIP
    """

    def __init__(self, data, batch_size=32, download_func=None, max_concurrency=0, transform=None):
        if type(data).__name__ == "ParallelIterator":
            raise TypeError("raysgd.data.Dataset takes the items themselves (a list), not a ray.util.iter "
                            "ParallelIterator (deprecated in Ray 2.x); for Ray Data datasets use "
                            "raysgd.torch.integrations.ray_data.DatasetInput")
        how = {"caller": "raysgd.data.Dataset", "call": True}
        expect(not isinstance(data, (str, bytes)) and hasattr(data, "__iter__"), "data", "an iterable of items", data,
               TypeError, got=type(data).__name__, **how)
        expect(is_int(batch_size, 1), "batch_size", "an int >= 1", batch_size, **how)
        expect(is_int(max_concurrency, 0), "max_concurrency", "an int >= 0", max_concurrency, **how)
        for name, fn in (("download_func", download_func), ("transform", transform)):
            expect(fn is None or callable(fn), name, "a callable or None", fn, TypeError, **how)
        self._items = list(data)
        if not self._items:
            raise ValueError("raysgd.data.Dataset(data=...) is empty")
        self.batch_size = int(batch_size)
        self.download_func = download_func
        self.max_concurrency = int(max_concurrency)
        self.transform = transform
        self.num_shards = 1
        self._ray_dataset = None

    def ray_dataset(self):
        """The Ray Data dataset of ``{"x", "y"}`` rows (built on first use; ``download_func`` runs lazily)."""
        if self._ray_dataset is None:
            data = optional.require("ray.data", "raysgd.data.Dataset")  # Ray Data stays optional until used
            if self.download_func is None:
                self._ray_dataset = data.from_items([_pair_row(item) for item in self._items])
            else:
                pool = data.TaskPoolStrategy(size=self.max_concurrency) if self.max_concurrency else None
                extra = {"compute": pool} if pool is not None else {}
                self._ray_dataset = data.from_items([{"item": item} for item in self._items]).map(
                    _Download(self.download_func), **extra)
        return self._ray_dataset

    def as_dataset_input(self, repeat=True):
        """What ``train(dataset=self)`` reads: a :class:`~raysgd.torch.integrations.ray_data.DatasetInput` (1.12's batches)."""
        return DatasetInput(self.ray_dataset(), label_column="y", feature_columns=["x"], batch_size=self.batch_size,
                            repeat=repeat, convert=ConcatBatch(self.transform))

    def set_num_shards(self, num_shards):
        """Split the items into ``num_shards`` shards (``train(dataset=...)`` splits by the worker count itself)."""
        expect(is_int(num_shards, 1), "set_num_shards", "an int >= 1", num_shards)
        self.num_shards = int(num_shards)

    def get_shard(self, i):
        """Shard ``i`` as an endless iterator of batches, each a list of ``batch_size`` ``(x, y)`` tensor pairs.

        Every ``num_shards``-th item from item ``i``, read in the driver (1.12's ``get_shard``). A shard that holds
        no item (more shards than items) yields nothing. ``i`` out of range raises ``IndexError`` at once.
        """
        expect(is_int(i), "get_shard", "a shard index (an int)", i, TypeError)
        if not 0 <= i < self.num_shards:
            raise IndexError(f"shard {i} of {self.num_shards}: call set_num_shards first")
        return self._batches(int(i))

    def _batches(self, i):
        def items():
            while True:
                empty = True
                for row in itertools.islice(self.ray_dataset().iter_rows(), i, None, self.num_shards):
                    empty = False
                    x = torch.tensor(row["x"])  # a copy: Ray's arrays are read-only
                    yield (torch.as_tensor(self.transform(x)) if self.transform else x), torch.tensor(row["y"])
                if empty:  # a shard with no item: repeating it would never yield (a hang)
                    return

        stream = items()
        while True:
            batch = list(itertools.islice(stream, self.batch_size))
            if not batch:
                return
            yield batch
