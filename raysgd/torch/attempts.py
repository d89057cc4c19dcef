"""One ``train()`` or ``validate()`` call through its attempts: retry after a worker failure, resume from the
call's latest commit, and grow the group at a commit point.

Layer 5 helper of :mod:`raysgd.torch.torch_trainer` (layers 0-4): it drives the trainer's own pieces
(the worker group, the snapshot, the commit policy, the durable run) and owns only the loop.

- A :class:`~raysgd.torch.errors.WorkerFailure` counts as a failure (``num_failures``) and uses one of
  ``max_retries``: the group restarts on as many workers as fit (never below the minimum) from the
  call's latest commit, or from the snapshot taken at the call's start when there is none.
- While a committing call trains below the largest size, :class:`~raysgd.torch.elastic.GrowWatch`
  checks every ``SGD_GROW_CHECK_S`` seconds whether more workers fit (after the resize cooldown). If
  so, the ranks stop at their next agreed commit point, and the same call goes on from that commit
  at the larger size. A resize is not a failure: it uses no retry.
- When a worker's node is draining (a preemption notice), :class:`~raysgd.torch.draining.DrainWatch` stops the
  ranks at their next agreed commit point in the same way, and the call goes on from it on nodes that are not
  draining (no failure, no retry used); between calls the group moves before the call starts.
- A user error ends the call; a ``train()`` puts the workers back to the call's starting state.

Example:
    >>> # stats = run_call(trainer, "train_epoch", max_retries=3, kwargs={"num_steps": None})
    >>> run_call(None, "train_epoch", max_retries=-1, kwargs={})
    Traceback (most recent call last):
    ...
    ValueError: max_retries expects an int >= 0; got -1
"""
import logging
import numbers

import ray

from raysgd.torch import draining, elastic
from raysgd.torch.fault_tolerance import preemption
from raysgd.torch.fault_tolerance import recovery
from raysgd.torch.errors import WorkerFailure

logger = logging.getLogger(__name__)


def _grow_watch(trainer):
    """A :class:`GrowWatch` for the next attempt, or None when it cannot grow (no commits, at the largest size)."""
    commits, group = trainer._commits, trainer.worker_group
    if not commits.active or group.num_workers >= trainer.max_replicas:
        return None
    target = lambda: elastic.scale_up_target(group, trainer.max_replicas, trainer._last_resize,  # noqa: E731
                                             trainer._resize_cooldown_s, quiet=True)
    return elastic.GrowWatch(group, target, commits.committed_this_attempt)


def _ticks(on_tick, watches):
    if not watches:
        return on_tick

    def tick():
        for watch in watches:
            watch.tick()
        if on_tick is not None:
            on_tick()

    return tick


def check_num_steps(num_steps):
    """``train()``/``validate()``'s ``num_steps`` as an int, or None (the rest of the epoch); 0 runs no batch.

    Example:
        >>> check_num_steps(2.5)
        Traceback (most recent call last):
        ...
        TypeError: num_steps expects None or an int >= 0 (batches per worker); got 2.5 (float)
    """
    if num_steps is None:
        return None
    expected = "num_steps expects None or an int >= 0 (batches per worker)"
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral):
        raise TypeError(f"{expected}; got {num_steps!r} ({type(num_steps).__name__})")
    if num_steps < 0:
        raise ValueError(f"{expected}; got {num_steps!r}")
    return int(num_steps)


def run_call(trainer, method, max_retries, kwargs):
    """Run ``method`` on every worker through its attempts (see the module docstring); returns per-worker stats."""
    if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
        raise ValueError(f"max_retries expects an int >= 0; got {max_retries!r}")
    trainer._ensure_workers()
    state = trainer._take_snapshot()  # the restart point, even with max_retries=0 (for the next call)
    if not draining.move_between_calls(trainer, state):
        trainer._maybe_scale_up(state)
    commits = trainer._commits
    commits.begin_call(method == "train_epoch", replay=kwargs.pop("replay", False))
    on_tick = kwargs.pop("on_tick", None)
    retries = 0
    while True:
        watches = [w for w in (_grow_watch(trainer), draining.watch(trainer)) if w is not None]
        try:
            results = trainer.worker_group.run(method, on_tick=_ticks(on_tick, watches), **commits.with_plan(kwargs))
            trainer._snapshot_stale = True  # train and validate (custom ones too) may change the state
            return commits.finish(results)
        except WorkerFailure as failure:
            stop = next((w for w in watches if w.requested), None)
            if stop is not None and preemption.was_resize(failure):
                _stopped(trainer, state, kwargs, stop, failure)
                continue
            trainer._num_failures += 1
            if retries == max_retries:
                raise RuntimeError(f"Training run failed: {method} did not succeed after {max_retries} "
                                   f"retries; the last failure is the cause.") from failure
            retries += 1
            logger.warning("%s failed (%s); restarting workers, retry %d of %d", method, failure, retries,
                           max_retries)
            _restart(trainer, state, kwargs, failure, None)
        except Exception:
            if method == "train_epoch":
                undo_partial_call(trainer, state)
            raise


def _stopped(trainer, state, kwargs, watch, stop):
    """The ranks stopped at the commit ``watch`` asked for: restart at its size from that commit (not a failure)."""
    logger.info("Restarting at %d workers from the commit point (%s)", watch.size, watch.reason)
    _restart(trainer, state, kwargs, stop, watch.size)


def _restart(trainer, state, kwargs, failure, size):
    try:
        resumed = trainer._commits.restart_state(kwargs)  # the latest commit, or None
        if size is None:  # a preemption commit goes to storage_path too
            trainer._durable.on_recovery(failure, resumed, preempted=trainer._commits.resumed_preemption)
        trainer._resize_worker_group(resumed if resumed is not None else state, target=size)
        trainer._snapshot = state  # a commit is a restart point inside this call only
    except recovery.RestartGaveUp as err:
        raise RuntimeError(f"Training run failed: the workers could not be restarted ({err}).") from failure


def undo_partial_call(trainer, state):
    """After user code raised mid-call, put the workers back to the call's starting state."""
    try:  # a torn-down group restarts from the snapshot at the next call
        if not trainer.worker_group.broken:
            trainer.worker_group.run("load_state_stream", ray.put(state), deadline_s=trainer.timeout_s)
    except Exception as err:  # noqa: BLE001 (the user's error is the one to raise)
        logger.warning("Could not restore the state after a failed call: %s", err)
