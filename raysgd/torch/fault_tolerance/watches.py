"""When a committing ``train()`` attempt should stop at its next commit point: to grow, or to leave draining nodes.

Layer 1: the standard library only; pure policies tested with fake clocks. A watch is called on every tick of
an attempt (the worker group's ``on_tick``) and returns a :class:`Stop` decision (restart at ``size`` from the
commit the ranks take for attempt ``attempt``) at most once per attempt; the controller
(:mod:`raysgd.torch.execution.controller`) asks the ranks to stop, and :class:`Asking` tells it which ranks to
ask again when a request was lost or is not answered in time.

- :class:`GrowWatch`: while the call trains below the largest size, every ``SGD_GROW_CHECK_S`` seconds (default 2)
  whether more workers fit (after the resize cooldown), once the attempt stored a commit of its own. The call
  then goes on from that commit at the larger size, in the same epoch (the data cursor re-shards the rest).
- :class:`DrainWatch`: every ``SGD_DRAIN_CHECK_S`` seconds (default 1) whether a worker's node is draining (Ray's
  preemption notice) and the group can move (see :mod:`raysgd.torch.fault_tolerance.recovery`'s ``move_size``).
  Neither is a failure: no retry is used and ``num_failures`` does not count it.

Example:
    >>> now = [0.0]
    >>> watch = GrowWatch(target=lambda: 3, committed=lambda: (7, 1), check_s=2.0, clock=lambda: now[0])
    >>> watch.tick() is None  # within check_s of the watch's start
    True
    >>> now[0] = 2.0
    >>> watch.tick()
    Stop(size=3, attempt=(7, 1), reason='to grow')
    >>> now[0] = 4.0
    >>> watch.tick() is None  # one decision per attempt
    True
"""
import collections
import logging
import time

from raysgd.base import environment

logger = logging.getLogger(__name__)

#: A decision: every rank stops at its next agreed commit point of attempt ``attempt`` (``(call_id, attempt)``),
#: and the call goes on from that commit with ``size`` workers; ``reason`` says why (for the logs).
Stop = collections.namedtuple("Stop", "size attempt reason")

#: How many times a rank is asked to stop at most (the first request and its repeats), per attempt.
MAX_ASKS = 3


def grow_check_s():
    """``SGD_GROW_CHECK_S``: seconds between two checks for room to grow while a call trains (default 2)."""
    return environment.get("SGD_GROW_CHECK_S")


def drain_check_s():
    """``SGD_DRAIN_CHECK_S``: seconds between two checks for draining nodes while a call trains (default 1)."""
    return environment.get("SGD_DRAIN_CHECK_S")


def ask_s():
    """``SGD_RESIZE_ASK_S``: how long a rank may take to answer a request to stop before it is asked again."""
    return environment.get("SGD_RESIZE_ASK_S")


class StopWatch:
    """Base of the watches: a check at most every ``check_s`` seconds (a failing one only delays), at most one
    :class:`Stop` per attempt. A subclass names its ``reason`` and defines ``_check()``: ``(size, (call_id,
    attempt))`` to stop now, or None. ``requested``, ``size`` and ``attempt`` keep the decision made.

    Example:
        >>> StopWatch(check_s=0).requested  # nothing decided before the first tick
        False
    """

    reason = "to stop"

    def __init__(self, check_s, clock=time.monotonic):
        self._check_s, self._clock = check_s, clock
        self._last = clock()
        self.requested = False
        self.size = self.attempt = None

    def _check(self):
        return None

    def tick(self):
        """The :class:`Stop` decided now, or None (nothing to do, too soon, or decided already)."""
        now = self._clock()
        if self.requested or now - self._last < self._check_s:
            return None
        self._last = now
        try:
            found = self._check()
        except Exception as err:  # noqa: BLE001 (a failed check only delays the stop)
            logger.debug("check %s failed: %s", self.reason, err)
            return None
        if found is None:
            return None
        self.size, self.attempt = found
        self.requested = True
        return Stop(self.size, self.attempt, self.reason)


class GrowWatch(StopWatch):
    """Stop at a commit point to grow: ``target()`` returns the larger size to grow to now, or None;
    ``committed()`` returns ``(call_id, attempt)`` once the attempt stored a commit of its own (the proof that every
    rank is inside the call with a data cursor), else None.

    Example:
        >>> GrowWatch(target=lambda: None, committed=lambda: (1, 0), check_s=0).tick() is None  # nothing more fits
        True
    """

    reason = "to grow"

    def __init__(self, target, committed, check_s=None, clock=time.monotonic):
        super().__init__(grow_check_s() if check_s is None else check_s, clock)
        self._target, self._committed = target, committed

    def _check(self):
        size = self._target()
        attempt = self._committed() if size is not None else None
        if attempt is None:
            return None
        logger.info("More workers fit: stopping at the next commit point to grow to %d", size)
        return size, attempt


class DrainWatch(StopWatch):
    """Stop at a commit point to leave draining nodes: ``find()`` returns ``{rank: node}`` of the workers on draining
    nodes; ``size_for(ranks)`` the size to move at (None: stay, logged once per set of nodes); ``attempt()`` the
    ``(call_id, attempt)`` to name; ``describe(ranks)`` the nodes for the logs (their deadlines, say).

    Example:
        >>> watch = DrainWatch(find=dict, size_for=len, attempt=lambda: (1, 0), check_s=0)
        >>> watch.tick(), watch.requested  # no worker's node is draining
        (None, False)
    """

    reason = "to leave the draining node(s)"
    #: Logged when the group cannot move yet (too few workers would fit elsewhere).
    STAY = "Draining node(s) %s: too few workers would fit elsewhere to move; staying until they go"

    def __init__(self, find, size_for, attempt, describe=None, check_s=None, clock=time.monotonic):
        super().__init__(drain_check_s() if check_s is None else check_s, clock)
        self._find, self._size_for, self._attempt = find, size_for, attempt
        self._describe = describe or (lambda ranks: ", ".join(sorted(set(ranks.values()))))
        self._stayed = None  # the draining nodes a stay was logged for (logged once)

    def _check(self):
        ranks = self._find()
        size = self._size_for(ranks) if ranks else None
        attempt = self._attempt() if size is not None else None
        if ranks and size is None and self._stayed != set(ranks.values()):
            self._stayed = set(ranks.values())
            logger.warning(self.STAY, self._describe(ranks))
        if attempt is None:
            return None
        logger.warning("Draining node(s) %s: every rank stops at the next commit point, then the call goes on "
                       "with %d workers elsewhere", self._describe(ranks), size)
        return size, attempt


class Asking:
    """Which ranks to ask again to stop: one whose answer failed (a lost request) or did not come within
    ``ask_s`` seconds is asked again, at most :data:`MAX_ASKS` times in all (asking twice is harmless: a rank acts
    on the request once); an answered rank never again.

    Example:
        >>> asking = Asking([0, 1, 2], now=0.0, ask_s=5)
        >>> asking.again({0: True, 1: False, 2: None}, now=1.0)  # rank 1's request was lost
        ([1], [])
        >>> asking.again({1: None, 2: None}, now=5.5)  # rank 2 is overdue (rank 1 was asked again at 1.0)
        ([2], [])
    """

    def __init__(self, ranks, now, ask_s=None, max_asks=MAX_ASKS):
        self._ask_s, self.max_asks = ask_s, max_asks
        self.waiting = set(ranks)  # asked, not answered yet
        self._asked_at, self._asks = dict.fromkeys(ranks, now), dict.fromkeys(ranks, 1)

    def again(self, answers, now):
        """``(again, given_up)`` from ``answers`` (``{rank: True | False | None}``: answered, failed, no answer yet) of
        the ranks still waiting: the ranks to ask again now (counted as asked), and those given up on."""
        limit = ask_s() if self._ask_s is None else self._ask_s
        self.waiting = {rank for rank in self.waiting if answers.get(rank) is not True}
        due = sorted(rank for rank in self.waiting
                     if answers.get(rank) is False or now - self._asked_at[rank] >= limit)
        given_up = [rank for rank in due if self._asks[rank] >= self.max_asks]
        self.waiting -= set(given_up)
        again = [rank for rank in due if rank not in given_up]
        for rank in again:
            self._asked_at[rank], self._asks[rank] = now, self._asks[rank] + 1
        return again, given_up
