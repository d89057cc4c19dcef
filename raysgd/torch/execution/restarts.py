"""Starting, restarting and moving a run's worker group, and asking its ranks to stop at a commit point.

Layer 5 helper of :mod:`raysgd.torch.execution.controller`, which alone calls it and owns what changes: every
function here takes the group and what it needs as arguments and returns what it did. The sizes come from the
pure policies of :mod:`raysgd.torch.fault_tolerance.recovery`.

- :func:`start_first_group`: an int ``num_workers`` starts that many (waiting for the placement as in 1.x); a
  range ``(min, max)`` starts as many as fit now, at least ``min``.
- :func:`restart_group`: after a failure, re-form the group from its survivors when it can be (they keep their
  processes), else tear it down and start as many workers as fit (never below the minimum; capped exponential
  backoff while none fit); to grow or move, re-form at the size asked for keeping the ranks on healthy nodes in
  their processes (a partial move or grow: ``WorkerGroup.resize``) when it can, else restart every worker at it.
- :func:`leaving`: the ranks on nodes Ray is draining (its preemption notice).
- :class:`StopRequest`: a request to every rank to stop at its next agreed commit point, asked again where it was
  lost or not answered (:class:`~raysgd.torch.fault_tolerance.watches.Asking` says which).

Example:
    >>> start_first_group(lambda n: n, how_many_fit=None, low=1, high=4, is_range=False, timeout_s=100)
    4
"""
import logging
import time

import ray

from raysgd.base import environment
from raysgd.torch.errors import WorkerFailure
from raysgd.torch.execution import cluster_state, worker_handle
from raysgd.torch.fault_tolerance import recovery
from raysgd.torch.fault_tolerance.watches import Asking

logger = logging.getLogger(__name__)


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


def _keep_ranks(group, state, form, what, timeout_s):
    """``form()`` (a re-form keeping ranks in their processes; the size, or a falsy value when it cannot) and load
    ``state`` (a :class:`~raysgd.torch.restart_points.restart_point.RestartPoint`) on every rank (a kept rank rebuilt its
    operator; None: nothing to load, the workers' code reads its own checkpoint); the size, or None (restart all).
    ``what`` names the attempt in the log."""
    try:
        started = form()
        if started and state is not None:
            group.run("load_restart_point", *state.load_args(), deadline_s=timeout_s)
        return started
    except Exception as err:  # noqa: BLE001 (restarting every worker is the tried path)
        logger.warning("%s failed (%s: %s); restarting every worker", what, type(err).__name__, err)
        return None


def restart_group(group, state, *, start, config_for, operator_cls, initialization_hook, low, high, timeout_s,
                  target=None, max_retries=None):
    """Restart ``group`` loading ``state`` (a :class:`~raysgd.torch.restart_points.restart_point.RestartPoint`, or None: nothing
    to load): after a failure (no ``target``) re-formed from its survivors
    when it can be, else torn down and started with ``start(n, pg_timeout_s)`` as many workers as fit (up to
    ``target``, by default ``high``; never below ``low``; capped exponential backoff while none fit, at most
    ``max_retries`` tries). ``config_for(n)`` is the worker config at ``n``. Returns the number of workers started;
    raises :class:`~raysgd.torch.fault_tolerance.recovery.RestartGaveUp` when no try succeeds."""
    if target is None:  # a failure: survivors keep their processes
        started = _keep_ranks(group, state, lambda: group.reform(operator_cls, config_for, low,
                                                                 initialization_hook=initialization_hook),
                              "Re-forming the group from its survivors", timeout_s)
    else:  # a grow or a move: the ranks on healthy nodes keep theirs
        started = _keep_ranks(group, state, lambda: group.resize(target, operator_cls, config_for,
                                                                 initialization_hook=initialization_hook),
                              "Resizing the group while keeping its healthy ranks", timeout_s)
    if started:
        logger.debug("Worker group restarted with %d of %d workers (survivors kept their processes)", started, high)
        return started
    target = target or high
    group.shutdown(force=True)

    def try_start(n):
        try:  # the resource view can lag a lost node: a size that is not placed soon is not waited for
            size = recovery.place_largest(start, group.how_many_fit, n, low, recovery.placement_try_s(),
                                          min(environment.get("SGD_PLACEMENT_GROUP_TIMEOUT_S"), 10))
            if state is not None:  # None: a stateless run (a training function reads its own checkpoint)
                group.run("load_restart_point", *state.load_args(), deadline_s=timeout_s)
        except BaseException:
            group.shutdown(force=True)
            raise
        return size

    def retry_cleanup_fit():
        group.shutdown(force=True)
        fit = group.how_many_fit(target, settle_s=2.0)
        return fit if fit >= low else 0  # never below the minimum: wait (backoff)

    started = recovery.restart_with_backoff(
        try_start, retry_cleanup_fit, tries=max_retries or environment.get("SGD_MAX_RESTART_TRIES"),
        cap_s=environment.get("SGD_BACKOFF_CAP_S"), retryable=(WorkerFailure, TimeoutError))
    logger.info("Workers now %d of %d: every worker restarted", started, high)
    return started


def leaving(group):
    """``{rank: node id}`` of ``group``'s workers on nodes Ray is draining (see ``WorkerGroup.placed_on``)."""
    draining = cluster_state.draining_nodes()
    if not draining:
        return {}
    return {rank: node for rank, node in group.placed_on().items() if node in draining}


def describe_draining(ranks):
    """The draining nodes of ``ranks`` (``{rank: node}``) for the logs: each node, its time left and its ranks."""
    deadlines = cluster_state.draining_nodes()
    parts = []
    for node in sorted(set(ranks.values())):
        deadline = deadlines.get(node)
        left = f"{deadline - time.time():.0f} s left" if deadline else "no deadline given"
        parts.append(f"{node[:12]} ({left}; ranks {sorted(r for r, n in ranks.items() if n == node)})")
    return ", ".join(parts)


class StopRequest:
    """Asks every rank of ``group`` to end attempt ``stop.attempt`` at its next agreed commit point (a
    :class:`~raysgd.torch.fault_tolerance.watches.Stop` decision), then, on every :meth:`tick` while the attempt
    runs, asks again the ranks whose answer failed or is overdue. ``answered(call)`` reads an answer without
    waiting (True, False, None: not yet).

    Example:
        >>> class Group:
        ...     def request_resize(self, call_id, attempt, ranks=None): return {0: "call"}
        >>> from raysgd.torch.fault_tolerance.watches import Stop
        >>> StopRequest(Group(), Stop(2, (1, 0), "to grow"), answered=lambda call: True).send().tick()
    """

    def __init__(self, group, stop, clock=time.monotonic, answered=worker_handle.answered):
        self._group, self.stop, self._clock, self._answered = group, stop, clock, answered
        self._calls, self._asking = {}, None

    def send(self):
        """Ask every rank; returns this request."""
        self._calls = dict(self._group.request_resize(*self.stop.attempt) or {})
        self._asking = Asking(self._calls, self._clock())
        return self

    def tick(self):
        """Ask again the ranks whose answer failed or is overdue (at most ``MAX_ASKS`` requests per rank)."""
        if self._asking is None or not self._asking.waiting:
            return
        now = self._clock()
        try:
            answers = {rank: self._answered(self._calls[rank]) for rank in self._asking.waiting}
        except Exception as err:  # noqa: BLE001 (reading answers failed: try again at the next tick)
            logger.debug("reading the answers %s failed: %s", self.stop.reason, err)
            return
        again, given_up = self._asking.again(answers, now)
        if given_up:
            logger.warning("Rank(s) %s did not take the request to stop %s after %d tries; the attempt goes on",
                           given_up, self.stop.reason, self._asking.max_asks)
        if not again:
            return
        logger.debug("Asking rank(s) %s again to stop %s", again, self.stop.reason)
        try:
            self._calls.update(self._group.request_resize(*self.stop.attempt, ranks=again) or {})
        except Exception as err:  # noqa: BLE001 (asked again at the next tick)
            logger.debug("asking again %s failed: %s", self.stop.reason, err)
