"""How the global batch divides among the workers at each size: an even split, or a fixed batch per worker.

Layer 1 (the standard library and layer 0). ``config[BATCH_SIZE]`` is the global batch size. By default every
one of ``n`` workers gets ``BATCH_SIZE // n`` (:func:`split_batch_size`); with ``fixed_worker_batch=True`` every
worker gets ``BATCH_SIZE / max_workers`` at every size and one optimizer step accumulates ``k`` micro-batches
(:func:`split_fixed`; ``k`` goes into the worker config under ``ACCUMULATION_STEPS``, see
:mod:`raysgd.torch.operator.accumulation`). Each returns ``(worker_config, effective_global)``.

Example:
    >>> split_batch_size({"*batch_size": 21}, 2, warn=False)  # 21 on 2 workers: 10 each (warns by default)
    ({'*batch_size': 10}, 20)
    >>> steps_for(num_workers=1, max_workers=4), steps_for(3, 4)
    (4, 1)
    >>> split_fixed({"*batch_size": 8}, num_workers=1, max_workers=2)
    ({'*batch_size': 4, '*accumulation_steps': 2}, 8)
"""
import warnings

from raysgd.base.checks import expect, is_whole
from raysgd.torch.constants import ACCUMULATION_STEPS, BATCH_SIZE


def splitter(fixed_worker_batch, max_workers):
    """The split a trainer uses at every size: :func:`split_fixed` for ``max_workers``, or :func:`split_batch_size`;
    called as ``split(config, num_workers, warn=True)``.

    Example:
        >>> splitter(True, 4)({"*batch_size": 8}, 2, warn=False)
        ({'*batch_size': 2, '*accumulation_steps': 2}, 8)
    """
    if not fixed_worker_batch:
        return split_batch_size
    return lambda config, num_workers, warn=True: split_fixed(config, num_workers, max_workers, warn)


def split_batch_size(config, num_workers, warn=True):
    """``(worker_config, effective_global)``: a copy of ``config`` with ``BATCH_SIZE`` divided among workers.

    An uneven total is rounded down to a multiple of ``num_workers``, with a ``UserWarning`` (when ``warn``)
    naming ``BATCH_SIZE``, the workers and each one's batch. A total smaller than ``num_workers`` (a worker
    would get 0) raises ``ValueError``. Without ``BATCH_SIZE`` the config is copied unchanged and the effective
    global size is None.

    Example:
        >>> split_batch_size({"*batch_size": 2}, 3)
        Traceback (most recent call last):
        ValueError: TorchTrainer: config[BATCH_SIZE] expects an int >= the number of workers (3), so that every worker's batch holds a sample; got 2
    """
    worker_config = dict(config)
    if BATCH_SIZE not in config:
        return worker_config, None
    total = config[BATCH_SIZE]
    expect(is_whole(total, 1), "config[BATCH_SIZE]", "an int > 0 (the global batch size)", total, caller="TorchTrainer")
    total = int(total)  # numpy's or 64.0 too: a DataLoader refuses them as a batch size
    expect(total >= num_workers, "config[BATCH_SIZE]", f"an int >= the number of workers ({num_workers}), so that "
           "every worker's batch holds a sample", total, caller="TorchTrainer")
    per_worker = total // num_workers
    if per_worker * num_workers != total and warn:
        warnings.warn(f"BATCH_SIZE {total} does not divide among {num_workers} workers: each worker gets a batch "
                      f"of {per_worker}, a global batch of {per_worker * num_workers}. Use a multiple of "
                      f"{num_workers} to train with exactly {total}.", UserWarning, stacklevel=3)
    worker_config[BATCH_SIZE] = per_worker
    return worker_config, per_worker * num_workers


def steps_for(num_workers, max_workers):
    """Micro-batches per optimizer step at ``num_workers`` of ``max_workers``: ``max / n`` rounded to nearest, >= 1."""
    return max(1, (max_workers + num_workers // 2) // num_workers)


def split_fixed(config, num_workers, max_workers, warn=True):
    """``(worker_config, effective_global)``: ``BATCH_SIZE / max_workers`` per worker and ``k`` micro-batches.

    Without ``BATCH_SIZE`` the loaders' own batch size is the fixed per-worker batch; the effective
    global size is then None. When ``max_workers`` is no multiple of ``num_workers`` the global batch
    differs from the requested one: a ``UserWarning`` (when ``warn``) says so.
    """
    steps = steps_for(num_workers, max_workers)
    if steps * num_workers != max_workers and warn:
        warnings.warn(f"fixed_worker_batch: {num_workers} workers of at most {max_workers} accumulate {steps} "
                      f"micro-batch(es) per optimizer step, a global batch {steps * num_workers}/{max_workers} of "
                      f"the requested one (BATCH_SIZE or the loaders' batch times {max_workers}).", UserWarning,
                      stacklevel=3)
    worker_config = dict(config)
    worker_config[ACCUMULATION_STEPS] = steps
    if BATCH_SIZE not in config:
        return worker_config, None
    per_worker = int(config[BATCH_SIZE]) // max_workers  # numpy's or 64.0 too: a DataLoader refuses them
    worker_config[BATCH_SIZE] = per_worker
    return worker_config, per_worker * num_workers * steps
