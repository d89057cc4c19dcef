"""The trainer's side of commits: one store per trainer, a plan per attempt, the restart point after a failure.

Layer 4 (ray, layers 0-3), used by the run's controller. Commits are taken by the workers (:mod:`raysgd.torch.commits.committer`); their small
records are kept in a store next to the driver (:mod:`raysgd.torch.commits.commit_store`), their state parts by a
holder on each worker's node with a copy on a buddy node (:mod:`raysgd.torch.commits.part_holders`), never in the
driver. After a failure the call resumes from the latest complete commit, on however many workers fit; the
metrics of the committed part are merged with those of the rest, so the call reports the whole epoch.

Example:
    >>> policy = CommitPolicy(every_n=0)
    >>> policy.enabled
    False
"""
import logging
import threading
import uuid
from typing import cast

import ray
from ray.exceptions import RayActorError

from raysgd.base import environment
from raysgd.base.checks import expect, is_whole
from raysgd.torch.fault_tolerance import stops
from raysgd.torch.state import checkpoint
from raysgd.torch.state import training_state as _state
from raysgd.torch.commits.commit_store import CommitStore
from raysgd.torch.commits.part_holders import Holders, buddies
from raysgd.torch.restart_points.restart_point import RestartPoint, ShardedPoint
from raysgd.torch.commits.committer import HEAD, CommitPlan
from raysgd.meters import merge_partials

logger = logging.getLogger(__name__)


def commit_interval_s():
    """``SGD_COMMIT_INTERVAL_S`` (seconds between commits when ``commit_every_n_steps=None``)."""
    return environment.get("SGD_COMMIT_INTERVAL_S")


def check_every_n(value, caller="TorchTrainer"):
    """``commit_every_n_steps``: None (time-based), 0 (off) or a positive int (numpy's, or 5.0, too: kept as an
    ``int``)."""
    expect(value is None or is_whole(value, 0),
           "commit_every_n_steps", "None (about every SGD_COMMIT_INTERVAL_S seconds), 0 (off) or an int > 0", value,
           caller=caller)
    return None if value is None else int(value)


class CommitPolicy:
    """Commits of one trainer: the store (made on first use), the call's attempts and their merged metrics.

    Example:
        >>> # policy.begin_call(); kwargs["commit"] = policy.plan(); ...; state = policy.restart_state()
    """

    def __init__(self, every_n):
        self.every_n = check_every_n(every_n)
        self._store: CommitStore | None = None
        self._holders = Holders()  # one per node of the workers, made when a plan names the node
        self._call = 0
        self._attempt = 0
        self._carried = {0: None}
        self.active = False  # whether the running call commits
        self._num_steps = None
        self._run_id = uuid.uuid4().hex[:12]  # tags this trainer's commits (a loaded commit of another run)
        self._lock = threading.Lock()  # latest_commit() may ask from another thread while a call runs
        self._begun = None  # the store's answer to the call's start, until read (:meth:`check_store`)
        self.resumed_preemption = False  # the last restart_state() resumed from a preemption commit, first time
        self._preemption_seen = None  # the key of the preemption commit last reported

    @property
    def enabled(self):
        return self.every_n != 0

    @property
    def holder_replacements(self):
        """How many commit part holders lost their process and were replaced (restarted on their node) so far."""
        return self._holders.replaced

    def prepare(self):
        """Start the store now (its process starts while the workers do), so that a failure never waits for it."""
        if self.enabled and self._store is None:
            self._store = CommitStore()

    def begin_call(self, trains=True, replay=False):
        """A new call (``trains``: a ``train()`` call); returns whether it commits.

        ``replay``: its input has no data cursor (Ray Data), so it takes no commits and a failure
        replays it from its start (logged). The commits of the previous call are no restart point any more.
        """
        if trains and replay and self.enabled:
            logger.warning("train(dataset=...) takes no commits: a failure replays this call from its start.")
        self.active = bool(trains) and not replay and self.enabled
        if not self.active:
            return False
        if self._store is None:
            self._store = CommitStore()
        self._call += 1
        self._attempt, self._carried = 0, {0: None}
        self._begin()
        return True

    def _begin(self):
        """Start the call in the store; its answer is read by :meth:`check_store` while the call runs."""
        self._begun = cast(CommitStore, self._store).begin(self._call)  # begin_call made it

    def check_store(self):
        """While the call runs (the controller's watch tick; never waits): once the store answered the call's start,
        read the answer, so a store lost since the previous call is replaced now (see :meth:`_ask`): this attempt's
        commits are then not stored, and a failure restarts the call from its start; later attempts and calls use
        the new store. Not waited for before the call starts: the round trip (~1 ms here) would be paid by every
        call, for a store lost between calls (an OOM kill on the driver's node)."""
        self._holders.check()  # a holder that lost its process is restarted by Ray: counted here
        begun = self._begun
        if begun is None or not ray.wait([begun], timeout=0)[0]:
            return
        self._begun = None
        self._ask(lambda store: ray.get(begun, timeout=1))

    def _ask(self, question):
        """``question(store)``; None when the store's process is gone (an OOM kill on the driver's node, say): a
        new, empty store replaces it, so the call has no commit to resume from and a failure restarts it from
        its start (the snapshot), as with commits off. The workers of the running attempt still hold the lost
        store (their commits are not stored, logged); the next attempt's plan names the new one."""
        store = self._store
        try:
            return question(store)
        except RayActorError as err:
            with self._lock:
                if self._store is store:
                    logger.warning("The commit store was lost (%s: %s); a new one replaces it, and a failure in "
                                   "this call restarts it from its start", type(err).__name__, err)
                    self._store = CommitStore()
                    self._begun = self._store.begin(self._call) if self._call else None
            return None

    def with_plan(self, kwargs, nodes=(), standby=()):
        """The call's keyword arguments, with this attempt's :class:`CommitPlan` when the call commits; ``nodes``:
        the node id of each rank (the part holders of those nodes keep the commit's state parts); ``standby``: nodes
        where a rank may come (warm spares'): their holders start now, so a spare that takes a rank commits at once
        (a holder started at its first commit paused the run ~2 s at its second)."""
        if not self.active:
            return kwargs
        self._num_steps = kwargs.get("num_steps") if self._attempt == 0 else self._num_steps
        return {**kwargs, "commit": self.plan(nodes, standby)}

    def plan(self, nodes=(), standby=()):
        """The :class:`CommitPlan` of the current attempt (sent to every worker with the call), its sink naming the
        holders of ``nodes`` (each rank's node id) and each node's buddy; the holders of ``standby`` nodes are
        started too (not named)."""
        nodes = list(nodes)
        self._holders.for_nodes(standby)
        sink = cast(CommitStore, self._store).sink(self._holders.for_nodes(nodes), buddies(nodes))  # begin_call made it
        return CommitPlan(sink, self.every_n or None, commit_interval_s(), self._call, self._attempt,
                          run_id=self._run_id)

    def restart_state(self, kwargs):
        """The call's latest complete commit as a :class:`~raysgd.torch.restart_points.restart_point.RestartPoint` (rank 0's
        state on the part holders' nodes, the small per-rank records as its overlay, with the ``cursor``), or None
        when there is none. The state itself never comes to this process.

        Advances to the next attempt; the committed metrics are carried into it, and ``kwargs["num_steps"]``
        is cut by the steps already committed. ``resumed_preemption`` tells whether that commit is one the
        ranks took for a SIGTERM (marked in the store), the first time it is resumed from.
        """
        if not self.active:
            return None
        found = self._ask(lambda store: store.latest_parts(self._call))
        self._attempt += 1
        self.resumed_preemption = False
        if found is None:
            self._carried[self._attempt] = None
            kwargs["num_steps"] = self._num_steps
            logger.info("No commit in this call yet: it goes on from its start")
            return None
        key, records, found_parts = found
        if key != self._preemption_seen and self._ask(lambda store: store.reason(key)) == stops.PREEMPTION:
            self.resumed_preemption, self._preemption_seen = True, key  # the ranks marked it before any exited
        overlay = _state.commit_overlay(records)
        made_in = overlay[_state.CURSOR].get("attempt", 0)
        self._carried[self._attempt] = merge_partials(self._carried.get(made_in), overlay[_state.METERS]) \
            if any(m is not None for m in overlay[_state.METERS]) else self._carried.get(made_in)
        kwargs["num_steps"] = remaining_steps(self._num_steps, overlay)
        logger.info("Resuming from the commit at step %d of the call (cursor %d)", key[-1],
                    overlay[_state.CURSOR]["consumed"])
        return state_point(records, found_parts, overlay)

    def abandon_restart(self, kwargs):
        """The commit :meth:`restart_state` returned could not be loaded (its state was lost on every node): the
        attempt starts from the call's start instead, with none of the call's committed metrics carried and all of
        its ``num_steps``."""
        self._carried[self._attempt] = None
        kwargs["num_steps"] = self._num_steps
        self.resumed_preemption = False

    def running_attempt(self):
        """``(call_id, attempt)`` of the running committing call (what a request to stop at a commit names), else None."""
        return (self._call, self._attempt) if self.active else None

    def committed_this_attempt(self):
        """``(call_id, attempt)`` when the running attempt has stored a complete commit of its own, else None.

        The proof that every rank is inside the call with a data cursor: a resize request can be acted on.
        """
        if not self.active:
            return None
        key = self._ask(lambda store: store.latest_key(self._call))
        if key is None or key[1] != self._attempt:  # keys are (call, attempt, step)
            return None
        return self._call, self._attempt

    def finish(self, stats):
        """The per-worker metrics of the whole call: the committed parts merged into the last attempt's."""
        if not self.active:
            return stats
        carried = self._carried.get(self._attempt)
        return merge_partials(carried, stats) if carried else stats

    def latest_state(self):
        """The latest complete commit of the running or last call as a state dict (fetched into this process), or
        None."""
        found = self._ask(lambda store: store.latest_parts(self._call)) if self._store is not None else None
        if not found:
            return None
        point = state_point(found[1], found[2])
        if isinstance(point, ShardedPoint):
            return _state.assemble_commit(found[1], point.whole_state(600))
        return _state.assemble_commit(found[1], checkpoint.state_from_bytes(point.fetch(600)))

    def latest_bytes(self):
        """:meth:`latest_state` as ``torch.save`` bytes (for a persistent checkpoint), or None."""
        state = self.latest_state()
        return checkpoint.state_to_bytes(state) if state is not None else None

    def close(self):
        if self._store is not None:
            self._store.close()
            self._store = None
        self._holders.close()


def state_point(records, found_parts, overlay=None):
    """The restart point of a commit's state from its records (``{rank: record}``) and parts (``{rank: {"size",
    "copies": [(node, [ref])]}}``): rank 0's part (the same state on each node listed, rank 0's node first), or,
    when rank 0's record holds a sharded state's head, a :class:`ShardedPoint` of every rank's part."""
    head = records[0].get(HEAD)
    if head is not None:
        return ShardedPoint([_copies(found_parts[rank]) for rank in sorted(found_parts)], head, overlay=overlay)
    return _copies(found_parts[0], overlay)


def _copies(part, overlay=None):
    return RestartPoint([refs[0] for _, refs in part["copies"]], nbytes=part["size"],
                        nodes=[node for node, _ in part["copies"]], overlay=overlay)


def remaining_steps(num_steps, state):
    """``num_steps`` of a call resumed from ``state``'s commit: those already committed are not run again."""
    if num_steps is None or state is None:
        return num_steps
    return max(0, num_steps - state[_state.CURSOR].get("call_steps", 0))
