"""Timers: how long the named parts of a worker's call took (``train(profile=True)``'s ``profile`` dict).

Layer 0: the standard library, numpy and :mod:`raysgd.base`. Public through :mod:`raysgd.utils`, as in RaySGD 1.x.

Example:
    >>> timers = TimerCollection()
    >>> with timers.record("fwd"):
    ...     pass
    >>> sorted(timers.stats())
    ['mean_fwd_s']
"""
import collections
import contextlib
import time
from typing import cast

import numpy as np

from raysgd.base.checks import expect, is_int, plain


class TimerStat:
    """A context-manager timer keeping the last ``window_size`` durations (an int >= 0; None keeps them all).

    Example:
        >>> t = TimerStat()
        >>> with t:
        ...     pass
        >>> t.count
        1
    """

    def __init__(self, window_size=10):
        expect(window_size is None or is_int(window_size), "window_size", "an int >= 0 or None", window_size,
               TypeError, caller="TimerStat", typed=True)
        expect(window_size is None or window_size >= 0, "window_size", "an int >= 0 or None", window_size,
               caller="TimerStat")
        self._window_size = window_size = plain(window_size)  # numpy's int too: deque takes Python's only
        self._samples: collections.deque[float] = collections.deque(maxlen=window_size)
        self._units_processed: collections.deque[float] = collections.deque(maxlen=window_size)
        self._start_time: float | None = None
        self._total_time = 0.0
        self.count = 0

    def __enter__(self):
        if self._start_time is not None:
            raise RuntimeError("TimerStat is not re-entrant: it is already timing.")
        self._start_time = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc_value, tb):
        self.push(time.perf_counter() - cast(float, self._start_time))  # set by __enter__
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
