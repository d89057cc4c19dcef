"""Restart points: the state a worker group restarts from, kept in Ray's object store near the workers, never in the
driver process.

Layer 3 (ray, torch, layer 2's state format). A :class:`RestartPoint` is a list of ObjectRefs to the same state bytes
(:func:`raysgd.torch.state.checkpoint.state_to_bytes` format), each held by a different node:

- the *primary* is the return value of rank 0's ``state_snapshot`` call: rank 0 serialises its state straight into
  the object store of its own node. The driver owns the object (it made the call), so it outlives rank 0's process
  (a SIGKILL, an OOM kill), and the driver never fetches it;
- a *copy* on one other node (:func:`copy_to`: a 0-CPU task there fetches the primary and returns it, so the copy is
  owned by the driver and stored on that node), made before the call trains (a node lost meanwhile leaves the
  state unchanged on the others): the loss of any one node leaves one of them. The controller spreads the copies
  over the workers' nodes, call after call. The copy is pulled from a temporary that a task on the primary's node
  makes (and that is released once the copy is stored), never from the primary itself: a pull leaves a secondary
  copy of what it pulled on the puller's node, which Ray lists as a location of the primary until it declares that
  node dead, and a restart after that node's loss could then wait Ray's pull timeout (10 s by default) on it (see
  :mod:`raysgd.torch.commits.part_holders`).

A restart sends the refs (inside a list, so Ray does not resolve them) to every new worker, which loads the first
one still available (:func:`first_available`): the bytes move from the holder's node to each worker's node, never
through the driver. State that the driver itself holds (a user's ``load_state_dict``, a checkpoint read back, a
commit assembled from the store) becomes a one-ref point with :meth:`RestartPoint.of_bytes`.

Example:
    >>> # point = RestartPoint([ref], nbytes=n, nodes=[node]); group.run("load_restart_point", *point.load_args())
    >>> RestartPoint([], nbytes=0)
    RestartPoint(0 copies, 0.0 MB)
"""
import logging
import time

import numpy
import ray
from ray import exceptions as ray_errors
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.torch.restart_points.transport import by_value, out_of_band

logger = logging.getLogger(__name__)

#: Errors that mean "this copy is gone": its node died, its owner is gone, it could not be fetched in time, or the
#: task making it (a copy) failed because its source was lost first.
LOST = (ray_errors.RayError,)
#: How long one try waits for one copy, round after round (the last round waits until the deadline): a copy that
#: cannot come yet gives the others their turn.
ROUNDS_S = (15.0, 60.0, float("inf"))


class RestartPointLost(RuntimeError):
    """Every copy of a restart point is gone (each holder's node died): there is no state to restart from here."""


class RestartPoint:
    """Refs to one state's bytes on different nodes (see the module docstring).

    Args:
        refs: ObjectRefs of the same state bytes, the preferred one first.
        nbytes: the state's size in bytes (for logs and benchmarks).
        nodes: the node id holding each ref (None where unknown).
        overlay: a small dict the loaded state is updated with (a commit's per-rank random streams, metrics and
            cursor, which the driver read from the commit store), or None.

    Example:
        >>> point = RestartPoint([], nbytes=2_000_000)
        >>> point.nbytes, point.refs
        (2000000, [])
    """

    def __init__(self, refs, nbytes=None, nodes=None, overlay=None):
        self.refs = list(refs)
        self.nbytes = nbytes
        self.nodes = list(nodes) if nodes is not None else [None] * len(self.refs)
        self.overlay = overlay

    @classmethod
    def of_bytes(cls, stream):
        """A one-copy point of state bytes held by this process (put into the local object store once)."""
        return cls([ray.put(stream)], nbytes=len(stream), nodes=[this_node()])

    def add_copy(self, ref, node):
        """Add a copy held on ``node`` (preferred after the existing ones)."""
        self.refs.append(ref)
        self.nodes.append(node)

    def fetch(self, timeout_s=600):
        """The state bytes (without the overlay), pulled into this process (the driver does so only when the user
        asks for the state: ``state_dict()``, ``save()``); :class:`RestartPointLost` when no copy is left."""
        return first_available(self.refs, timeout_s)

    def load_args(self, weights_only=False):
        """The arguments of a worker's ``load_restart_point``: ``(refs, weights_only, overlay)``."""
        return self.refs, weights_only, self.overlay

    def __repr__(self):
        size = f"{self.nbytes / 1e6:.1f} MB" if self.nbytes is not None else "size unknown"
        return f"RestartPoint({len(self.refs)} copies, {size})"


class ShardedRefs:
    """What a worker loads a sharded restart point from: each saving rank's part as a list of refs (its copies) with
    the node holding each, the DCP file name of each part, and the head (the state's small rest, the DCP metadata
    and the layout, bytes). Nested in a call's arguments, its refs reach the worker unresolved: it reads, of the
    parts its new shard overlaps, only the byte ranges it needs (:meth:`source`).

    Example:
        >>> ShardedRefs([[], []], b"").file_names
        ['__0_0.distcp', '__1_0.distcp']
    """

    def __init__(self, parts, head, nodes=None):
        self.parts, self.head = [list(refs) for refs in parts], head
        self.nodes = [list(where) for where in nodes] if nodes is not None else [[None] * len(refs) for refs in parts]

    @property
    def file_names(self):
        return [part_file_name(rank) for rank in range(len(self.parts))]

    def source(self, timeout_s=600):
        """The parts as a source of byte ranges (:class:`PartRanges`)."""
        return PartRanges({name: list(zip(refs, nodes)) for name, refs, nodes in
                           zip(self.file_names, self.parts, self.nodes)}, timeout_s)

    def fetcher(self, timeout_s=600):
        """``fetch(relative_path)``: the first available copy of that rank's part (a zero-copy buffer, whole)."""
        by_name = dict(zip(self.file_names, self.parts))

        def fetch(name):
            if name not in by_name:
                raise KeyError(f"the sharded state has no part {name!r} (it has {sorted(by_name)})")
            return first_available(by_name[name], timeout_s)

        return fetch


def _read_ranges(refs, ranges):
    """On the node holding ``refs[0]`` (a part, read from its object store without a copy): the byte ranges
    ``[(offset, length), ...]`` of it, one after the other (the only bytes that then travel)."""
    data = numpy.frombuffer(ray.get(refs[0]), dtype=numpy.uint8)
    pieces = [data[offset:offset + length] for offset, length in ranges]
    return out_of_band(numpy.concatenate(pieces) if pieces else numpy.empty(0, dtype=numpy.uint8))


_read_task = None


class PartRanges:
    """A source of byte ranges (``read(relative_path, ranges)``, see :class:`~raysgd.torch.state.dcp_reader.BlobReader`)
    over parts held in object stores: ``{file name: [(ref, node), ...]}`` (the copies, preferred first).

    A part on this process's node is read in place (a zero-copy view of the local object); one on another node is
    cut there by a 0-CPU task (:func:`_read_ranges`), so only the ranges travel. A copy that cannot be read (its
    node lost, its owner gone, not read within its share of ``timeout_s``) gives way to the next;
    :class:`RestartPointLost` when none is left. :attr:`pulled` counts the bytes that came to this process.

    Example:
        >>> PartRanges({}, timeout_s=1).pulled
        0
    """

    def __init__(self, copies, timeout_s=600):
        self.copies, self.timeout_s, self.pulled = dict(copies), timeout_s, 0

    def read(self, relative_path, ranges):
        global _read_task
        if relative_path not in self.copies:
            raise KeyError(f"the sharded state has no part {relative_path!r} (it has {sorted(self.copies)})")
        here, deadline, errors = this_node(), time.monotonic() + self.timeout_s, []
        total = sum(length for _, length in ranges)
        for index, (ref, node) in enumerate(self.copies[relative_path]):
            patience = max(1.0, min(deadline - time.monotonic(), ROUNDS_S[0] if index + 1 < len(
                self.copies[relative_path]) else float("inf")))
            try:
                if node is None or node == here:  # here (or unknown: fetched whole)
                    data = memoryview(ray.get(ref, timeout=patience)).cast("B")
                    self.pulled += total if node == here else data.nbytes
                    return [data[offset:offset + length] for offset, length in ranges]
                if _read_task is None:  # its processes import no torch
                    _read_task = ray.remote(num_cpus=0, max_retries=0)(by_value(_read_ranges))
                strategy = NodeAffinitySchedulingStrategy(node, soft=False)
                data = memoryview(ray.get(_read_task.options(scheduling_strategy=strategy).remote([ref], ranges),
                                          timeout=patience)).cast("B")
            except (ray_errors.RayError, ValueError) as err:
                errors.append(f"copy {index}: {type(err).__name__}: {err}".splitlines()[0])
                logger.warning("Copy %d of part %s of the restart point cannot be read (%s); trying the next",
                               index, relative_path, type(err).__name__)
                continue
            self.pulled += data.nbytes
            pieces, position = [], 0
            for _, length in ranges:
                pieces.append(data[position:position + length])
                position += length
            return pieces
        raise RestartPointLost(f"no copy of part {relative_path} of the restart point is left ({'; '.join(errors)})")


def part_file_name(rank):
    """The DCP file name of saving rank ``rank``'s part (as DCP's ``FileSystemWriter`` names it)."""
    return f"__{rank}_0.distcp"


class ShardedPoint:
    """The restart point of a sharded state (FSDP): one :class:`RestartPoint` per saving rank's part (its DCP blob in
    its node's object store, and a copy elsewhere), and the ``head``: rank 0's small rest of the state (epoch, steps,
    operator state, schedulers, precision) with the DCP metadata, as bytes the driver holds (small). It loads on
    any number of ranks: each new rank reads the parts its new shard overlaps.

    Example:
        >>> ShardedPoint([RestartPoint([], nbytes=3), RestartPoint([], nbytes=4)], head=b"")
        ShardedPoint(2 parts, 0.0 MB)
    """

    def __init__(self, parts, head, overlay=None):
        self.parts, self.head, self.overlay = list(parts), head, overlay

    @property
    def nbytes(self):
        return sum(part.nbytes or 0 for part in self.parts)

    def load_args(self, weights_only=False):
        """The arguments of a worker's ``load_restart_point``: ``(ShardedRefs, weights_only, overlay)``."""
        return ShardedRefs([part.refs for part in self.parts], self.head,
                           [part.nodes for part in self.parts]), weights_only, self.overlay

    def fetcher(self, timeout_s=600):
        """``fetch(file name)`` of the parts, in this process (the driver, only when the user asks for the state)."""
        return self.load_args()[0].fetcher(timeout_s)

    def whole_state(self, timeout_s=600):
        """The state as one dict of whole CPU tensors (every part fetched into this process and consolidated, no
        collective): ``state_dict()``, ``save()`` and ``latest_commit()`` of a sharded run, where the user asks.
        Models hold their full tensors under their parameter names; optimizers are in DCP's form (state keyed
        by parameter name), and it loads into a sharded trainer of any size."""
        # imported here: this module's tasks (the copies) run in fresh worker processes that need no torch
        from raysgd.torch.state import checkpoint, sharded  # noqa: PLC0415

        head = checkpoint.state_from_bytes(self.head)
        whole = sharded.consolidate_parts(head["metadata"], self.fetcher(timeout_s), layout=head.get("layout"))
        return {**head["rest"], **(self.overlay or {}), "models": whole["models"], "optimizers": whole["optimizers"]}

    def __repr__(self):
        return f"ShardedPoint({len(self.parts)} parts, {self.nbytes / 1e6:.1f} MB)"


def this_node():
    """The id of the node this process runs on; None when this process is not connected to Ray (asking never
    starts a cluster: a local folder is written without one, see :func:`~raysgd.torch.storage.rank_files.write_files`).
    """
    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def first_available(refs, timeout_s=600):
    """The value of the first of ``refs`` that can still be fetched (a zero-copy buffer of the state bytes), trying
    each in turn within ``timeout_s`` in all; :class:`RestartPointLost` names each copy's error when none can.

    Example:
        >>> first_available([], timeout_s=1)
        Traceback (most recent call last):
        ...
        raysgd.torch.restart_points.restart_point.RestartPointLost: no copy of the restart point is left ()
    """
    deadline = time.monotonic() + timeout_s
    errors, waiting = {}, list(enumerate(refs))
    for patience in ROUNDS_S:  # a copy on a node that is dying (not yet known dead) may hang: try the next one
        for index, ref in list(waiting):
            left = deadline - time.monotonic()
            try:
                return ray.get(ref, timeout=max(1.0, min(left, patience)))
            except ray_errors.GetTimeoutError:
                errors[index] = f"copy {index}: not fetched within {min(left, patience):.0f} s"
                if left <= patience:
                    waiting.remove((index, ref))
            except LOST as err:
                logger.warning("Copy %d of the restart point is lost (%s); trying the next", index, type(err).__name__)
                errors[index] = f"copy {index}: {type(err).__name__}: {err}".splitlines()[0]
                waiting.remove((index, ref))
        if not waiting or time.monotonic() >= deadline:
            break
    raise RestartPointLost(f"no copy of the restart point is left ({'; '.join(errors.values())})")


def _copy(value):
    """Return the fetched ``value`` (state bytes) again, with a small answer: the task's node stores this copy."""
    return ({"bytes": memoryview(value).nbytes, "node": ray.get_runtime_context().get_node_id()},
            out_of_band(value))


def _again(value):
    """Return ``value`` (state bytes, on this node) again: a temporary for another node to pull."""
    return out_of_band(value)


_copy_task = _again_task = None


def start_copy(ref, node, source=None):
    """Start copying the state bytes of ``ref`` (stored already, or still to come: the task waits for them) into
    ``node``'s object store; returns ``(info ref, data ref)`` of the copy, unwaited (see :func:`copy_to`).

    ``source``: the node storing ``ref``; the copy is then pulled from a temporary made there (see the module
    docstring), so ``ref`` never gets a location on ``node``. None (unknown): pulled from ``ref`` itself."""
    global _copy_task, _again_task
    if _copy_task is None:  # their processes import no torch
        _copy_task = ray.remote(num_cpus=0, max_retries=0, num_returns=2)(by_value(_copy))
        _again_task = ray.remote(num_cpus=0, max_retries=0)(by_value(_again))
    if source is not None and source != node:
        # released once the copy task is done with it (Ray holds a pending task's arguments)
        ref = _again_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(source, soft=False)).remote(ref)
    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    return tuple(_copy_task.options(scheduling_strategy=strategy).remote(ref))


def copy_to(point, node, timeout_s=600):
    """Copy ``point``'s first copy into ``node``'s object store (a 0-CPU task there fetches it and returns it again:
    the driver owns the copy, lost only with ``node`` or the driver) and add it to ``point``; waits until the copy
    is stored, so a restart point always has its copy before the state moves on. Returns whether it was made (a
    failure is logged: the point keeps the copies it has)."""
    return copy_all([(point, node)], timeout_s)[0]


def copy_all(targets, timeout_s=600):
    """:func:`copy_to` for each ``(point, node)`` of ``targets`` at once (the parts of a sharded state, each to its
    own node); waits for all. Returns whether each copy was made."""
    started = [(point, node, *start_copy(point.refs[0], node, point.nodes[0])) for point, node in targets]
    deadline = time.monotonic() + timeout_s
    made = []
    for point, node, info_ref, data_ref in started:
        try:
            info = ray.get(info_ref, timeout=max(1.0, deadline - time.monotonic()))
        except ray_errors.RayError as err:
            logger.warning("The restart point's copy on node %s failed (%s: %s); it has %d copy(ies)", node[:12],
                           type(err).__name__, str(err).splitlines()[0] if str(err) else "", len(point.refs))
            made.append(False)
            continue
        point.add_copy(data_ref, info["node"])
        made.append(True)
    return made
