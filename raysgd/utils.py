"""Metric meters, timers and the public constants shared by every layer.

Layer 0: imports only the standard library and numpy.

Example:
    >>> from raysgd.utils import AverageMeterCollection, NUM_SAMPLES
    >>> meters = AverageMeterCollection()
    >>> meters.update({"loss": 0.5}, n=32)
    >>> meters.update({"loss": 0.1}, n=32)
    >>> meters.summary()["loss"], meters.summary()["last_loss"]
    (0.3, 0.1)
"""
import collections
import contextlib
import numbers
import sys
import time

import numpy as np

#: Number of batches a worker ran in one call (a metric key).
BATCH_COUNT = "batch_count"
#: Number of samples a worker saw in one call (a metric key, and the weight of its other metrics).
NUM_SAMPLES = "num_samples"
#: Config key for the *global* batch size; each worker's config holds ``global // num_workers``.
BATCH_SIZE = "*batch_size"


class AverageMeter:
    """Running average of one metric; tensors stay on their device until the average is read.

    Python numbers are summed on the host, exactly as in RaySGD 1.x. A one-element tensor is added
    to a float64 sum on its own device without reading it, so updating never waits for the device;
    ``sum`` and ``avg`` copy the device sums to the host when read (``val`` is the last value as given).

    Example:
        >>> m = AverageMeter()
        >>> m.update(2.0, n=3); m.update(4.0, n=1)
        >>> m.avg, m.val, m.count
        (2.5, 4.0, 4)
    """

    def __init__(self):
        self.reset()

    def reset(self):
        """Forget every value."""
        self.val = 0
        self.count = 0
        self._sum = 0  # the Python numbers' part of the sum
        self._device_sums = {}  # device -> float64 0-d tensor: the tensors' part, never read while updating
        self._updated = False

    def update(self, val, n=1):
        """Add ``val`` (a number or a one-element tensor) with weight ``n``."""
        self.val = val
        self.count += n
        self._updated = True
        if not (_is_tensor(val) and val.numel() == 1):
            self._sum += val * n
            return
        val = self.val = val.detach().reshape(())
        total = self._device_sums.get(val.device)
        if total is None:
            self._device_sums[val.device] = val.double() * n
        elif _is_tensor(n):
            total.add_(val.double() * n)
        else:
            total.add_(val, alpha=n)

    @property
    def sum(self):
        """The weighted sum (reads the device sums: a host sync when tensors were added)."""
        return self._sum + sum(to_host(list(self._device_sums.values())))

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
            sums = list(meter._device_sums.values())
            layout.append((key, meter._sum, len(sums)))
            values += sums + [meter.count, meter.val]
        tensors = [key for key, value in self._latest.items() if _is_tensor(value) and value.numel() == 1]
        values += [self._latest[key] for key in tensors]
        host = iter(to_host(values))
        state = {BATCH_COUNT: self._batch_count, NUM_SAMPLES: next(host), "meters": {}, "latest": dict(self._latest)}
        for key, total, num_sums in layout:
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


def _scalar(value):
    """A one-element tensor as a detached 0-d tensor on its device; a numpy scalar as a Python number."""
    if _is_tensor(value):
        return value.detach().reshape(()) if value.numel() == 1 else value
    if hasattr(value, "item") and getattr(value, "size", None) == 1:
        return value.item()
    return value


def _is_number(value):
    """A number to average: a non-bool Python number, or a 0-d real (non-bool) tensor."""
    if _is_tensor(value):
        return value.dim() == 0 and not value.is_complex() and value.dtype is not sys.modules["torch"].bool
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


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


class TimerStat:
    """A context-manager timer keeping the last ``window_size`` durations.

    Example:
        >>> t = TimerStat()
        >>> with t:
        ...     pass
        >>> t.count
        1
    """

    def __init__(self, window_size=10):
        self._window_size = window_size
        self._samples = collections.deque(maxlen=window_size)
        self._units_processed = collections.deque(maxlen=window_size)
        self._start_time = None
        self._total_time = 0.0
        self.count = 0

    def __enter__(self):
        if self._start_time is not None:
            raise RuntimeError("TimerStat is not re-entrant: it is already timing.")
        self._start_time = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc_value, tb):
        self.push(time.perf_counter() - self._start_time)
        self._start_time = None

    def push(self, duration):
        """Record one duration in seconds."""
        self._samples.append(duration)
        self._total_time += duration
        self.count += 1

    def push_units_processed(self, n):
        """Record how many units the last timed block processed (for throughput)."""
        self._units_processed.append(n)

    def reset(self):
        """Forget every sample."""
        self._samples.clear()
        self._units_processed.clear()
        self._total_time = 0.0
        self.count = 0

    def _stat(self, fn):
        return float(fn(self._samples)) if self._samples else 0.0

    @property
    def mean(self):
        return self._stat(np.mean)

    @property
    def median(self):
        return self._stat(np.median)

    @property
    def sum(self):
        return self._stat(np.sum)

    @property
    def max(self):
        return self._stat(np.max)

    @property
    def first(self):
        return self._samples[0] if self._samples else None

    @property
    def last(self):
        return self._samples[-1] if self._samples else None

    @property
    def size(self):
        return len(self._samples)

    @property
    def mean_units_processed(self):
        return float(np.mean(self._units_processed)) if self._units_processed else 0.0

    @property
    def mean_throughput(self):
        time_total = float(np.sum(self._samples))
        return float(np.sum(self._units_processed)) / time_total if time_total else 0.0


class TimerCollection:
    """Named :class:`TimerStat` timers that cost nothing while disabled.

    Example:
        >>> timers = TimerCollection()
        >>> with timers.record("fwd"):
        ...     pass
        >>> sorted(timers.stats())
        ['mean_fwd_s']
    """

    def __init__(self):
        self._timers = collections.defaultdict(TimerStat)
        self._enabled = True

    def disable(self):
        self._enabled = False

    def enable(self):
        self._enabled = True

    def reset(self):
        for timer in self._timers.values():
            timer.reset()

    def record(self, key):
        """A context manager timing the block under ``key`` (a no-op while disabled)."""
        if self._enabled:
            return self._timers[key]
        return contextlib.nullcontext()

    def stats(self, mean=True, last=False):
        """``{"mean_<key>_s": ..., "last_<key>_s": ...}`` for every timer that ran."""
        out = {}
        for key, timer in self._timers.items():
            if timer.count > 0:
                if mean:
                    out[f"mean_{key}_s"] = timer.mean
                if last:
                    out[f"last_{key}_s"] = timer.last
        return out


def override(interface_class):
    """Decorator checking that a method really overrides one of ``interface_class``.

    Example:
        >>> class Base:
        ...     def setup(self, config): ...
        >>> class Mine(Base):
        ...     @override(Base)
        ...     def setup(self, config): ...
    """

    def check(method):
        if method.__name__ not in dir(interface_class):
            raise NameError(f"{method.__name__} does not override any method of {interface_class.__name__}")
        return method

    return check
