"""Reducing the per-worker metric dicts of one call into one dict.

Layer 0 (numpy only). ``num_samples`` is summed; ``last_*``, ``batch_count`` and ``epoch`` are
averaged over workers; every other number is averaged weighted by each worker's ``num_samples``.
One-element tensors and numpy arrays (a custom loop's ``total / n``) count as the numbers they hold;
NaN or missing values are left out (1.12's nanmean); non-numbers (e.g. ``profile``) come from rank 0.
A NaN (a diverging rank) is logged, one warning per call naming each metric's ranks.

Example:
    >>> reduce_worker_stats([{"num_samples": 30, "loss": 1.0}, {"num_samples": 10, "loss": 3.0}])
    {'num_samples': 40, 'loss': 1.5}
"""
import logging
import numbers

import numpy as np

from raysgd.utils import BATCH_COUNT, NUM_SAMPLES, to_host

logger = logging.getLogger(__name__)

_UNWEIGHTED = {BATCH_COUNT, "epoch"}


def _is_number(value):
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


def _as_numbers(metrics):
    """``metrics`` with one-element tensors and numpy arrays as Python numbers (``to_host``), others as given."""
    if not metrics:
        return metrics
    values = to_host(metrics.values())  # one device read per worker dict, not one per metric
    values = [v.item() if isinstance(v, np.ndarray) and v.size == 1 else v for v in values]
    return dict(zip(metrics.keys(), values))


def reduce_worker_stats(stats):
    """Reduce a list of per-worker dicts (rank order) as the module docstring says."""
    if not stats:
        return {}
    stats = [_as_numbers(s) for s in stats]
    samples = [s.get(NUM_SAMPLES) for s in stats]
    reduced = {}
    if any(_is_number(n) for n in samples):
        reduced[NUM_SAMPLES] = sum(n for n in samples if _is_number(n))
    weights = np.array(samples, dtype=float) if all(_is_number(n) for n in samples) else None
    nan_ranks = {}  # key -> ranks that reported NaN (a missing key is not NaN: that rank had no batches)
    for key, first in stats[0].items():
        if key == NUM_SAMPLES:
            continue
        values = [s.get(key) for s in stats]
        if not all(_is_number(v) or v is None for v in values) or not _is_number(first):
            reduced[key] = first
            continue
        array = np.array([np.nan if v is None else v for v in values], dtype=float)
        if all(v == first for v in values):
            reduced[key] = first
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
        if key in (NUM_SAMPLES, BATCH_COUNT) and _is_number(old) and _is_number(value):
            merged[key] = old + value
        elif key.startswith("last_") or not (_is_number(old) and _is_number(value)) or n1 + n2 <= 0:
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
