"""Pure recovery policy: backoff schedule, how many workers fit, the sizes to restart or move at, when to give up.

Giving up includes a placement group whose bundles stay unplaced (:class:`PlacementWatch`).

Layer 1: the standard library and layer 0 (no Ray, no torch), so it is unit-tested with fake clocks.
``num_workers=(min, max)`` starts with as many workers as fit now between the two, and a restart never goes
below ``min``; an int ``N`` keeps 1.x's meaning: ``N`` at start, down to 1 after a failure.

Example:
    >>> list(backoff_delays(tries=5, base_s=1, cap_s=4))
    [1.0, 2.0, 4.0, 4.0, 4.0]
    >>> workers_that_fit([{"CPU": 3.0}, {"CPU": 1.0}], cpus_per_worker=2, gpus_per_worker=0, limit=8)
    1
"""
import dataclasses
import logging
import math
import time

from raysgd.base import environment
from raysgd.torch.fault_tolerance.failure_policy import backoff_s

logger = logging.getLogger(__name__)


def backoff_delays(tries, base_s=1.0, cap_s=60.0):
    """Capped exponential delays ``base, 2*base, 4*base, ...`` (at most ``cap_s``), ``tries`` of them."""
    for attempt in range(tries):
        yield backoff_s(attempt + 2, base_s, cap_s)  # the failure policy's: the wait after attempt + 2 in a row


def workers_that_fit(nodes, cpus_per_worker, gpus_per_worker, limit, per_node=None):
    """How many workers fit on nodes with the given free resources (one dict per node), at most ``limit``.

    Each worker needs ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs on one node; ``per_node`` caps
    what one node holds (1 for a ``STRICT_SPREAD`` placement group).

    Example:
        >>> workers_that_fit([{"CPU": 4}, {"CPU": 2}], 1, 0, limit=8), workers_that_fit([{"CPU": 4}], 1, 0, 8, 1)
        (6, 1)
    """
    total = 0
    for free in nodes:
        fits = math.inf
        if cpus_per_worker > 0:
            fits = min(fits, math.floor(free.get("CPU", 0.0) / cpus_per_worker + 1e-9))
        if gpus_per_worker > 0:
            fits = min(fits, math.floor(free.get("GPU", 0.0) / gpus_per_worker + 1e-9))
        fits = min(fits, per_node if per_node is not None else math.inf)
        total += limit if fits == math.inf else int(fits)
        if total >= limit:
            return limit
    return total


def fit_for_strategy(free_by_node, own_nodes, strategy, cpus_per_worker, gpus_per_worker, limit):
    """How many more workers a group of placement ``strategy`` can take now, at most ``limit``.

    ``free_by_node``: ``{node: free resources}``; ``own_nodes``: the nodes holding the group's own bundles (empty
    when it has none). ``STRICT_SPREAD`` needs a node of its own for each worker: one more per node the group is
    not on. ``STRICT_PACK`` keeps every worker on one node: what the group's node (or, with none, the best node)
    holds. Other strategies count every free slot.

    Example:
        >>> free = {"a": {"CPU": 3}, "b": {"CPU": 3}}
        >>> [fit_for_strategy(free, {"a"}, s, 1, 0, 8) for s in ("SPREAD", "STRICT_SPREAD", "STRICT_PACK")]
        [6, 1, 3]
    """
    if strategy == "STRICT_SPREAD":
        others = [free for node, free in free_by_node.items() if node not in own_nodes]
        return workers_that_fit(others, cpus_per_worker, gpus_per_worker, limit, per_node=1)
    if strategy == "STRICT_PACK":
        candidates = [free for node, free in free_by_node.items() if node in own_nodes] if own_nodes \
            else list(free_by_node.values())
        return max((workers_that_fit([free], cpus_per_worker, gpus_per_worker, limit) for free in candidates),
                   default=0)
    return workers_that_fit(list(free_by_node.values()), cpus_per_worker, gpus_per_worker, limit)


def placement_try_s():
    """``SGD_PLACEMENT_TRY_S``: how long a restart waits for a size above the minimum to be placed (default 3)."""
    return environment.get("SGD_PLACEMENT_TRY_S")


def move_size(num_workers, leaving, fit, low, high):
    """The size to restart a group of ``num_workers`` at without its ``leaving`` workers (on draining nodes), at most
    ``high``: those that stay plus ``fit(limit)``, the workers that fit elsewhere now (at most ``limit``); None
    when fewer than ``low`` would remain (the group then stays until the nodes go).

    Example:
        >>> move_size(2, leaving=1, fit=lambda limit: min(limit, 1), low=1, high=2)  # one leaves, one fits elsewhere
        2
        >>> move_size(2, leaving=2, fit=lambda limit: min(limit, 1), low=2, high=2) is None  # only 1 fits: stay
        True
    """
    stay = num_workers - leaving
    size = min(high, stay + fit(max(0, high - stay)))
    return size if size >= max(low, 1) else None


def should_scale_up(current, target, extra_fit, now, last_resize, cooldown_s):
    """Grow the pool when it is below ``target``, more workers fit, and ``cooldown_s`` passed since the last resize."""
    return current < target and extra_fit > 0 and (now - last_resize) >= cooldown_s


@dataclasses.dataclass(frozen=True)
class ResizeDecision:
    """A planned change of the group's size: to ``size`` workers, for ``reason`` (``"to grow"``, ``"to leave
    draining nodes"``). The controller carries it out (at a commit point, or between calls) and logs it.

    Example:
        >>> ResizeDecision(4, "to grow", 2).describe()
        'resize from 2 to 4 workers (to grow)'
    """

    size: int
    reason: str
    current: int = 0

    def describe(self):
        return f"resize from {self.current} to {self.size} workers ({self.reason})"


def grow_decision(current, high, extra_fit, now, last_resize, cooldown_s):
    """A :class:`ResizeDecision` to grow a group of ``current`` workers by the ``extra_fit`` that fit now (at most to
    ``high``), once ``cooldown_s`` passed since the last resize; None to stay.

    Example:
        >>> grow_decision(2, 4, extra_fit=1, now=30.0, last_resize=0.0, cooldown_s=10).size
        3
        >>> grow_decision(2, 4, extra_fit=1, now=5.0, last_resize=0.0, cooldown_s=10) is None  # in the cooldown
        True
    """
    if not should_scale_up(current, high, extra_fit, now, last_resize, cooldown_s):
        return None
    return ResizeDecision(min(high, current + extra_fit), "to grow", current)


def move_decision(num_workers, leaving, fit, low, high):
    """A :class:`ResizeDecision` to move the ``leaving`` workers (on draining nodes) of a group of ``num_workers``
    elsewhere (:func:`move_size`); None when the group must stay until the nodes go.

    Example:
        >>> move_decision(2, leaving=1, fit=lambda limit: min(limit, 1), low=1, high=2).size
        2
    """
    size = move_size(num_workers, leaving, fit, low, high)
    return None if size is None else ResizeDecision(size, "to leave draining nodes", num_workers)


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


def place_largest(start, fit_now, first, low, try_s, full_s):
    """Start the largest group from ``first`` down to ``low`` workers that can be placed; returns its size.

    ``start(size, timeout_s)`` raises ``TimeoutError`` when ``size`` workers are not placed within ``timeout_s``;
    ``fit_now(limit)`` counts how many fit now (Ray's resource view, at most ``limit``). A size the view says
    fits is placed at once when it really fits, so a size above ``low`` gets only ``try_s``: one that is not
    placed by then means the view lags (a lost node still counted). The next size tried is what fits now, not
    merely one less, so no time goes to sizes that do not fit; ``low`` gets ``full_s``.

    Example:
        >>> tried = []
        >>> def start(size, timeout_s):
        ...     tried.append((size, timeout_s))
        ...     if size > 2:
        ...         raise TimeoutError
        >>> place_largest(start, fit_now=lambda limit: min(limit, 2), first=5, low=1, try_s=3, full_s=10), tried
        (2, [(5, 3), (2, 3)])
    """
    size = first
    while True:
        try:
            start(size, full_s if size <= low else try_s)
            return size
        except TimeoutError:
            if size <= low:
                raise
            size = max(low, min(size - 1, fit_now(size - 1)))


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
