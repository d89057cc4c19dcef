"""Pure recovery policy: backoff schedule, how many workers fit, when to scale up, when to give up.

Giving up includes a placement group whose bundles stay unplaced (:class:`PlacementWatch`).

Layer 3: standard library only (no Ray, no torch), so it is unit-tested with fake clocks.

Example:
    >>> list(backoff_delays(tries=5, base_s=1, cap_s=4))
    [1, 2, 4, 4, 4]
    >>> workers_that_fit([{"CPU": 3.0}, {"CPU": 1.0}], cpus_per_worker=2, gpus_per_worker=0, limit=8)
    1
"""
import logging
import math
import time

logger = logging.getLogger(__name__)


def backoff_delays(tries, base_s=1.0, cap_s=60.0):
    """Capped exponential delays ``base, 2*base, 4*base, ...`` (at most ``cap_s``), ``tries`` of them."""
    for attempt in range(tries):
        yield min(cap_s, base_s * (2 ** attempt))


def workers_that_fit(nodes, cpus_per_worker, gpus_per_worker, limit):
    """How many workers fit on nodes with the given free resources (one dict per node), at most ``limit``.

    Each worker needs ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs on one node.
    """
    total = 0
    for free in nodes:
        fits = math.inf
        if cpus_per_worker > 0:
            fits = min(fits, math.floor(free.get("CPU", 0.0) / cpus_per_worker + 1e-9))
        if gpus_per_worker > 0:
            fits = min(fits, math.floor(free.get("GPU", 0.0) / gpus_per_worker + 1e-9))
        total += limit if fits == math.inf else int(fits)
        if total >= limit:
            return limit
    return total


def should_scale_up(current, target, extra_fit, now, last_resize, cooldown_s):
    """Grow the pool when it is below ``target``, more workers fit, and ``cooldown_s`` passed since the last resize."""
    return current < target and extra_fit > 0 and (now - last_resize) >= cooldown_s


class PlacementWatch:
    """How long a placement group has been unplaced, and whether to give up on it (after ``limit_s``).

    Feed it one observation at a time; a placed observation resets the clock.

    Example:
        >>> now = [0.0]
        >>> watch = PlacementWatch(limit_s=20, clock=lambda: now[0])
        >>> watch.observe(placed=False), watch.unplaced_s
        (False, 0.0)
        >>> now[0] = 25.0
        >>> watch.observe(placed=False), watch.unplaced_s
        (True, 25.0)
    """

    def __init__(self, limit_s, clock=time.monotonic):
        self.limit_s = limit_s
        self._clock = clock
        self._since = None
        self.unplaced_s = 0.0

    def observe(self, placed):
        """Record whether the group is placed now; returns True once it has been unplaced for ``limit_s``."""
        now = self._clock()
        if placed:
            self._since, self.unplaced_s = None, 0.0
            return False
        if self._since is None:
            self._since = now
        self.unplaced_s = now - self._since
        return self.unplaced_s >= self.limit_s


class RestartGaveUp(RuntimeError):
    """No worker could be (re)started within the allowed tries; ``__cause__`` is the last failure."""


def restart_with_backoff(try_start, how_many_fit, *, tries, base_s=1.0, cap_s=60.0, sleep=time.sleep,
                         retryable=(Exception,)):
    """Start as many workers as fit, waiting with capped exponential backoff while none fit or start fails.

    Args:
        try_start: ``try_start(n)`` starts ``n`` workers and returns the number started; it raises one of
            ``retryable`` when they died while starting.
        how_many_fit: ``how_many_fit()`` returns how many workers fit now.
        tries: attempts before :class:`RestartGaveUp` is raised (from the last failure).

    Returns the number of workers started.
    """
    last_error = None
    for attempt, delay in enumerate(backoff_delays(tries, base_s, cap_s)):
        n = how_many_fit()
        if n > 0:
            try:
                return try_start(n)
            except retryable as err:
                last_error = err
                logger.warning("Starting %d workers failed (try %d of %d): %s", n, attempt + 1, tries, err)
        else:
            logger.warning("No worker fits now (try %d of %d); waiting %.0f s", attempt + 1, tries, delay)
        if attempt + 1 < tries:
            sleep(delay)
    message = f"could not start any worker after {tries} tries"
    if last_error is None:
        message += ": no worker fit the free resources"
    raise RestartGaveUp(message) from last_error
