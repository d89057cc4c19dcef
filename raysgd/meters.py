"""Metric meters and their reduction: sample-weighted running averages that keep tensors on their device until
read, and the reduction of the per-worker results of one call into one dict.

Layer 0: imports the standard library, numpy and :mod:`raysgd.base`; tensors are handled when torch is already
imported (a tensor cannot exist otherwise). The meters are public through :mod:`raysgd.utils`, as in RaySGD 1.x.

Reducing the workers' results (:func:`reduce_worker_stats`): ``num_samples`` is summed; ``last_*``, ``batch_count``
and ``epoch`` are averaged over workers; every other real number is averaged weighted by each worker's
``num_samples``. One-element tensors and numpy arrays (a custom loop's ``total / n``) count as the numbers they
hold; NaN or missing values are left out (1.12's nanmean), so a metric only some ranks report (rank 0 having
run no batch, say) is theirs; other values (``profile``, a string, a complex number) come from rank 0, or from the
first rank that reports them. A NaN (a diverging rank) is logged, one warning per call naming each metric's ranks.

Example:
    >>> import torch
    >>> meters = AverageMeterCollection()
    >>> meters.update({"loss": torch.tensor(0.5)}, n=32)  # no read of the tensor here
    >>> meters.update({"loss": 0.1}, n=32)
    >>> meters.summary()
    {'batch_count': 2, 'num_samples': 64, 'loss': 0.3, 'last_loss': 0.1}
    >>> reduce_worker_stats([{"num_samples": 30, "loss": 1.0}, {"num_samples": 10, "loss": 3.0}])
    {'num_samples': 40, 'loss': 1.5}
"""
import collections
import logging
import sys
import types
from typing import cast

import numpy as np

from raysgd.base.checks import is_number, plain

logger = logging.getLogger(__name__)

#: Number of batches a worker ran in one call (a metric key).
BATCH_COUNT = "batch_count"
#: Number of samples a worker saw in one call (a metric key, and the weight of its other metrics).
NUM_SAMPLES = "num_samples"


class AverageMeter:
    """Running average of one metric; tensors stay on their device until the average is read.

    Python numbers are summed on the host, exactly as in RaySGD 1.x. One-element tensors are never
    read while updating, so a loop on a GPU does not wait for the device: they are kept (at most
    ``FOLD_EVERY`` of them) and then added, on their device, into a float64 sum. ``sum`` and ``avg``
    copy the device sums to the host when read (``val`` is the last value as given).

    Example:
        >>> m = AverageMeter()
        >>> m.update(2.0, n=3); m.update(4.0, n=1)
        >>> m.avg, m.val, m.count
        (2.5, 4.0, 4)
    """

    #: Tensors kept before they are added up on their device (one stack and sum per group, no per-step op).
    FOLD_EVERY = 64

    def __init__(self):
        self.reset()

    def reset(self):
        """Forget every value."""
        self.val = 0
        self.count = 0
        self._sum = 0  # the Python numbers' part of the sum
        self._pending = []  # (tensor, weight) not yet folded into _device_sums
        self._device_sums = {}  # device -> float64 0-d tensor: the tensors' part, never read while updating
        self._updated = False

    def update(self, val, n=1):
        """Add ``val`` (a number or a one-element tensor) with weight ``n``."""
        self.count += n
        self._updated = True
        if not (_is_tensor(val) and val.numel() == 1):
            self.val = val
            self._sum += val * n
            return
        if val.dim() or val.requires_grad:
            val = val.detach().reshape(())
        self.val = val
        self._pending.append((val, n))
        if len(self._pending) >= self.FOLD_EVERY:
            self._fold()

    def _fold(self):
        """Add the pending tensors into the float64 sums on their devices: device work only, no read."""
        torch = cast(types.ModuleType, sys.modules.get("torch"))  # imported: a tensor exists
        groups = collections.defaultdict(list)
        for val, n in self._pending:
            weighted = _is_tensor(n)
            groups[val.device, val.dtype, None if weighted else n].append(val.double() * n if weighted else val)
        self._pending = []
        for (device, _, n), vals in groups.items():
            part = torch.stack(vals).sum(dtype=torch.float64) * (1 if n is None else n)
            if device in self._device_sums:
                self._device_sums[device].add_(part)
            else:
                self._device_sums[device] = part

    def _device_parts(self):
        self._fold()
        return list(self._device_sums.values())

    @property
    def sum(self):
        """The weighted sum (reads the device sums: a host sync when tensors were added)."""
        return sum(to_host([self._sum] + self._device_parts()))  # _sum is a tensor after a tensor weight

    @property
    def avg(self):
        """The weighted mean: 0 before any update, NaN when the weights add up to 0."""
        if not self._updated:
            return 0
        count = to_host([self.count])[0]
        return self.sum / count if count else float("nan")


class AverageMeterCollection:
    """One :class:`AverageMeter` per metric key, plus batch and sample counts.

    ``summary()`` returns ``batch_count``, ``num_samples`` and, for each key ``k``,
    the sample-weighted mean ``k`` and the last value ``last_k``, all as Python values.
    ``update`` accepts numbers and one-element tensors and never reads a tensor, so a training loop
    on a GPU does not wait for the device on every batch; ``summary()`` and ``state()`` copy
    everything to the host at once (one transfer per device).

    Example:
        >>> c = AverageMeterCollection()
        >>> c.update({"acc": 1.0}, n=2); c.update({"acc": 0.0}, n=2)
        >>> c.summary()
        {'batch_count': 2, 'num_samples': 4, 'acc': 0.5, 'last_acc': 0.0}
    """

    def __init__(self):
        self._batch_count = 0
        self.n = 0
        self._meters = collections.defaultdict(AverageMeter)
        self._latest = {}

    def update(self, metrics, n=1):
        """Record one batch's ``metrics`` dict, weighted by ``n`` samples.

        One-element tensors and numpy scalars count as numbers; any other non-number (a string, say)
        is not averaged: the summary reports its last value.
        """
        n = _scalar(n)  # a numpy count (np.sum of a mask) as a Python one: summary() gives Python values
        self._batch_count += 1
        self.n += n
        for key, value in metrics.items():
            value = _scalar(value)
            if _is_number(value):
                self._meters[key].update(value, n=n)
            else:
                self._latest[key] = value

    def summary(self):
        """The averaged metrics as a dict of Python values (see the class docstring)."""
        state = self.state()
        stats = {BATCH_COUNT: state[BATCH_COUNT], NUM_SAMPLES: state[NUM_SAMPLES]}
        for key, meter in state["meters"].items():
            stats[str(key)] = meter["sum"] / meter["count"] if meter["count"] else float("nan")
            stats["last_" + str(key)] = meter["val"]
        for key, value in state["latest"].items():
            stats[str(key)] = value
        return stats

    def state(self):
        """Everything recorded so far as Python values, for a checkpoint; :meth:`from_state` rebuilds it.

        ``{"batch_count", "num_samples", "meters": {key: {"sum", "count", "val"}}, "latest": {key: value}}``.

        Example:
            >>> c = AverageMeterCollection()
            >>> c.update({"loss": 2.0}, n=4)
            >>> AverageMeterCollection.from_state(c.state()).summary() == c.summary()
            True
        """
        values, layout = [self.n], []
        for key, meter in self._meters.items():
            sums = meter._device_parts()
            layout.append((key, len(sums)))
            values += [meter._sum] + sums + [meter.count, meter.val]  # _sum and count hold a tensor n's tensors
        tensors = [key for key, value in self._latest.items() if _is_tensor(value) and value.numel() == 1]
        values += [self._latest[key] for key in tensors]
        host = iter([plain(v) for v in to_host(values)])  # numpy's numbers as Python's too
        state = {BATCH_COUNT: self._batch_count, NUM_SAMPLES: next(host), "meters": {}, "latest": dict(self._latest)}
        for key, num_sums in layout:
            total = next(host)
            for _ in range(num_sums):
                total += next(host)
            state["meters"][key] = {"sum": total, "count": next(host), "val": next(host)}
        state["latest"].update(zip(tensors, host))
        return state

    @classmethod
    def from_state(cls, state):
        """A collection holding what :meth:`state` returned; later updates add to it."""
        collection = cls()
        collection._batch_count = state[BATCH_COUNT]
        collection.n = state[NUM_SAMPLES]
        for key, saved in state["meters"].items():
            meter = collection._meters[key]
            meter._sum, meter.count, meter.val, meter._updated = saved["sum"], saved["count"], saved["val"], True
        collection._latest = dict(state["latest"])
        return collection


def _is_tensor(value):
    torch = sys.modules.get("torch")  # a tensor can only exist once torch is imported: never import it here
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_bool():
    return sys.modules["torch"].bool


def _scalar(value):
    """A one-element tensor as a detached 0-d tensor on its device; a numpy scalar as a Python number."""
    if _is_tensor(value):
        if value.dim() == 0 and not value.requires_grad:
            return value  # already what the meters keep (the default loops return such tensors)
        return value.detach().reshape(()) if value.numel() == 1 else value
    if hasattr(value, "item") and getattr(value, "size", None) == 1:
        return value.item()
    return value


def _is_number(value):
    """A number to average: a real non-bool number (``is_number``: a complex one is not), or a 0-d real (non-bool)
    tensor."""
    if _is_tensor(value):
        dtype = value.dtype
        return value.dim() == 0 and (dtype.is_floating_point or not (dtype.is_complex or dtype == _torch_bool()))
    return is_number(value)


def to_host(values):
    """``values`` with every one-element tensor replaced by its Python value, copied in one transfer per device.

    Other values pass through. Integer and bool tensors give ``int`` and ``bool``, floating ones ``float``.

    Example:
        >>> import torch
        >>> to_host([1, torch.tensor(2.5), torch.tensor([3])])
        [1, 2.5, 3]
    """
    values = list(values)
    by_device = collections.defaultdict(list)
    for index, value in enumerate(values):
        if _is_tensor(value) and value.numel() == 1:
            by_device[value.device].append(index)
    for indices in by_device.values():
        torch = sys.modules["torch"]
        tensors = [values[i].detach().reshape(()) for i in indices]
        if any(t.is_complex() for t in tensors):
            host = [t.item() for t in tensors]
        else:
            host = torch.stack([t.to(torch.float64) for t in tensors]).tolist()  # the one sync
        for index, tensor, value in zip(indices, tensors, host):
            if tensor.dtype is torch.bool:
                value = bool(value)
            elif not (tensor.is_floating_point() or tensor.is_complex()):
                value = int(value)
            values[index] = value
    return values


# ----------------------------------------------------------------- reducing the workers' results
_UNWEIGHTED = {BATCH_COUNT, "epoch"}


def _as_numbers(metrics):
    """``metrics`` with one-element tensors, numpy arrays and numpy scalars as Python numbers (``to_host``), others
    as given."""
    if not metrics:
        return metrics
    values = to_host(metrics.values())  # one device read per worker dict, not one per metric
    values = [v.item() if isinstance(v, (np.ndarray, np.generic)) and v.size == 1 else v for v in values]
    return dict(zip(metrics.keys(), values))


def reduce_worker_stats(stats):
    """Reduce a list of per-worker dicts (rank order) as the module docstring says."""
    if not stats:
        return {}
    stats = [_as_numbers(s) for s in stats]
    samples = [s.get(NUM_SAMPLES) for s in stats]
    reduced = {}
    if any(is_number(n) for n in samples):
        reduced[NUM_SAMPLES] = plain(sum(n for n in samples if is_number(n)))
    weights = np.array(samples, dtype=float) if all(is_number(n) for n in samples) else None
    nan_ranks = {}  # key -> ranks that reported NaN (a missing key is not NaN: that rank had no batches)
    keys = dict.fromkeys(key for s in stats for key in s)  # rank 0's first; a rank without batches lacks them
    for key in keys:
        if key == NUM_SAMPLES:
            continue
        values = [s.get(key) for s in stats]
        first = next((v for v in values if v is not None), None)  # rank 0's, or the first rank's that has it
        if not all(is_number(v) or v is None for v in values) or not is_number(first):
            reduced[key] = first
            continue
        array = np.array([np.nan if v is None else v for v in values], dtype=float)
        if all(v == first for v in values):
            reduced[key] = plain(first)
            continue
        valid = ~np.isnan(array)
        reported_nan = [rank for rank, v in enumerate(values) if v is not None and np.isnan(v)]
        if reported_nan:
            nan_ranks[key] = reported_nan
        if not valid.any():
            reduced[key] = float("nan")
        elif weights is None or key in _UNWEIGHTED or key.startswith("last_") or weights[valid].sum() <= 0:
            reduced[key] = float(array[valid].mean())
        else:
            reduced[key] = float(np.average(array[valid], weights=weights[valid]))
    if nan_ranks:
        logger.warning("NaN metrics left out of the mean over workers (a diverging worker?): %s; those "
                       "workers' samples still count in num_samples.",
                       ", ".join(f"{key} on rank(s) {ranks}" for key, ranks in nan_ranks.items()))
    return reduced


def merge_partial(earlier, later):
    """One worker's metrics over two consecutive parts of an epoch (each a summary with ``num_samples``).

    ``num_samples`` and ``batch_count`` add up, ``last_*`` come from ``later``, other numbers are
    averaged weighted by ``num_samples``.

    Example:
        >>> merge_partial({"num_samples": 30, "batch_count": 3, "loss": 1.0},
        ...               {"num_samples": 10, "batch_count": 1, "loss": 3.0})
        {'num_samples': 40, 'batch_count': 4, 'loss': 1.5}
    """
    if not earlier:
        return later
    if not later:
        return earlier
    earlier, later = _as_numbers(earlier), _as_numbers(later)
    n1, n2 = earlier.get(NUM_SAMPLES, 0) or 0, later.get(NUM_SAMPLES, 0) or 0
    merged = dict(earlier)
    for key, value in later.items():
        old = earlier.get(key)
        if key in (NUM_SAMPLES, BATCH_COUNT) and is_number(old) and is_number(value):
            merged[key] = old + value
        elif key.startswith("last_") or not (is_number(old) and is_number(value)) or n1 + n2 <= 0:
            merged[key] = value
        else:
            merged[key] = (old * n1 + value * n2) / (n1 + n2)
    return merged


def merge_partials(earlier, later):
    """Per-worker metrics of an epoch resumed on ``len(later)`` workers after ``len(earlier)`` committed some.

    The committed part of old rank ``i`` is merged into new rank ``i % len(later)``.
    """
    merged = list(later)
    for index, part in enumerate(earlier or ()):
        if part and merged:
            merged[index % len(merged)] = merge_partial(part, merged[index % len(merged)])
    return merged
