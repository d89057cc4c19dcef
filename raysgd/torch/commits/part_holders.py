"""Where committed state parts live: a 0-CPU holder actor on each node of the workers keeps the parts its node's
ranks commit in that node's object store, with a copy on one other node (its buddy), so the loss of any one node
leaves every part of a commit available and nothing the size of the model passes through the driver.

Layer 4 (ray; beside :mod:`~raysgd.torch.commits.commit_store`, one of the modules that call actors). A rank that
commits a part (rank 0's state under DDP; every rank's shard under a sharded strategy) hands its serialised
buffer to the holder on its own node (:meth:`CommitSink.put` of the commit store, in the rank's background send
thread): the rank puts the buffer into its node's object store once (a temporary it owns), the holder puts a copy of
its own there (the holder *owns* it, so it outlives the sending rank's process) and asks the holder of the buddy
node to make its own copy from the rank's temporary (pulled across the network; owned by that holder), after which
the temporary is released. Each holder gives the ref of its copy to the commit store itself (``add_copy``) and
answers the rank with the nodes only: no rank is ever a link between a copy's owner and the store (why: see
:mod:`~raysgd.torch.commits.commit_store`). The store, and after a failure the driver, only *borrow* those refs:
the bytes go from the holders' nodes to the restarted workers directly.

No node pulls a kept copy to make another: a pull leaves a secondary copy of the object it pulled in the puller's
object store, which Ray's directory lists as a location of that object until it declares the puller's node dead. A
worker that loads the kept copy after the puller's node was lost, but before Ray's verdict (a restart that does not
wait for it), could have its pull sent there and wait Ray's ``object_manager_pull_timeout_ms`` (10 s by default)
before another location is tried. So each kept copy is only ever stored on its own node when it is made.

Holders hold no state of their own: a copy lives as long as someone (the store's latest commit, a restart point)
holds its ref, and is freed when the last one lets go. A holder is lost with its node or with its process (an OOM
kill), taking its node's copies; the buddies' remain. A holder whose process died on a live node is *replaced*:
Ray restarts it on its node (``max_restarts=-1``; the handles the ranks hold reach the new process), and the ranks'
calls to it are retried there (``max_task_retries``: keeping a part again from the rank's temporary is harmless), so
the next commit completes. The driver counts the replacements (:attr:`Holders.replaced`): a call to each holder
that never returns (``watch``) fails when its process dies, which :meth:`Holders.check` sees at the controller's
next tick. A holder whose node is gone is not restarted (Ray reports it unschedulable at once).

The buddy of a node is the next one in the sorted ring of the group's nodes (:func:`buddies`): every node keeps its
own ranks' parts and one neighbour's, so no node holds more than its share.

Example:
    >>> buddies(["b", "a", "c", "a"])
    {'a': 'b', 'b': 'c', 'c': 'a'}
    >>> buddies(["a", "a"])
    {}
"""
import logging
import threading
from typing import cast

import ray
from ray import exceptions as ray_errors
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.torch.restart_points.transport import by_value, out_of_band

logger = logging.getLogger(__name__)

#: How long a holder waits for its buddy's copy; a copy that cannot be made in time leaves the part with one copy.
COPY_TIMEOUT_S = 600.0
#: Concurrent calls a holder serves (every rank of its node, the buddies' copies and the driver's watch, at once).
MAX_CONCURRENCY = 32
#: How often a call to a holder is retried after its process died (Ray restarts it on its node in about 1-2 s).
CALL_RETRIES = 3


def buddies(nodes):
    """``{node: buddy node}`` over the distinct ``nodes`` (sorted into a ring); empty with fewer than two nodes."""
    ring = sorted({node for node in nodes if node is not None})
    if len(ring) < 2:
        return {}
    return {node: ring[(index + 1) % len(ring)] for index, node in enumerate(ring)}


def _this_node():
    return ray.get_runtime_context().get_node_id()


class _HolderActor:
    """One node's holder (see the module docstring); a threaded actor serving its ranks and its buddies."""

    def keep(self, temporary, buddy, store, key, rank):
        """Keep the part of ``temporary`` (``[ref]``: a buffer, this node's rank's serialised part, put by the rank
        into this node's object store) in this node's object store and, with a ``buddy`` holder, a copy on its node
        made from the temporary (never from this holder's copy: see the module docstring); each copy is given to
        the commit ``store`` (an actor handle) as rank ``rank``'s part of the commit ``key`` by the holder that
        made it. Returns the nodes of the copies made."""
        part = ray.get(temporary[0], timeout=COPY_TIMEOUT_S)  # on this node: no transfer
        own = ray.put(out_of_band(part))  # owned by this holder, in this node's store
        del part
        here = ray.get_runtime_context().get_node_id()
        ray.get(store.add_copy.remote(key, rank, here, [own]), timeout=COPY_TIMEOUT_S)
        del own
        nodes = [here]
        if buddy is not None:
            try:
                nodes.append(ray.get(buddy.copy.options(max_task_retries=CALL_RETRIES).remote(
                    temporary, store, key, rank), timeout=COPY_TIMEOUT_S))
            except ray_errors.RayError as err:  # the part still has its first copy
                logger.warning("The buddy copy of a committed part failed (%s: %s); it has one copy",
                               type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return nodes

    def copy(self, refs, store, key, rank):
        """Pull ``refs[0]`` (a rank's temporary, on another node), keep a copy of this holder's own and give it to
        the commit ``store`` (see :meth:`keep`); returns this node's id."""
        value = ray.get(refs[0], timeout=COPY_TIMEOUT_S)
        mine = ray.put(out_of_band(value))
        del value
        here = ray.get_runtime_context().get_node_id()
        ray.get(store.add_copy.remote(key, rank, here, [mine]), timeout=COPY_TIMEOUT_S)
        return here

    def ping(self):
        return ray.get_runtime_context().get_node_id()

    def watch(self):
        """Never returns: the driver's call that fails when this process dies (:meth:`Holders.check`)."""
        threading.Event().wait()


class Holders:
    """The driver's holders, one per node of the workers, made on first need and owned by the driver (they live
    as long as the trainer, unless their node dies; one whose process dies is restarted by Ray and counted in
    :attr:`replaced`).

    Example:
        >>> # holders = Holders(); handles = holders.for_nodes({0: node_a, 1: node_b}); holders.check(); holders.close()
        >>> Holders().replaced
        0
    """

    def __init__(self):
        self._by_node = {}
        self._cls = None
        self._watches = {}  # node -> the pending ``watch`` call, or ("restarting", ping) once it failed
        self.replaced = 0

    def for_nodes(self, nodes):
        """``{node: holder handle}`` for the nodes in ``nodes`` (an iterable of node ids), starting any missing."""
        if self._cls is None:
            self._cls = ray.remote(  # type: ignore[call-overload]  # Ray's stub lacks actor options
                num_cpus=0, max_concurrency=MAX_CONCURRENCY, max_restarts=-1)(
                by_value(_HolderActor))  # its process imports no torch
        wanted = sorted({node for node in nodes if node is not None})
        for node in wanted:
            if node not in self._by_node:
                strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                self._by_node[node] = self._cls.options(scheduling_strategy=strategy).remote()
                self._watches[node] = self._by_node[node].watch.remote()
        return {node: self._by_node[node] for node in wanted}

    def check(self):
        """Never waits (the controller's tick): a holder whose ``watch`` failed lost its process; Ray restarts it on
        its node, which is counted (:attr:`replaced`, logged) and watched again once it answers. A holder whose node
        is gone (unschedulable) is forgotten."""
        pending = {ref: node for node, ref in self._watches.items() if not isinstance(ref, tuple)}
        restarting = {entry[1]: node for node, entry in self._watches.items() if isinstance(entry, tuple)}
        ready, _ = ray.wait(list(pending) + list(restarting), num_returns=len(pending) + len(restarting), timeout=0)
        for ref in ready:
            node = cast(str, pending.get(ref, restarting.get(ref)))  # ready holds refs of pending or restarting only
            try:
                ray.get(ref, timeout=0)
            except ray_errors.ActorUnschedulableError:  # its node is gone: nothing to restart there
                self._forget(node)
                continue
            except ray_errors.ActorDiedError as err:
                logger.warning("The commit part holder on node %s is gone (%s)", node[:12], str(err).splitlines()[0])
                self._forget(node)
                continue
            except ray_errors.RayError as err:
                if ref in pending:  # its process died; Ray restarts it on its node
                    self.replaced += 1
                    logger.warning("The commit part holder on node %s lost its process (%s: %s); Ray restarts it "
                                   "there and the next commit is kept by the new one (replacements: %d)", node[:12],
                                   type(err).__name__, str(err).splitlines()[0] if str(err) else "", self.replaced)
                    self._watches[node] = ("restarting", self._by_node[node].ping.options(
                        max_task_retries=-1).remote())
                else:
                    self._forget(node)
                continue
            if ref in restarting:  # answered again: watch the new process
                self._watches[node] = self._by_node[node].watch.remote()

    def _forget(self, node):
        self._by_node.pop(node, None)
        self._watches.pop(node, None)

    def close(self):
        """Kill every holder (the copies they own go with them)."""
        by_node, self._by_node, self._watches = self._by_node, {}, {}
        for handle in by_node.values():
            try:
                ray.kill(handle, no_restart=True)
            except Exception as err:  # noqa: BLE001 (gone with its node or the cluster)
                logger.debug("holder: %s", err)


def keep_part(holders, buddy_of, part, timeout_s, store, key, rank):
    """In a committing rank: keep ``part`` (a contiguous buffer) with the holder of this rank's node and a copy on
    its buddy, each holder giving its copy to the commit ``store`` (an actor handle) as rank ``rank``'s part of the
    commit ``key``; returns ``{"size": bytes, "nodes": [node, ...]}`` (the nodes of the copies: this process never
    holds a copy's ref).

    ``holders``: ``{node: holder}``; ``buddy_of``: ``{node: buddy node}`` (:func:`buddies`). Raises ``RuntimeError``
    when this node has no holder (the plan was made for another group), or the holder's error."""
    node = _this_node()
    holder = holders.get(node)
    if holder is None:
        raise RuntimeError(f"no part holder for node {node[:12]}: the commit plan names {len(holders)} other node(s)")
    buddy = holders.get(buddy_of.get(node))
    temporary = ray.put(out_of_band(part))  # released on return: the holders' copies are the kept ones
    nodes = ray.get(holder.keep.options(max_task_retries=CALL_RETRIES).remote([temporary], buddy, store, tuple(key),
                                                                               rank), timeout=timeout_s)
    del temporary
    return {"size": memoryview(part).nbytes, "nodes": list(nodes)}
