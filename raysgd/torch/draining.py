"""Leaving a node that Ray is draining (a preemption notice) before it goes: at a commit point, or between calls.

Layer 5 helper of :mod:`raysgd.torch.attempts` (layers 0-4). Whoever is about to take a node back can
tell Ray first: ``ray drain-node``, the autoscaler, or Ray itself when ``ray start --block`` gets SIGTERM (a
Kubernetes pod being deleted, a spot node preempted: Ray then drains for ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``,
30 s by default, before it kills the node's processes). A draining node stays alive, but Ray places nothing new on
it. Workers left there would train on until the node dies, and the trainer would then recover from the latest
commit, recomputing the steps since. Instead:

- while a committing ``train()`` call runs, :class:`DrainWatch` checks every ``SGD_DRAIN_CHECK_S`` seconds
  (default 1) whether a worker's node is draining. If so it asks every rank to stop at the next agreed step
  boundary, where they commit (the request that growing uses), and the same call goes on from that commit on
  nodes that are not draining: nothing is recomputed, and it is no failure (``num_failures`` does not count it);
- at the start of every call, :func:`move_between_calls` does the same from the call's starting state.

The group moves only when the workers that are not on a draining node, plus those that fit elsewhere, reach the
minimum (``num_workers``'s lower bound); else it stays, logs why, and recovers when the node goes. Inside a Tune
trial the trial's placement group cannot move: nothing is done here. Counting room never includes a draining node
(:func:`raysgd.torch.cluster_state.draining_nodes`).

Example:
    >>> class Group:  # two workers; one more fits on a node that is not draining
    ...     num_workers = 2
    ...     def how_many_fit(self, limit): return min(limit, 1)
    >>> move_size(Group(), {1: "node-b"}, low=1, high=2)  # rank 1 leaves node-b; the new group has 2 workers
    2
    >>> move_size(Group(), {0: "node-a", 1: "node-b"}, low=2, high=2) is None  # only 1 fits: stay for now
    True
"""
import logging
import time

from raysgd.torch import cluster_state, constants
from raysgd.torch.elastic import StopWatch

logger = logging.getLogger(__name__)

_STAY = "Draining node(s) %s: too few workers would fit elsewhere to move; staying until they go"


def drain_check_s():
    """``SGD_DRAIN_CHECK_S``: seconds between two checks for draining nodes while a call trains (default 1)."""
    return constants.env_float("SGD_DRAIN_CHECK_S", 1.0)


def leaving(group):
    """``{rank: node id}`` of ``group``'s workers on nodes Ray is draining (see :meth:`WorkerGroup.placed_on`)."""
    draining = cluster_state.draining_nodes()
    if not draining:
        return {}
    return {rank: node for rank, node in group.placed_on().items() if node in draining}


def move_size(group, ranks, low, high):
    """The size to restart at without the workers of ``ranks`` (``{rank: node}``) on the nodes they leave, at most
    ``high``; None when fewer than ``low`` would remain (the group then stays until the nodes go)."""
    stay = group.num_workers - len(ranks)
    size = min(high, stay + group.how_many_fit(max(0, high - stay)))
    return size if size >= max(low, 1) else None


def _describe(ranks):
    deadlines = cluster_state.draining_nodes()
    parts = []
    for node in sorted(set(ranks.values())):
        deadline = deadlines.get(node)
        left = f"{deadline - time.time():.0f} s left" if deadline else "no deadline given"
        parts.append(f"{node[:12]} ({left}; ranks {sorted(r for r, n in ranks.items() if n == node)})")
    return ", ".join(parts)


class DrainWatch(StopWatch):
    """Called on every tick of a committing ``train()`` attempt: asks the group to stop at its next commit point
    when a worker's node is draining and the group can move (see the module docstring).

    ``find()`` returns ``{rank: node}`` of the workers on draining nodes; ``size_for(ranks)`` the size to move
    at (or None: stay); ``attempt()`` the ``(call_id, attempt)`` to name. Checking, asking once per attempt and
    keeping the size: :class:`~raysgd.torch.elastic.StopWatch`.

    Example:
        >>> watch = DrainWatch(group=None, find=dict, size_for=len, attempt=lambda: (1, 0), check_s=0)
        >>> watch.tick(); watch.requested  # no worker's node is draining
        False
    """

    reason = "to leave the draining node(s)"

    def __init__(self, group, find, size_for, attempt, check_s=None, clock=time.monotonic):
        super().__init__(group, drain_check_s() if check_s is None else check_s, clock)
        self._find, self._size_for, self._attempt = find, size_for, attempt
        self._stayed = None  # the draining nodes a stay was logged for (logged once)

    def _check(self):
        ranks = self._find()
        size = self._size_for(ranks) if ranks else None
        attempt = self._attempt() if size is not None else None
        if ranks and size is None and self._stayed != set(ranks.values()):
            self._stayed = set(ranks.values())
            logger.warning(_STAY, _describe(ranks))
        if attempt is None:
            return None
        logger.warning("Draining node(s) %s: every rank stops at the next commit point, then the call goes on "
                       "with %d workers elsewhere", _describe(ranks), size)
        return size, attempt


def watch(trainer):
    """A :class:`DrainWatch` for the next attempt of ``trainer``'s call, or None when the call takes no commits."""
    commits, group = trainer._commits, trainer.worker_group
    if not commits.active:
        return None
    return DrainWatch(group, lambda: leaving(group),
                      lambda ranks: move_size(group, ranks, trainer.min_replicas, trainer.max_replicas),
                      commits.running_attempt)


def move_between_calls(trainer, state):
    """Before a call: restart ``trainer``'s group off draining nodes from ``state`` (the call's starting state)
    when a worker sits on one and the group can move; returns whether it moved."""
    group = trainer.worker_group
    try:
        ranks = leaving(group)
    except Exception as err:  # noqa: BLE001 (a failed check: the node's loss is recovered from as a failure)
        logger.debug("drain check failed: %s", err)
        return False
    if not ranks:
        return False
    size = move_size(group, ranks, trainer.min_replicas, trainer.max_replicas)
    if size is None:
        logger.warning(_STAY, _describe(ranks))
        return False
    logger.warning("Draining node(s) %s: restarting the workers elsewhere (%d) before the call", _describe(ranks),
                   size)
    trainer._resize_worker_group(state, target=size)
    return True
