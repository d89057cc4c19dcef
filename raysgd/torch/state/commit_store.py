"""Where commits live: a 0-CPU actor on the driver's node holding the latest complete commit of the call.

Layer 4, beside :mod:`raysgd.torch.execution.worker_group` and :mod:`raysgd.torch.integrations.mailbox` (the modules that touch
actor handles). Workers push their records to it (each ``put`` returns once the bytes are in the
actor's memory, so a commit never depends on an object owned by a worker that may die); it survives
the loss of any worker node. After a failure the driver reads the latest complete commit's small records (random
streams, metrics, cursor); rank 0's state goes from the store to the new workers as an object in this node's
object store (:meth:`CommitStore.latest_split`), never through the driver process. Ranks that stop
at a commit because of a SIGTERM mark it (``mark(key, "preemption")``) before they send their records, so
the driver learns of the preemption from the store, whichever error reaches it first.

Example:
    >>> # store = CommitStore(); store.begin(1); store.put((1, 0, 10), 0, 1, blob, state)
    >>> # store.latest(1) -> ((1, 0, 10), {0: blob}, len(state)); store.latest_split(1) -> (..., state ObjectRef)
"""
import io
import logging
import pickle
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)


class _StoreActor:
    def __init__(self):
        self._call = None
        self._pending = {}  # key -> (world_size, {rank: blob})
        self._complete = None  # (key, {rank: blob})
        self._reasons = {}  # key -> why the ranks stopped at that commit ("preemption"), this call only

    def begin(self, call_id):
        if self._call is None or call_id > self._call:
            self._call, self._pending, self._complete, self._reasons = call_id, {}, None, {}

    def put(self, key, rank, world_size, blob, state=None):
        # one copy of our own of each: none depends on the sender
        blob = blob if isinstance(blob, bytes) else bytes(blob)
        state = state if state is None or isinstance(state, bytes) else bytes(state)
        self.begin(key[0])  # a worker's record may arrive before the driver's begin: calls only move forward
        if key[0] != self._call:
            return False  # a late record of a finished call
        size, records = self._pending.setdefault(tuple(key), (world_size, {}))  # one attempt: one size
        records[rank] = (blob, state)
        if len(records) == size and (self._complete is None or tuple(key) >= self._complete[0]):
            self._complete = (tuple(key), records)
            self._pending = {k: v for k, v in self._pending.items() if k > tuple(key)}
        return True

    def latest(self, call_id):
        if self._complete is None or self._complete[0][0] != call_id:
            return None
        key, records = self._complete
        return key, {rank: blob for rank, (blob, _) in records.items()}, len(records[0][1] or b"")

    def latest_split(self, call_id):
        """``(latest(call_id), its state bytes)`` from one look (``(None, None)`` when there is none): called with
        two return values, so the caller reads the small first and leaves the state in this node's store."""
        found = self.latest(call_id)
        return (found, self._complete[1][0][1]) if found is not None else (None, None)


    def latest_key(self, call_id):
        return self._complete[0] if self._complete is not None and self._complete[0][0] == call_id else None

    def count(self):
        return 0 if self._complete is None else 1

    def mark(self, key, reason):
        self.begin(key[0])
        if key[0] == self._call:
            self._reasons[tuple(key)] = reason

    def reason(self, key):
        return self._reasons.get(tuple(key))

    def holds(self, key):
        return self._complete is not None and self._complete[0][0] == key[0] and self._complete[0] >= tuple(key)


class CommitStore:
    """The driver's end of the commits (and, pickled to a worker, the sending end).

    Example:
        >>> # store = CommitStore(); plan = CommitPlan(store, every_n=10, ...); store.latest_state(call_id)
    """

    def __init__(self):
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._actor = ray.remote(num_cpus=0)(_StoreActor).options(
            scheduling_strategy=here).remote()

    def begin(self, call_id):
        """Start a new call: older commits are dropped (they are not restart points any more). Does not wait:
        returns the answer's ObjectRef (``ray.get`` of it raises ``RayActorError`` when the store is gone)."""
        return self._actor.begin.remote(call_id)

    def put(self, key, rank, world_size, blob, state=None, timeout_s=600):
        """Store one rank's record (its random streams, metrics and cursor) and, from rank 0, the ``state`` (models,
        optimizers...): bytes or any contiguous buffers, blocking until the store holds them.

        A buffer travels out of band (``pickle.PickleBuffer``): Ray writes it straight into its object store, with no
        copy on this side; the store keeps one copy of its own."""
        blob = blob if isinstance(blob, bytes) else pickle.PickleBuffer(blob)
        state = state if state is None or isinstance(state, bytes) else pickle.PickleBuffer(state)
        return ray.get(self._actor.put.remote(tuple(key), rank, world_size, blob, state), timeout=timeout_s)

    def latest(self, call_id, timeout_s=60):
        """``(key, {rank: record blob}, state size)`` of the call's latest complete commit (the small records only),
        or None."""
        return ray.get(self._actor.latest.remote(call_id), timeout=timeout_s)

    def latest_split(self, call_id, timeout_s=60):
        """``(key, {rank: record}, state size, state ref)`` of the call's latest complete commit, or None: the small
        records loaded (on CPU) here, rank 0's state bytes a ref to a new object in the store's node's object
        store, owned by this process and never fetched here (a restart's workers load it from there)."""
        found, state_ref = self._actor.latest_split.options(num_returns=2).remote(call_id)
        found = ray.get(found, timeout=timeout_s)
        if found is None:
            return None
        key, blobs, size = found
        return key, {rank: torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
                     for rank, blob in blobs.items()}, size, state_ref

    def latest_key(self, call_id, timeout_s=60):
        """The key ``(call_id, attempt, step)`` of the call's latest complete commit (its records stay), or None.

        Keys order by attempt first: a later attempt's commit supersedes a late-completing one of an older attempt.
        """
        return ray.get(self._actor.latest_key.remote(call_id), timeout=timeout_s)

    def mark(self, key, reason, timeout_s=60):
        """Record why the ranks stopped at the commit ``key`` (``"preemption"``); kept until the next call."""
        ray.get(self._actor.mark.remote(tuple(key), reason), timeout=timeout_s)

    def reason(self, key, timeout_s=60):
        """What :meth:`mark` recorded for ``key``, or None."""
        return ray.get(self._actor.reason.remote(tuple(key)), timeout=timeout_s)

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

    def close(self):
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception as err:  # noqa: BLE001 (already gone with the cluster)
            logger.debug("commit store: %s", err)
