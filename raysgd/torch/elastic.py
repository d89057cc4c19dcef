"""The elastic range of workers: how many to start with, and the sizes a restart may try.

Layer 5 helper of :mod:`raysgd.torch.torch_trainer` (standard library and layers 0-4).
``num_workers=(min, max)`` starts with as many workers as fit now between the two, and a restart
never goes below ``min``; an int ``N`` keeps 1.x's meaning: ``N`` at start, down to 1 after a failure.

During a committing ``train()`` call, :class:`GrowWatch` asks the workers to stop at their next
commit point when more workers fit and the cooldown has passed; the call then goes on from that commit
at the larger size, in the same epoch (the data cursor re-shards the rest).

Example:
    >>> placement_try_s()  # a restart's wait for a size above the minimum (SGD_PLACEMENT_TRY_S)
    3.0
"""
import logging
import time

import ray

from raysgd.torch import constants, worker_handle
from raysgd.torch.fault_tolerance import recovery
from raysgd.torch.state import checkpoint
from raysgd.torch.errors import WorkerFailure

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


def scale_up_target(group, high, last_resize, cooldown_s, quiet=False):
    """The larger group size to restart at now (resources returned, cooldown passed), or None to stay.

    ``quiet``: the caller logs the decision itself.
    """
    current = group.num_workers
    if current >= high:
        return None
    extra = group.how_many_fit(high - current)
    logger.debug("scale-up check: %d of %d workers, %d more fit, %.1f s since the last resize", current, high,
                 extra, time.monotonic() - last_resize)
    if not recovery.should_scale_up(current, high, extra, time.monotonic(), last_resize, cooldown_s):
        return None
    if not quiet:
        logger.info("Scaling up from %d to %d workers", current, current + extra)
    return current + extra


def placement_try_s():
    """``SGD_PLACEMENT_TRY_S``: how long a restart waits for a size above the minimum to be placed (default 3)."""
    return constants.env_float("SGD_PLACEMENT_TRY_S", 3.0)


def grow_check_s():
    """``SGD_GROW_CHECK_S``: seconds between two checks for room to grow while a call trains (default 2)."""
    return constants.env_float("SGD_GROW_CHECK_S", 2.0)


def ask_s():
    """``SGD_RESIZE_ASK_S``: how long a rank may take to answer a request to stop before it is asked again."""
    return constants.env_float("SGD_RESIZE_ASK_S", 5.0)


#: How many times a rank is asked to stop at most (the first request and its repeats), per attempt.
MAX_ASKS = 3


class StopWatch:
    """Base of the watches that, called on every tick of a committing ``train()`` attempt, ask the group to stop
    at its next commit point: a check at most every ``check_s`` seconds (a failing one only delays), at most
    one decision per attempt, the size to restart at kept in ``size``. A subclass names its ``reason`` and
    defines ``_check()``: ``(size, (call_id, attempt))`` to ask now, or None.

    A rank whose answer to the request failed (a lost request) or did not come within ``SGD_RESIZE_ASK_S`` is
    asked again on a later tick, while the attempt runs, at most :data:`MAX_ASKS` times in all (asking twice is
    harmless: a rank acts on the request once). ``answered(call)`` reads an answer (True, False, None: not yet).

    Example:
        >>> StopWatch(group=None, check_s=0).requested  # nothing asked before the first tick
        False
    """

    reason = "to stop"

    def __init__(self, group, check_s, clock=time.monotonic, answered=worker_handle.answered):
        self._group, self._check_s, self._clock, self._answered = group, check_s, clock, answered
        self._last = clock()
        self.requested = False
        self.size = None
        self._attempt, self._asking, self._asked_at, self._asks = None, {}, {}, {}

    def _check(self):
        return None

    def tick(self):
        now = self._clock()
        if self.requested:
            self._ask_again(now)
            return
        if now - self._last < self._check_s:
            return
        self._last = now
        try:
            found = self._check()
        except Exception as err:  # noqa: BLE001 (a failed check only delays the stop)
            logger.debug("check %s failed: %s", self.reason, err)
            return
        if found is None:
            return
        self.size, self._attempt = found
        self._asking = self._group.request_resize(*self._attempt) or {}
        self._asked_at, self._asks = dict.fromkeys(self._asking, now), dict.fromkeys(self._asking, 1)
        self.requested = True

    def _ask_again(self, now):
        """Ask again the ranks whose answer failed or is overdue (see the class docstring)."""
        if not self._asking:
            return
        try:
            answers = {rank: self._answered(call) for rank, call in self._asking.items()}
        except Exception as err:  # noqa: BLE001 (reading answers failed: try again at the next tick)
            logger.debug("reading the answers %s failed: %s", self.reason, err)
            return
        self._asking = {rank: self._asking[rank] for rank, answer in answers.items() if answer is not True}
        again = sorted(rank for rank, answer in answers.items()
                       if answer is False or (answer is None and now - self._asked_at[rank] >= ask_s()))
        given_up = [rank for rank in again if self._asks[rank] >= MAX_ASKS]
        if given_up:
            logger.warning("Rank(s) %s did not take the request to stop %s after %d tries; the attempt goes on",
                           given_up, self.reason, MAX_ASKS)
            self._asking = {rank: call for rank, call in self._asking.items() if rank not in given_up}
        again = [rank for rank in again if rank not in given_up]
        if not again:
            return
        logger.info("Asking rank(s) %s again to stop %s", again, self.reason)
        try:
            self._asking.update(self._group.request_resize(*self._attempt, ranks=again) or {})
        except Exception as err:  # noqa: BLE001 (asked again at the next tick)
            logger.debug("asking again %s failed: %s", self.reason, err)
        for rank in again:
            self._asked_at[rank], self._asks[rank] = now, self._asks[rank] + 1


class GrowWatch(StopWatch):
    """Called on every tick of a committing ``train()`` attempt: asks the group to stop at a commit point to grow.

    ``target()`` returns the larger size to grow to now, or None (see :func:`scale_up_target`);
    ``committed()`` returns ``(call_id, attempt)`` once the attempt stored a commit of its own, else None.
    At most one request per attempt; ``target`` is remembered for the restart.

    Example:
        >>> watch = GrowWatch(group=None, target=lambda: 2, committed=lambda: (1, 0), check_s=0)
        >>> watch.requested  # nothing asked before the first tick
        False
    """

    reason = "to grow"

    def __init__(self, group, target, committed, check_s=None, clock=time.monotonic):
        super().__init__(group, grow_check_s() if check_s is None else check_s, clock)
        self._target, self._committed = target, committed

    def _check(self):
        size = self._target()
        attempt = self._committed() if size is not None else None
        if attempt is None:
            return None
        logger.info("More workers fit: stopping at the next commit point to grow to %d", size)
        return size, attempt


def _reform(trainer, state):
    """Re-form the group from the last failure's survivors and load ``state``; the size, or None (restart all)."""
    group = trainer.worker_group
    try:
        started = group.reform(trainer.training_operator_cls, trainer._worker_config, trainer.min_replicas,
                               initialization_hook=trainer.initialization_hook)
        if started:
            group.run("load_state_stream", ray.put(state), deadline_s=trainer.timeout_s)
        return started
    except Exception as err:  # noqa: BLE001 (restarting every worker is the tried path)
        logger.warning("Re-forming the group from its survivors failed (%s: %s); restarting every worker",
                       type(err).__name__, err)
        return None


def restart_group(trainer, state, max_retries=None, target=None):
    """Restart ``trainer``'s group loading ``state``: after a failure (no ``target``) re-formed from its survivors
    when it can be, else torn down and started with as many workers as fit (up to ``target``, never below the
    minimum; capped exponential backoff while none fit). ``state`` is a state dict or its bytes; it becomes the
    trainer's snapshot. Returns the number of workers started."""
    state = checkpoint.state_to_bytes(state) if isinstance(state, dict) else state
    group = trainer.worker_group
    started = _reform(trainer, state) if target is None else None  # a failure: survivors keep their processes
    if started:
        trainer._snapshot = state
        logger.info("Worker group restarted with %d of %d workers (survivors kept their processes)", started,
                    trainer.max_replicas)
        return started
    target = target or trainer.max_replicas
    group.shutdown(force=True)

    def try_start(n):
        try:  # the resource view can lag a lost node: a size that is not placed soon is not waited for
            size = recovery.place_largest(lambda size, timeout_s: trainer._start_workers(size, pg_timeout_s=timeout_s),
                                          group.how_many_fit, n, trainer.min_replicas, placement_try_s(),
                                          min(constants.SGD_PLACEMENT_GROUP_TIMEOUT_S, 10))
            group.run("load_state_stream", ray.put(state), deadline_s=trainer.timeout_s)
        except BaseException:
            group.shutdown(force=True)
            raise
        return size

    def retry_cleanup_fit():
        group.shutdown(force=True)
        fit = group.how_many_fit(target, settle_s=2.0)
        return fit if fit >= trainer.min_replicas else 0  # never below the minimum: wait (backoff)

    started = recovery.restart_with_backoff(
        try_start, retry_cleanup_fit, tries=max_retries or constants.SGD_MAX_RESTART_TRIES,
        cap_s=constants.SGD_BACKOFF_CAP_S, retryable=(WorkerFailure, TimeoutError))
    trainer._snapshot = state
    logger.info("Worker group restarted with %d of %d workers", started, trainer.max_replicas)
    return started
