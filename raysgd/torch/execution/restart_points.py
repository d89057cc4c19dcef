"""The run's restart point: the state a call starts from, where its bytes are kept, and when they are stored.

Layer 5 (ray, layers 0-4). The :class:`~raysgd.torch.execution.controller.RunController` keeps one
:class:`RestartPoints`: its ``current`` point (a :class:`~raysgd.torch.restart_points.restart_point.RestartPoint`, or a
:class:`~raysgd.torch.restart_points.restart_point.ShardedPoint` of every rank's part, held in the object store of the node
that wrote it with a copy on another node, never by the driver) and whether the workers may have moved on since
(``stale``). A point is taken before anything can change the state (:meth:`RestartPoints.take`) or, for a
``train()``/``validate()`` call, beside the call (:meth:`RestartPoints.begin`, see
:mod:`raysgd.torch.restart_points.call_start`): the call's :class:`~raysgd.torch.restart_points.call_start.PendingPoint` becomes the
current point once stored, as soon as the call's watch sees it stored (:meth:`RestartPoints.settle_if_stored`: the
previous point's bytes are freed then, not at the call's end) or when the call ends or fails
(:meth:`RestartPoints.settle`).

Example:
    >>> points = RestartPoints(first=lambda ask, method: ask(), timeout_s=30)
    >>> points.current is None, points.stale
    (True, True)
"""
from __future__ import annotations

import itertools
import logging

from raysgd.torch.restart_points.call_start import PendingPoint, PendingShardedPoint, SnapshotFailed
from raysgd.torch.restart_points.restart_point import (RestartPoint, RestartPointLost, ShardedPoint, copy_all, start_copy,
                                                       this_node)
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from raysgd.torch.execution.worker_group import WorkerGroup

logger = logging.getLogger(__name__)


class RestartPoints:
    """The run's restart point (see the module docstring).

    Args:
        first: ``first(ask, method)`` runs ``ask()`` (one rank's answer), restarting the workers when every one
            was lost between calls (the controller's :meth:`~raysgd.torch.execution.controller.RunController.ask_restarting`).
        timeout_s: the deadline of each answer waited for.
    """

    current: RestartPoint | ShardedPoint | None  # (set in __init__: typed here)
    _early: Any

    def __init__(self, first: Callable[[Callable[[], Any], str], Any], timeout_s: float) -> None:
        self._first, self._timeout_s = first, timeout_s
        self.current = None  # the restart point (kept until a fresher one)
        self.stale = True  # the state may have moved on since ``current`` was taken
        self._copies = itertools.count()  # spreads the points' copies over the workers' nodes
        self._overlap, self._tokens = True, itertools.count(1)  # call-start snapshots beside the call (until torn)
        self._early = None  # the pending point :meth:`settle_if_stored` last tried

    def take(self, group: WorkerGroup) -> RestartPoint | ShardedPoint | None:
        """The current restart point, taken now when the state moved on: rank 0's state (any live rank's if rank 0
        is gone: DDP replicas hold the same state) with every rank's random streams, so a retry from it puts each
        rank's streams back (dropout draws the same). Rank 0 writes it into its node's object store and a copy goes
        to another node; the driver never fetches it (see :mod:`raysgd.torch.restart_points.restart_point`)."""
        if self.current is None or self.stale:
            rngs = group.answers("rng_state", deadline_s=self._timeout_s) if group.num_workers > 1 else None
            point = self._first(lambda: self._snapshot(group, rngs), "state_snapshot")
            self._copy_elsewhere(group, point)
            self.current, self.stale = point, False
        return self.current

    def _snapshot(self, group, rngs):
        """A :class:`RestartPoint` of rank 0's state (the next live rank's while the ones before are dead), serialised
        by that worker into its node's object store, never fetched here; ``rngs`` (``{rank: rng_state}``) go into it.
        A sharded state (the workers tell: ``setup_report``'s ``sharded_state``): a :class:`ShardedPoint`, every rank
        saving its part at once (a collective), rank 0's answer holding the head. Raises
        :class:`~raysgd.torch.errors.WorkerFailure` when no rank answers."""
        if group.setup_report.get("sharded_state"):
            answers = group.run_with_data("state_snapshot", rngs, deadline_s=self._timeout_s)
            return ShardedPoint([_point(info, data) for info, data in answers], head=answers[0][0]["head"])
        return _point(*group.first_answer("state_snapshot", rngs, deadline_s=self._timeout_s, with_data=True))

    def _copy_elsewhere(self, group, point):
        """Copy ``point`` (each part of a sharded one) to another node than its holder's, waiting for it (see
        :meth:`_copy_targets`)."""
        pieces = point.parts if isinstance(point, ShardedPoint) else [point]
        targets = [(piece, node) for piece, node in zip(pieces, self._copy_targets(group, [p.nodes[0] for p in pieces]))
                   if node is not None]
        if targets:
            copy_all(targets, timeout_s=self._timeout_s)

    def _copy_targets(self, group, held):
        """For each node of ``held`` (a piece's holder), the node its copy goes to: the ranks' other nodes in turn
        (known since the group's rendezvous: no query per call), else the driver's node; None when everything runs
        on one node (a node loss then takes the driver too)."""
        try:
            workers = sorted({node for node in group.rank_nodes() if node})
            driver = this_node()
        except Exception as err:  # noqa: BLE001 (no copy: the point still has its primary)
            logger.debug("no copy of the restart point: %s", err)
            return [None] * len(held)
        turn, targets = next(self._copies), []
        for index, node in enumerate(held):
            others = [other for other in workers if other != node] or \
                ([driver] if node is not None and driver != node else [])
            targets.append(others[(turn + index) % len(others)] if others else None)
        return targets

    def begin(self, group: WorkerGroup) -> Any:
        """The call's restart point: taken beside the call (a :class:`PendingPoint`, its copy started too) when the
        state moved on since the last one and the group can (see :mod:`raysgd.torch.restart_points.call_start`), else now."""
        if self.current is None or not self.stale or not self._overlap:
            return self.take(group)  # the first one is taken now: a fallback exists from then on
        token = next(self._tokens)
        sharded = group.setup_report.get("sharded_state", False)  # then every rank's part, each copied elsewhere
        begun = group.call_beside("call_start_snapshot", token, self._timeout_s, every_rank=sharded) \
            if getattr(group.worker_cls, "overlaps_snapshots", False) else None  # a worker class taking part
        if begun is None:
            return self.take(group)
        if sharded:
            targets = self._copy_targets(group, [node for _, _, node in begun])
            return PendingShardedPoint(token, [(info, data, node, [(target, *start_copy(data, target, node))]
                                                if target else []) for (info, data, node), target in zip(begun, targets)])
        info, data, node = begun[0]
        copies = [(target, *start_copy(data, target, node)) for target in self._copy_targets(group, [node]) if target]
        return PendingPoint(token, info, data, node, copies)

    def settle_if_stored(self, state: Any) -> None:
        """While the call runs (its watch's tick): ``state``, the call's :class:`PendingPoint`, becomes the current
        point once it and its copies are stored, so the previous point is dropped (its bytes freed) now rather than at
        the call's end. One that failed is left to :meth:`settle`, where its error is handled; never waits."""
        if not isinstance(state, PendingPoint) or state is self._early or not state.stored():
            return
        self._early = state
        try:
            self.current = state.settle(self._timeout_s)
        except (SnapshotFailed, RestartPointLost):
            return

    def settle(self, group: WorkerGroup, state: Any, fallback: bool = True) -> Any:
        """``state`` stored: a :class:`PendingPoint` waited for, and made the restart point. Not stored (rank 0 lost
        first; or it raised: later calls then take theirs before they start, where its error is raised), the
        previous restart point stays and is returned (what was trained since it was taken is lost: logged), or
        None without ``fallback``."""
        if not isinstance(state, PendingPoint):
            return state
        try:
            self.current = state.settle(self._timeout_s)
            return self.current
        except SnapshotFailed as err:
            self._overlap = False
            logger.warning("The call-start snapshot failed (%s): this trainer's later calls take theirs before they "
                           "start", err)
        except RestartPointLost as err:
            survivor = self._survivor_point(group, state.token) \
                if fallback and not getattr(state, "sharded", False) else None  # a lost rank's shard: none has it
            logger.warning("The call-start snapshot was not stored (%s)%s", err, "; a survivor's capture of the "
                           "call's start is the restart point" if survivor is not None else "")
            if survivor is not None:
                self.current = survivor
                return survivor
        if fallback and self.stale:
            logger.warning("The call falls back to the previous restart point: what was trained since it was taken "
                           "is lost")
        return self.current if fallback else None

    def _survivor_point(self, group, token):
        """After a failure in which rank 0 was lost before storing the call-start snapshot of call ``token`` (no rank
        has stepped since: see :mod:`raysgd.torch.restart_points.call_start`): a :class:`RestartPoint` of the state a
        survivor kept for the re-formed group captured at that call's start, or None when no survivor has it."""
        found = group.survivor_answer("call_start_snapshot", token, min(self._timeout_s, 60.0),
                                      deadline_s=self._timeout_s)
        return _point(*found) if found is not None else None


def _point(info, data):
    """The :class:`RestartPoint` of a worker's answer ``info`` (``{"bytes", "node"}``) and its bytes' ref ``data``."""
    return RestartPoint([data], nbytes=info["bytes"], nodes=[info["node"]])


class NoRestartPoints:
    """The restart points of a stateless run, whose workers' code keeps its own state (a training function reads the
    latest checkpoint it reported): there are none, and nothing is snapshotted. Same methods as
    :class:`RestartPoints`.

    Example:
        >>> points = NoRestartPoints()
        >>> points.take(group=None), points.begin(group=None), points.current
        (None, None, None)
    """

    current = None
    stale = False

    def take(self, group):
        return None

    def begin(self, group):
        return None

    def settle_if_stored(self, state):
        """Nothing to settle."""

    def settle(self, group, state, fallback=True):
        return None
