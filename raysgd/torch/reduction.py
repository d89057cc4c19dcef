"""Reducing the per-worker metric dicts of one call into one dict.

Layer 0 (numpy only). ``num_samples`` is summed; ``last_*``, ``batch_count`` and ``epoch`` are
averaged over workers; every other number is averaged weighted by each worker's ``num_samples``;
NaN or missing values are left out (1.12's nanmean); non-numbers (e.g. ``profile``) come from rank 0.
A NaN (a diverging rank) is logged, one warning per call naming each metric's ranks.

Example:
    >>> reduce_worker_stats([{"num_samples": 30, "loss": 1.0}, {"num_samples": 10, "loss": 3.0}])
    {'num_samples': 40, 'loss': 1.5}
"""
import logging
import numbers

import numpy as np

from raysgd.utils import BATCH_COUNT, NUM_SAMPLES

logger = logging.getLogger(__name__)

_UNWEIGHTED = {BATCH_COUNT, "epoch"}


def _is_number(value):
    return isinstance(value, numbers.Number) and not isinstance(value, bool)


def reduce_worker_stats(stats):
    """Reduce a list of per-worker dicts (rank order) as the module docstring says."""
    if not stats:
        return {}
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
