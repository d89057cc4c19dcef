"""The elastic range of workers: how many to start with, and the sizes a restart may try.

Layer 5 helper of :mod:`raysgd.torch.torch_trainer` (standard library and layers 0-4).
``num_workers=(min, max)`` starts with as many workers as fit now between the two, and a restart
never goes below ``min``; an int ``N`` keeps 1.x's meaning: ``N`` at start, down to 1 after a failure.

Example:
    >>> restart_sizes(4, low=2)
    [4, 3, 2]
    >>> restart_sizes(1, low=2)
    []
"""
import logging
import time

import ray

from raysgd.torch import recovery

logger = logging.getLogger(__name__)


def restart_sizes(fit, low):
    """The group sizes a restart tries, largest first: from ``fit`` down to ``low`` (none when ``fit < low``)."""
    return list(range(fit, low - 1, -1))


def start_first_group(start, how_many_fit, low, high, is_range, timeout_s):
    """Start the first group with ``start(n)``; returns the size started.

    An int ``num_workers`` starts ``high`` (waiting for the placement as in 1.x). A range starts as
    many as fit now, at least ``low``; when not even ``low`` can be placed within the placement
    timeout, ``TimeoutError`` names the minimum and the free resources.
    """
    if not is_range:
        return start(high)
    size = max(low, how_many_fit(high, settle_s=1.0))  # a moment for Ray's view of just-freed resources
    try:
        return start(size)
    except TimeoutError as err:
        if size > low:  # resources went away meanwhile: the minimum may still fit
            try:
                return start(low)
            except TimeoutError as again:
                err = again
        raise TimeoutError(f"TorchTrainer(num_workers=({low}, {high})): not even the minimum of {low} workers could "
                           f"be placed within {timeout_s:.0f} s; free resources: {ray.available_resources()}") from err


def scale_up_target(group, high, last_resize, cooldown_s):
    """The larger group size to restart at now (resources returned, cooldown passed), or None to stay."""
    current = group.num_workers
    if current >= high:
        return None
    extra = group.how_many_fit(high - current)
    logger.debug("scale-up check: %d of %d workers, %d more fit, %.1f s since the last resize", current, high,
                 extra, time.monotonic() - last_resize)
    if not recovery.should_scale_up(current, high, extra, time.monotonic(), last_resize, cooldown_s):
        return None
    logger.info("Scaling up from %d to %d workers", current, current + extra)
    return current + extra
