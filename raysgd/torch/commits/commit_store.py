"""Where commits are recorded: a 0-CPU actor on the driver's node holding each rank's small record of the call's
latest complete commit, and where its state parts are (never the parts themselves).

Layer 4 (ray), beside :mod:`~raysgd.torch.commits.part_holders` (the modules of this layer that call actors). A
committing rank sends through the plan's :class:`CommitSink`: its state part, if it has one (rank 0's state under
DDP), goes to the holder on its own node, which keeps it there with a copy on a buddy node
(:func:`~raysgd.torch.commits.part_holders.keep_part`). Each holder hands the ref of the copy it made, which it
owns, to the store itself (``add_copy``) before it answers: the store's borrow of a copy is registered with the
copy's owner directly, and the committing rank never holds a copy's ref. (Ray frees an object whose owner learns of
its last borrower's death: a borrower that passed the ref on and died before telling the owner takes the owner's
knowledge of the next borrower with it. A rank is the process most likely to die right after its commit, a SIGTERM's
exit or the platform's SIGKILL at the end of its grace period, so it is never such a link.) Then the rank's small
record (random streams, metrics, cursor) and its part's size go to the store. ``put`` returns once the store holds
them, so a commit never depends on an object owned by a worker that may die. A commit is complete once every rank
of the attempt has put its record under the same key. After a failure the driver reads the latest complete commit's
records and part copies (:meth:`CommitStore.latest_parts`): the restarted workers load the parts from the holders'
nodes, never through the driver or this actor. Ranks that stop at a commit because of a SIGTERM mark it
(``mark(key, "preemption")``) before they send their records, so the driver learns of the preemption from the
store, whichever error reaches it first.

Example:
    >>> # store = CommitStore(); sink = store.sink(holders, buddy_of); sink.put((1, 0, 10), 0, 1, blob, state)
    >>> # store.latest_parts(1) -> ((1, 0, 10), {0: record}, {0: {"size": n, "copies": [(node, [ref]), ...]}})
"""
import io
import logging
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.torch.commits import part_holders
from raysgd.torch.restart_points.transport import by_value, out_of_band

logger = logging.getLogger(__name__)


class _StoreActor:
    def __init__(self):
        self._call = None
        self._pending = {}  # key -> (world_size, {rank: (blob, part)})
        self._complete = None  # (key, {rank: (blob, part)})
        self._reasons = {}  # key -> why the ranks stopped at that commit ("preemption"), this call only
        self._copies = {}  # (key, rank) -> {node: [ref]}: the copies the holders made of a part, the first first

    def begin(self, call_id):
        if self._call is None or call_id > self._call:
            self._call, self._pending, self._complete, self._reasons, self._copies = call_id, {}, None, {}, {}

    def add_copy(self, key, rank, node, refs):
        """A holder's copy of rank ``rank``'s part of the commit ``key``, kept on ``node`` (``[ref]``, owned by
        the holder, which sends it here itself: see the module docstring). A later copy on the same node (a call
        retried on a restarted holder) replaces the earlier one."""
        key = tuple(key)
        self.begin(key[0])
        if key[0] != self._call:
            return False  # a late copy of a finished call
        self._copies.setdefault((key, rank), {})[node] = list(refs)
        return True

    def put(self, key, rank, world_size, blob, part_size=None):
        """One rank's record (a copy of our own: none depends on the sender) and, if it has a state part, the
        part's size in bytes (its copies came from the holders: :meth:`add_copy`)."""
        key, blob = tuple(key), blob if isinstance(blob, bytes) else bytes(blob)
        self.begin(key[0])  # a worker's record may arrive before the driver's begin: calls only move forward
        if key[0] != self._call:
            return False  # a late record of a finished call
        part = None
        if part_size is not None:
            copies = self._copies.pop((key, rank), None)
            if not copies:
                raise ValueError(f"rank {rank}'s record of commit {key} names a state part of {part_size} bytes, "
                                 "but no holder stored a copy of it")
            part = {"size": part_size, "copies": list(copies.items())}
        size, records = self._pending.setdefault(key, (world_size, {}))  # one attempt: one size
        records[rank] = (blob, part)
        if len(records) == size and (self._complete is None or key >= self._complete[0]):
            self._complete = (key, records)  # the older complete commit's parts are let go here
            self._pending = {k: v for k, v in self._pending.items() if k > key}
            self._copies = {k: v for k, v in self._copies.items() if k[0] > key}  # and unclaimed copies
        return True

    def latest(self, call_id):
        """``(key, {rank: record}, {rank: part})`` of the call's latest complete commit (``part`` only for the ranks
        that sent one), or None."""
        if self._complete is None or self._complete[0][0] != call_id:
            return None
        key, records = self._complete
        return (key, {rank: blob for rank, (blob, _) in records.items()},
                {rank: part for rank, (_, part) in records.items() if part is not None})

    def latest_key(self, call_id):
        return self._complete[0] if self._complete is not None and self._complete[0][0] == call_id else None

    def mark(self, key, reason):
        self.begin(key[0])
        if key[0] == self._call:
            self._reasons[tuple(key)] = reason

    def reason(self, key):
        return self._reasons.get(tuple(key))

    def holds(self, key):
        return self._complete is not None and self._complete[0][0] == key[0] and self._complete[0] >= tuple(key)


class CommitSink:
    """The sending end of the commits, pickled into each attempt's plan: the store's actor, and the part holders of
    the attempt's nodes with each node's buddy.

    Example:
        >>> # sink.put(key, rank, world_size, record_bytes, state_buffer_or_None)
    """

    def __init__(self, actor, holders=None, buddy_of=None):
        self._actor, self.holders, self.buddy_of = actor, dict(holders or {}), dict(buddy_of or {})

    @property
    def store(self):
        """The store's actor handle: the holders give it their copies of a part (``keep_part``)."""
        return self._actor

    def put(self, key, rank, world_size, blob, state=None, timeout_s=600):
        """Store one rank's record (its random streams, metrics and cursor) and its ``state`` part (models,
        optimizers...: bytes or any contiguous buffer; rank 0's under DDP) if it has one, blocking until both are
        held: the part by the holder of this rank's node and its buddy (who give the store their copies), the
        record by the store.

        Buffers travel out of band (``pickle.PickleBuffer``): Ray writes them straight into its object store, with no
        copy on this side."""
        started = time.monotonic()
        size = None
        if state is not None:
            size = part_holders.keep_part(self.holders, self.buddy_of, state, timeout_s, self.store, key, rank)["size"]
        blob = blob if isinstance(blob, bytes) else out_of_band(blob)
        left = max(1.0, timeout_s - (time.monotonic() - started))
        return ray.get(self._actor.put.remote(tuple(key), rank, world_size, blob, size), timeout=left)

    def mark(self, key, reason, timeout_s=60):
        """Record why the ranks stopped at the commit ``key`` (``"preemption"``); kept until the next call."""
        ray.get(self._actor.mark.remote(tuple(key), reason), timeout=timeout_s)

    def wait_complete(self, key, timeout_s):
        """Wait until the commit ``key`` (or a later one of its call) is complete; returns whether it is."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if ray.get(self._actor.holds.remote(tuple(key)), timeout=max(left, 1.0)):
                return True
            if left <= 0:
                return False
            time.sleep(min(0.02, max(left, 0)))


class CommitStore:
    """The driver's end of the commits: the store's actor (on this node) and its queries; :meth:`sink` makes the
    sending end of an attempt.

    Example:
        >>> # store = CommitStore(); plan = CommitPlan(store.sink(holders, buddy_of), every_n=10, ...)
    """

    def __init__(self):
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._actor = ray.remote(num_cpus=0)(by_value(_StoreActor)).options(  # its process: no torch
            scheduling_strategy=here).remote()

    def sink(self, holders=None, buddy_of=None):
        """The :class:`CommitSink` of an attempt whose ranks run on the nodes of ``holders`` (``{node: holder}``)."""
        return CommitSink(self._actor, holders, buddy_of)

    def begin(self, call_id):
        """Start a new call: older commits are dropped (they are not restart points any more). Does not wait:
        returns the answer's ObjectRef (``ray.get`` of it raises ``RayActorError`` when the store is gone)."""
        return self._actor.begin.remote(call_id)

    def latest_parts(self, call_id, timeout_s=60):
        """``(key, {rank: record}, {rank: part})`` of the call's latest complete commit, or None: the small records
        loaded (on CPU) here, each part ``{"size", "copies": [(node, [ref]), ...]}`` with refs to the copies on the
        holders' nodes, never fetched here (a restart's workers load them from there)."""
        found = ray.get(self._actor.latest.remote(call_id), timeout=timeout_s)
        if found is None:
            return None
        key, blobs, found_parts = found
        return key, {rank: torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
                     for rank, blob in blobs.items()}, found_parts

    def latest_key(self, call_id, timeout_s=60):
        """The key ``(call_id, attempt, step)`` of the call's latest complete commit (its records stay), or None.

        Keys order by attempt first: a later attempt's commit supersedes a late-completing one of an older attempt.
        """
        return ray.get(self._actor.latest_key.remote(call_id), timeout=timeout_s)

    def reason(self, key, timeout_s=60):
        """What :meth:`CommitSink.mark` recorded for ``key``, or None."""
        return ray.get(self._actor.reason.remote(tuple(key)), timeout=timeout_s)

    def close(self):
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception as err:  # noqa: BLE001 (already gone with the cluster)
            logger.debug("commit store: %s", err)
