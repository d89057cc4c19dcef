"""The call-start snapshot taken beside the call: rank 0 serialises the state a ``train()``/``validate()`` call starts
from while the call's first forward and backward run, and no rank changes its parameters until it is stored.

Layer 3 (ray, torch, layers 0-2). Both ends of it:

- the driver (:class:`PendingPoint`) asks rank 0 for the snapshot in the actor's ``"snapshot"`` concurrency group
  and, without waiting, sends the call to every rank with a :class:`SnapshotPlan`; the copy to another node is
  started at once too (a task that waits for the bytes). The driver waits for the point (:meth:`PendingPoint.settle`)
  only when it needs it: a failure, a user error, or the call's end;
- every rank, at the call's start (:func:`overlapped`), gathers every rank's random streams; rank 0 captures its
  state (:class:`Capture`: the models' parameters and the optimizers' state by reference, everything else copied:
  buffers, random streams, cursor, counters, schedulers, the operator's and the precision's state) and hands it to
  the snapshot call's thread (:class:`Handoff`), which serialises it. A :class:`Gate` holds every rank's first
  optimizer step until rank 0's bytes are in its node's object store (the snapshot call's small answer, which Ray
  resolves only then) and the copy's are on the other node: so the parameters and optimizer state serialised are
  the call's starting ones, and whichever rank dies, a stored point of the call's start exists or no rank stepped.

A sharded state (``strategy="fsdp"``) is taken the same way by *every* rank: each captures its shards (the
parameters' and optimizer states' local shards by reference, buffers copied after every rank took rank 0's) and its
snapshot call writes its DCP part beside the call, the ranks' DCP save running over a process group of their own
(the snapshot threads' collectives never meet the call's); rank 0's answer also holds the head. Each rank's first
step waits until every rank's part is stored (:class:`PendingShardedPoint` on the driver's side).

What the gate cannot hold is a parameter changed in place outside an optimizer's ``step`` before the first step (a
``train_batch`` that clips or averages weights first): the capture records each protected tensor's version counter
and the snapshot call refuses bytes whose tensors changed meanwhile (:class:`TornSnapshot`); the controller then
takes the snapshots of that run synchronously. A change through ``tensor.data`` bumps no counter and is not seen.

Example:
    >>> import torch
    >>> weight, buffer = torch.nn.Parameter(torch.ones(2)), torch.zeros(2)
    >>> capture = Capture({"w": weight.detach(), "b": buffer}, protected_storages([weight]))
    >>> capture.state["w"].data_ptr() == weight.data_ptr(), capture.state["b"] is buffer
    (True, False)
    >>> with torch.no_grad():
    ...     _ = weight.add_(1)
    >>> capture.changed()
    1
"""
import collections
import contextlib
import copy
import logging
import pickle
import threading
import time
from typing import cast

import ray
import torch
import torch.distributed as dist
from ray import exceptions as ray_errors

from raysgd.torch.errors import CollectiveError
from raysgd.torch.restart_points import restart_point
from raysgd.torch.state import training_state as _state
from raysgd.torch.state.checkpoint import serialise

logger = logging.getLogger(__name__)

#: ``(event, token)`` of this process's latest call-start snapshots, in order: ``"captured"``, ``"serialising"``,
#: ``"stored_wait"`` (a rank's first step waits), ``"serialised"``, ``"gate_open"``. Read by tests and diagnostics.
EVENTS: collections.deque[tuple[str, object]] = collections.deque(maxlen=256)

_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, type(None))


class SnapshotFailed(RuntimeError):
    """Rank 0's call-start snapshot raised (the operator's state cannot be serialised, or :class:`TornSnapshot`)."""


class TornSnapshot(SnapshotFailed):
    """A protected tensor changed in place while rank 0 serialised the call-start snapshot (outside a ``step``)."""


class SnapshotNotTaken(RuntimeError):
    """The call ended (or failed) before rank 0 captured its state, so the snapshot call has nothing to serialise."""


class SnapshotPlan:
    """What every rank gets with a call whose snapshot overlaps it: ``token`` (names rank 0's snapshot call),
    ``refs`` (the small answers the first step waits for: rank 0's snapshot, then its copies; a sharded state's:
    every rank's part, then the copies), ``timeout_s``, ``required`` (how many of the first refs must be stored:
    1, or a sharded state's number of parts). Nested in the call's arguments, the refs reach the workers unresolved."""

    def __init__(self, token, refs, timeout_s, required=1):
        self.token, self.refs, self.timeout_s, self.required = token, list(refs), timeout_s, required


# ----------------------------------------------------------------- the worker's end
def _local(tensor):
    """A tensor's own storage holder: a DTensor's local shard (FSDP2's parameters and optimizer states), else itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def protected_storages(tensors):
    """The storages (their data pointers) of ``tensors``: what the gate keeps unchanged until the bytes are stored."""
    return {_local(tensor).untyped_storage().data_ptr() for tensor in tensors}


def gated_tensors(models, optimizers):
    """Every parameter of ``models`` and every tensor of ``optimizers``' state: changed only by an optimizer step."""
    tensors = [param for model in models for param in model.parameters()]
    for optimizer in optimizers:
        for per_param in getattr(optimizer, "state", {}).values():  # (an optimizer of another kind: copied instead)
            tensors.extend(value for value in dict(per_param).values() if isinstance(value, torch.Tensor))
    return tensors


class Capture:
    """A state dict frozen at the call's start: tensors on ``protected`` storages kept by reference (their version
    counters noted), every other tensor cloned and every other mutable leaf deep-copied; the top-level keys in
    ``fresh`` are taken as they are (values made for this capture alone, which nothing changes later: the random
    streams, some 2,500 small values per rank that would take ~1 ms to walk)."""

    def __init__(self, state, protected, fresh=()):
        self._versions: list[tuple[torch.Tensor, int]] = []
        self.state: dict | None = {key: value if key in fresh else self._freeze(value, protected)
                                   for key, value in state.items()}

    def _freeze(self, value, protected):
        if isinstance(value, torch.Tensor):
            local = _local(value)
            if local.untyped_storage().data_ptr() in protected:
                self._versions.append((local, local._version))
                return value
            return value.detach().clone()
        if isinstance(value, dict):
            items = [(key, self._freeze(item, protected)) for key, item in value.items()]
            return type(value)(items) if type(value) in (dict, collections.OrderedDict) else dict(items)
        if isinstance(value, list):
            return [self._freeze(item, protected) for item in value]
        if isinstance(value, tuple):
            items = [self._freeze(item, protected) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, _IMMUTABLE):
            return value
        return copy.deepcopy(value)

    def changed(self):
        """How many protected tensors changed in place since the capture."""
        return sum(tensor._version != version for tensor, version in self._versions)

    def release(self):
        self.state, self._versions = None, []


class Handoff:
    """Hands rank 0's :class:`Capture` from the call's thread to the snapshot call's thread (either may come first).
    Only the newest token is kept: an older capture is dropped when a newer one is offered."""

    def __init__(self):
        self._ready = threading.Condition()
        self._items = {}

    def offer(self, token, capture):
        """``capture``, or the exception that ended the call before it captured."""
        with self._ready:
            self._items = {token: capture}
            self._ready.notify_all()

    def take(self, token, timeout_s):
        """The capture of ``token``, waiting for it at most ``timeout_s``; :class:`SnapshotNotTaken` when the call
        failed first or none came in time."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while token not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SnapshotNotTaken(f"no call captured its state for snapshot {token} within {timeout_s} s")
                self._ready.wait(left)
            item = self._items.pop(token)
        if isinstance(item, BaseException):
            raise SnapshotNotTaken(f"the call failed before capturing its state: {type(item).__name__}") from item
        return item

    def discard(self, token):
        """Drop the capture of ``token`` (rank 0 stored its snapshot: a survivor's is no longer needed)."""
        with self._ready:
            self._items.pop(token, None)


def snapshot_bytes(handoff, token, timeout_s, write=serialise):
    """The snapshot call's work (rank 0, in the ``"snapshot"`` group): the capture of ``token`` serialised (a
    read-only view; ``write(state)``'s result instead when given: a sharded state's part); :class:`TornSnapshot` when
    a protected tensor changed meanwhile."""
    capture = handoff.take(token, timeout_s)
    EVENTS.append(("serialising", token))
    try:
        view = write(capture.state)
        changed = capture.changed()
    finally:
        capture.release()
    if changed:
        raise TornSnapshot(f"{changed} parameter or optimizer tensor(s) changed in place outside an optimizer step "
                           "while the call-start snapshot was serialised")
    EVENTS.append(("serialised", token))
    return view


class Gate:
    """Holds each of ``optimizers``' first ``step`` in the call until ``plan``'s snapshot is stored (see the module
    docstring); :meth:`close` removes its hooks. Where one of them is no ``torch.optim.Optimizer`` (no step hooks),
    the call itself waits for the snapshot before it starts. Rank 0 lost before its bytes were stored ends the wait with a
    :class:`~raysgd.torch.errors.CollectiveError` (this rank's call ends cleanly and the process may stay), and its
    bytes not stored within the plan's ``timeout_s`` with a ``TimeoutError``; a snapshot that failed otherwise (torn,
    a copy lost or not stored in time: a slow node must not fail the call) is logged and training goes on."""

    def __init__(self, plan, optimizers, rank, on_open=None):
        self._plan, self._rank, self._open, self._on_open = plan, rank, False, on_open
        if not all(hasattr(optimizer, "register_step_pre_hook") for optimizer in optimizers):
            self._hooks = []  # an optimizer that is no torch Optimizer cannot be held: hold the whole call
            self.wait()
            return
        self._hooks = [optimizer.register_step_pre_hook(self._before_step) for optimizer in optimizers]

    def _before_step(self, optimizer, args, kwargs):
        if not self._open:
            self.wait()

    def wait(self):
        token = self._plan.token
        EVENTS.append(("stored_wait", token))
        deadline = time.monotonic() + self._plan.timeout_s
        required = getattr(self._plan, "required", 1)
        for index, ref in enumerate(self._plan.refs):
            try:
                ray.get(ref, timeout=max(0.001, deadline - time.monotonic()))
            except ray_errors.GetTimeoutError as err:
                if index < required:
                    raise TimeoutError(f"rank {self._rank}: the call-start snapshot was not stored within "
                                       f"{self._plan.timeout_s} s") from err
                logger.warning("rank %d: the call-start snapshot's copy (part %d) was not stored within %s s; "
                               "training goes on (the point may have one copy less)", self._rank, index,
                               self._plan.timeout_s)
            except ray_errors.RayTaskError as err:  # it failed, rank 0 is alive: the driver learns it when it settles
                logger.warning("rank %d: the call-start snapshot (part %d) failed: %s", self._rank, index,
                               str(err).splitlines()[0])
            except ray_errors.RayError as err:
                if index < required:
                    raise CollectiveError(self._rank, f"rank {index} was lost before its call-start snapshot was "
                                                      f"stored ({type(err).__name__})") from err
                logger.warning("rank %d: the call-start snapshot's copy was lost (%s)", self._rank, type(err).__name__)
        self._open = True
        EVENTS.append(("gate_open", token))
        if self._on_open is not None:
            self._on_open(token)

    def close(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


#: Bytes per rank of the one collective that gathers the random streams (they pickle to ~13 KB on CPU); a rank
#: whose streams are larger makes every rank fall back to ``all_gather_object`` (two collectives).
RNG_SLOT_BYTES = 32 * 1024


def gather_rngs(own, world_size):
    """``{rank: random streams}`` of every rank (a collective when ``world_size > 1``): one ``all_gather`` of a
    fixed-size slot per rank (its length, then the pickled streams), which every call's start pays, rather than
    ``all_gather_object``'s two; where a rank's streams do not fit its slot, every rank sees it (the length is -1)
    and all of them take ``all_gather_object``.

    Example (one rank: no collective):
        >>> gather_rngs({"python": [1]}, 1)
        {0: {'python': [1]}}
    """
    if world_size <= 1:
        return {0: own}
    data = pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)
    fits = len(data) <= RNG_SLOT_BYTES - 8
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    slot = torch.zeros(RNG_SLOT_BYTES, dtype=torch.uint8)
    slot[:8].view(torch.int64)[0] = len(data) if fits else -1
    if fits:
        slot[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    slots = [torch.empty(RNG_SLOT_BYTES, dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(slots, slot.to(device))
    slots = [gathered.cpu() for gathered in slots]
    lengths = [int(gathered[:8].view(torch.int64)[0]) for gathered in slots]
    if min(lengths) < 0:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, own)
        return dict(enumerate(gathered))
    return {rank: pickle.loads(gathered[8:8 + length].numpy().tobytes())
            for rank, (gathered, length) in enumerate(zip(slots, lengths))}


@contextlib.contextmanager
def overlapped(plan, handoff, *, rank, world_size, own_rng, capture_state, parts):
    """The call's start on one rank when its snapshot overlaps the call (``plan``; None: nothing to do): gather
    the random streams (a rank lost meanwhile: this rank's own only, and the call then fails), capture
    (``capture_state(rngs)``: the state dict; ``parts``: the operator's ``state_parts()``) into ``handoff``: rank
    0's is serialised beside the call, another rank's only if rank 0 is lost before storing its own (a survivor
    serialises it, :meth:`raysgd.torch.execution.worker.TorchWorker.call_start_snapshot`); then hold the first
    optimizer step until rank 0's snapshot is stored, for the call's length."""
    if plan is None:
        yield
        return
    lost: Exception | None
    try:
        rngs = gather_rngs(own_rng, world_size)
    except Exception as err:  # noqa: BLE001 (raised below, once the state before the call is captured)
        rngs, lost = None, err
    else:
        lost = None
    try:
        capture = Capture(capture_state(rngs), protected_storages(gated_tensors(parts["models"], parts["optimizers"])),
                          fresh=(_state.RNG,))  # gathered (or made) for this capture
    except BaseException as err:
        handoff.offer(plan.token, err)
        raise
    EVENTS.append(("captured", plan.token))
    handoff.offer(plan.token, capture)
    if lost is not None:
        raise lost
    gate = Gate(plan, parts["optimizers"], rank, on_open=handoff.discard)
    try:
        yield
    finally:
        gate.close()


# ----------------------------------------------------------------- the driver's end
class PendingPoint:
    """The call-start snapshot while rank 0 serialises it: rank 0's snapshot call (``info_ref``, ``data_ref``, its
    ``node``), the copies started to other nodes (``[(node, info_ref, data_ref)]``) and the call's ``token``.
    :meth:`settle` turns it into a :class:`~raysgd.torch.restart_points.restart_point.RestartPoint`."""

    def __init__(self, token, info_ref, data_ref, node, copies=(), rank=None):
        self.token, self.info_ref, self.data_ref, self.node = token, info_ref, data_ref, node
        self.copies = list(copies)
        self.rank = rank  # the rank whose part this is, named in errors (None: rank 0's whole state)
        self.info: dict | None = None  # the snapshot's answer, once settled
        self._point = None  # once settled

    def stored(self):
        """Whether rank 0's snapshot and every copy answered (stored or failed): :meth:`settle` then never waits."""
        refs = [self.info_ref] + [info for _, info, _ in self.copies]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def plan(self, timeout_s):
        """The :class:`SnapshotPlan` every rank gets with the call."""
        return SnapshotPlan(self.token, [self.info_ref] + [info for _, info, _ in self.copies], timeout_s)

    def settle(self, timeout_s):
        """The stored point with its copies (a copy that failed is logged and left out). Raises
        :class:`SnapshotFailed` when rank 0's snapshot raised (torn bytes, state that cannot be serialised),
        :class:`~raysgd.torch.restart_points.restart_point.RestartPointLost` when rank 0 was lost before storing them, the
        call failed before its state was captured, or nothing came within ``timeout_s``. Settled again, the same
        point."""
        if self._point is not None:
            return self._point
        deadline = time.monotonic() + timeout_s
        prefix = "" if self.rank is None else f"rank {self.rank}: "
        try:
            info = self.info = ray.get(self.info_ref, timeout=timeout_s)
        except ray_errors.RayTaskError as err:
            text = f"{prefix}{type(err.cause).__name__}: {err.cause}".splitlines()[0]
            if isinstance(err.cause, SnapshotNotTaken):
                raise restart_point.RestartPointLost(text) from err
            raise SnapshotFailed(text) from err
        except ray_errors.RayError as err:
            raise restart_point.RestartPointLost(f"rank {self.rank or 0} was lost before its call-start snapshot "
                                                 f"was stored ({type(err).__name__})") from err
        point = restart_point.RestartPoint([self.data_ref], nbytes=info["bytes"], nodes=[info["node"]])
        for node, info_ref, data_ref in self.copies:
            try:
                copied = ray.get(info_ref, timeout=max(1.0, deadline - time.monotonic()))
            except ray_errors.RayError as err:
                logger.warning("The call-start snapshot's copy on node %s failed (%s); it has %d copy(ies)",
                               node[:12], type(err).__name__, len(point.refs))
                continue
            point.add_copy(data_ref, copied["node"])
        self._point = point
        return point

    def __repr__(self):
        return f"PendingPoint(token={self.token}, {len(self.copies)} copy(ies) started)"


class PendingShardedPoint(PendingPoint):
    """The call-start snapshot of a sharded state while every rank writes its part: ``parts`` (``[(info ref, data
    ref, node, [(node, info ref, data ref), ...copies])]`` in rank order, rank 0's info holding the head) and the
    call's ``token``; :meth:`settle` turns it into a :class:`~raysgd.torch.restart_points.restart_point.ShardedPoint`. No
    survivor can stand in for a lost rank's part (it holds its own shard only). A :class:`PendingPoint` wherever the
    run handles one."""

    sharded = True

    def __init__(self, token, parts):  # noqa: D107 (PendingPoint's fields are rank 0's part's)
        self.parts = [(info, data, node, list(copies)) for info, data, node, copies in parts]
        info, data, node, copies = self.parts[0]
        super().__init__(token, info, data, node, copies)

    def _answers(self):
        return [info for info, _, _, copies in self.parts for info in [info] + [c[1] for c in copies]]

    def stored(self):
        """Whether every part and copy answered (stored or failed): :meth:`settle` then never waits."""
        refs = self._answers()
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def plan(self, timeout_s):
        """The :class:`SnapshotPlan` every rank gets with the call: its first step waits for every rank's part."""
        return SnapshotPlan(self.token, [info for info, _, _, _ in self.parts] +
                            [c[1] for _, _, _, copies in self.parts for c in copies], timeout_s,
                            required=len(self.parts))

    def settle(self, timeout_s):
        """The stored :class:`~raysgd.torch.restart_points.restart_point.ShardedPoint` with its copies (see
        :meth:`PendingPoint.settle`: the same errors, for any rank's part)."""
        if self._point is not None:
            return self._point
        deadline = time.monotonic() + timeout_s
        pieces, head = [], None
        for rank, (info_ref, data_ref, node, copies) in enumerate(self.parts):
            single = PendingPoint(self.token, info_ref, data_ref, node, copies, rank=rank)
            pieces.append(single.settle(max(1.0, deadline - time.monotonic())))
            head = cast(dict, single.info).get("head", head)  # settled
        self._point = restart_point.ShardedPoint(pieces, head=head)
        return self._point

    def __repr__(self):
        return f"PendingShardedPoint(token={self.token}, {len(self.parts)} parts)"
