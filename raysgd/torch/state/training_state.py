"""The one home of the training state: build it from a worker's operator and restore it, in one format.

Layer 2 (torch, numpy, layers 0-1). Snapshots, commits, ``save``/``load`` and Tune checkpoints all go
through :func:`capture` and :func:`restore`. The operator owns what is its own and hands it over
through ``TrainingOperator.state_parts()``; nobody reads its private attributes.

The state is a dict that ``torch.load(weights_only=True)`` accepts (tensors, numbers, strings, lists,
dicts; random states as bytes and lists, so two states compare with ``==`` where their tensors do)::

    {"epoch", "global_step", "operator", "models", "optimizers"[, "schedulers"][, "amp_*"],
     "rng": [one dict per rank],                  # optional: torch CPU/CUDA, numpy, Python random (RandomStreams)
     "cursor": {"epoch", "consumed", "steps", "call_steps"},  # optional: a commit inside an epoch (DataCursor)
     "meters": [one partial summary per rank]}    # optional: the committed part of the epoch's metrics

Old checkpoints without the optional keys still load. Each part is a component's own ``state_dict()`` (the
:class:`~raysgd.base.stateful.Stateful` protocol): the operator's, its precision's, the process's
:class:`RandomStreams`, the committer's :class:`~raysgd.torch.sharding.cursor.DataCursor`.

Example:
    >>> import torch
    >>> rng = rng_state()
    >>> a = torch.rand(1)
    >>> set_rng_state(rng)
    >>> bool(torch.rand(1) == a)
    True
"""
import collections
import contextlib
import copy
import logging
import random

import numpy as np
import torch

from raysgd.torch.operator import compiled as _compiled
from raysgd.meters import merge_partial

logger = logging.getLogger(__name__)

#: Keys a commit adds to the state (absent in snapshots of a finished call and in old checkpoints).
CURSOR, RNG, METERS = "cursor", "rng", "meters"
#: Marks a sharded state's rest (its models and optimizers are in the parts) or a whole state of a sharded run.
SHARDED = "sharded"


def host_copy(value):
    """A deep copy of ``value`` with every tensor copied to host memory (the only cost a commit puts in the loop).

    Nothing of ``value`` is shared with the copy: other mutable leaves (sets, numpy arrays, objects of your
    own in an operator's ``state_dict()``) are deep-copied too, so a commit serialised in the background never
    sees training change them.

    Example:
        >>> import torch
        >>> t = torch.ones(2)
        >>> c = host_copy({"a": [t]})
        >>> c["a"][0] is t, bool((c["a"][0] == t).all())
        (False, True)
        >>> import collections
        >>> Pair = collections.namedtuple("Pair", "x y")
        >>> p = host_copy(Pair(t, 1))
        >>> type(p).__name__, p.x is t
        ('Pair', False)
        >>> seen = {1, 2}
        >>> host_copy({"seen": seen})["seen"] is seen
        False
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        items = [(key, host_copy(item)) for key, item in value.items()]
        return type(value)(items) if type(value) in (dict, collections.OrderedDict) else dict(items)
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if isinstance(value, tuple):  # a namedtuple keeps its type (its tensors are copied too)
        items = [host_copy(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if value is None or isinstance(value, _IMMUTABLE):
        return value
    return copy.deepcopy(value)


_IMMUTABLE = (bool, int, float, complex, str, bytes, torch.dtype, torch.device)


# ----------------------------------------------------------------- random streams
def _as_bytes(tensor):
    return bytes(tensor.cpu().numpy())


def _as_tensor(value):
    """A generator state as the uint8 tensor torch wants: from bytes (this format) or a tensor (older states)."""
    return torch.frombuffer(bytearray(value), dtype=torch.uint8) if isinstance(value, bytes) else value.cpu()


def rng_state():
    """Every random stream of this process as plain weights_only-safe values that compare with ``==``: torch CPU
    and CUDA (bytes), numpy and Python (lists of ints)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": _as_bytes(torch.get_rng_state()),
        "numpy": [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_as_bytes(t) for t in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state):
    """Restore what :func:`rng_state` returned, also in the older tensor form (streams it lacks are left alone)."""
    if not state:
        return
    if "torch" in state:
        torch.set_rng_state(_as_tensor(state["torch"]))
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        keys = keys.cpu().numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
        np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    if "python" in state:
        version, internal, gauss_next = state["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        for index in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(_as_tensor(states[index]), index)


class RandomStreams:
    """This process's random streams as one :class:`~raysgd.base.stateful.Stateful` component: ``state_dict()`` is
    :func:`rng_state`, ``load_state_dict`` is :func:`set_rng_state` (None: the streams go on as they are).

    Example:
        >>> import torch
        >>> streams = RandomStreams()
        >>> saved = streams.state_dict()
        >>> a = torch.rand(1)
        >>> streams.load_state_dict(saved)
        >>> bool(torch.rand(1) == a)
        True
    """

    def state_dict(self):
        """Every random stream of this process now (see :func:`rng_state`)."""
        return rng_state()

    def load_state_dict(self, state):
        """Put back what :meth:`state_dict` returned (also its older tensor form)."""
        set_rng_state(state)


#: The process's random streams (a process has one set: a single component serves every caller).
RANDOM_STREAMS = RandomStreams()


@contextlib.contextmanager
def preserved_rng():
    """Leave every random stream of this process as it was on entry (e.g. around validation, whose data loader
    draws a seed from torch's stream, so that validating never changes what training draws next). Saved in the
    native forms: no tensor is read into Python.

    Example:
        >>> import torch
        >>> before = rng_state()
        >>> a = torch.rand(1)
        >>> set_rng_state(before)
        >>> with preserved_rng():
        ...     _ = torch.rand(5)  # drawn, then the stream is put back
        >>> bool(torch.rand(1) == a)
        True
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cpu, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


# ----------------------------------------------------------------- build and restore
def capture(operator, epoch, copy=False):
    """The state of one worker's operator: ``{epoch, global_step, operator, models, optimizers, ...}``.

    Models are unwrapped (no DDP prefix). With ``copy`` every tensor is a host copy, so the result
    stays valid while training goes on (a commit serialises it in the background).
    """
    if is_sharded(operator):  # whole tensors gathered from the shards (a collective), optimizers in DCP's form
        state = {**capture_rest(operator, epoch), **capture_shards(operator, full=True)}
        return host_copy(state) if copy else state
    parts = operator.state_parts()
    state = {
        "epoch": epoch,
        "global_step": operator.global_step,
        "operator": operator.state_dict(),
        "models": [model.state_dict() for model in parts["models"]],
        "optimizers": [optimizer.state_dict() for optimizer in parts["optimizers"]],
    }
    if parts["schedulers"]:
        state["schedulers"] = [scheduler.state_dict() for scheduler in parts["schedulers"]]
    state.update(parts["precision"].state_dict())
    return host_copy(state) if copy else state


def is_sharded(operator):
    """Whether ``operator``'s state is a sharded one (``TorchTrainer(strategy="fsdp")``, at any number of workers): one
    part per rank (:func:`capture_shards`) and a small rest that rank 0's holds (:func:`capture_rest`)."""
    return bool(getattr(operator, "shards_state", False))


def capture_rest(operator, epoch):
    """:func:`capture` without the models and optimizers (a sharded state's rest: small, the same on every rank)."""
    parts = operator.state_parts()
    state = {"epoch": epoch, "global_step": operator.global_step, "operator": operator.state_dict(),
             SHARDED: True}
    if parts["schedulers"]:
        state["schedulers"] = [scheduler.state_dict() for scheduler in parts["schedulers"]]
    state.update(parts["precision"].state_dict())
    return state


def capture_shards(operator, full=False, metadata=None):
    """This rank's shard of the models and optimizers, as DCP state dicts (``{"models": [...], "optimizers": [...]}``
    of DTensors: :func:`raysgd.torch.state.sharded.models_and_optimizers_state`); what the parts save and, with a
    checkpoint's ``metadata``, what they load into. ``full``: whole CPU tensors instead (a collective). Saving
    (no ``metadata``), every rank first takes rank 0's buffers (a collective: ``operator.sync_buffers()``), so the
    parts hold the buffers ``get_model()`` returns, whichever rank's copy DCP keeps."""
    parts = operator.state_parts()
    if metadata is None and hasattr(operator, "sync_buffers"):
        operator.sync_buffers()  # rank 0's buffers on every rank before any is saved (DDP's semantics)
    from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: only sharded strategies pay it)
    return sharded.models_and_optimizers_state(parts["models"], parts["optimizers"], full=full, metadata=metadata)


def restore_shards(operator, shards):
    """Load :func:`capture_shards`' state (filled by a load of the parts) into the operator's models and optimizers."""
    parts = operator.state_parts()
    from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: only sharded strategies pay it)
    sharded.load_models_and_optimizers(parts["models"], parts["optimizers"], shards)


def _restore_full_into_shards(parts, state):
    """A whole (unsharded) state's models and optimizers loaded into sharded ones: each rank keeps its shard."""
    _check_count("models", parts["models"], state["models"])
    _check_count("optimizers", parts["optimizers"], state["optimizers"])
    from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: only sharded strategies pay it)
    sharded.load_models_and_optimizers(parts["models"], parts["optimizers"], state, full=True)


def _check_count(kind, registered, stored):
    if len(registered) != len(stored):
        raise ValueError(f"load_state_dict: the state holds {len(stored)} {kind} but {len(registered)} "
                         f"{'is' if len(registered) == 1 else 'are'} registered; a partial load would be silently "
                         f"wrong (was the checkpoint written by a different operator?)")


def restore(operator, state):
    """Load :func:`capture`'s state into ``operator``; returns the stored epoch.

    The number of models, optimizers and schedulers must match what the operator registered: a
    mismatch raises ``ValueError`` naming both counts (nothing is loaded then).

    Example:
        >>> # epoch = restore(worker.operator, state)
    """
    parts = operator.state_parts()
    schedulers = parts["schedulers"] or []
    if "schedulers" in state or schedulers:
        _check_count("schedulers", schedulers, state.get("schedulers", []))
    if "models" not in state and state.get(SHARDED):
        pass  # a sharded state's rest: its shards were loaded (restore_shards)
    elif is_sharded(operator):
        _restore_full_into_shards(parts, state)
    else:
        _check_count("models", parts["models"], state["models"])
        _check_count("optimizers", parts["optimizers"], state["optimizers"])
        for model, model_state in zip(parts["models"], state["models"]):
            _compiled.load_model_state(model, model_state)  # strict; also a checkpoint with torch.compile's prefix
        for optimizer, optimizer_state in zip(parts["optimizers"], state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
    for scheduler, scheduler_state in zip(schedulers, state.get("schedulers", [])):
        scheduler.load_state_dict(scheduler_state)
    parts["precision"].load_state_dict(state)
    operator.global_step = state.get("global_step", operator.global_step)
    operator.load_state_dict(state["operator"])
    return state["epoch"]


def rank_rng(state, rank):
    """This rank's random streams from a state with per-rank ``rng`` (None when it has none for ``rank``)."""
    streams = state.get(RNG) or []
    return streams[rank] if rank < len(streams) else None


def meters_share(meters, rank, world_size):
    """Rank ``rank``'s part of a commit's per-rank ``meters`` resumed on ``world_size`` ranks: the committed metrics
    of old rank ``i`` go to ``i % world_size`` (as :func:`raysgd.meters.merge_partials` maps them).

    Example:
        >>> meters_share([{"num_samples": 4, "batch_count": 1}, {"num_samples": 2, "batch_count": 1}], 0, 1)
        {'num_samples': 6, 'batch_count': 2}
    """
    share = None
    for index, part in enumerate(meters or ()):
        if part and index % world_size == rank:
            share = merge_partial(share, part)
    return share


def commit_overlay(records):
    """What the per-rank commit records ``{rank: record}`` add to rank 0's committed state: ``rng`` and ``meters`` in
    rank order and rank 0's ``cursor`` (small: the driver reads these; the state itself goes to the workers).

    Each record is ``{"rng", "meters", "cursor"}``; rank 0 sent its state apart.
    """
    ranks = sorted(records)
    return {RNG: [records[rank]["rng"] for rank in ranks], METERS: [records[rank]["meters"] for rank in ranks],
            CURSOR: dict(records[0]["cursor"])}


def assemble_commit(records, state):
    """One state from the per-rank commit records ``{rank: record}`` and rank 0's committed ``state``: the state as
    the module docstring describes, with ``rng`` and ``meters`` in rank order (see :func:`commit_overlay`)."""
    return {**state, **commit_overlay(records)}
