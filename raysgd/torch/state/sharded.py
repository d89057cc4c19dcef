"""Sharded training state: each rank saves its own shard of the models and optimizers as one blob in DCP's format,
and any number of ranks loads it back, each reading only the rows its new shard takes and the replicated values.

Layer 2 (torch only: no Ray, no files). FSDP2 models (``fully_shard``) hold DTensors; their state goes through
``torch.distributed.checkpoint`` (DCP): :func:`models_and_optimizers_state` and :func:`load_models_and_optimizers`
wrap DCP's ``get_state_dict``/``set_state_dict`` for lists of models and optimizers; :func:`save_parts` (a collective)
gives each rank a :class:`Part` (its blob, the file DCP's ``FileSystemWriter`` writes, and on rank 0 the
checkpoint's metadata and layout); :func:`load_parts` (a collective at any world size: resharding) loads them
through a source of byte ranges (or a ``fetch(relative_path)`` of whole files) that the caller backs with memory, an
object store or files. The byte format is :mod:`~raysgd.torch.state.dcp_blobs`'s (the blobs under their names plus
``.metadata`` are a DCP checkpoint folder), read by :mod:`~raysgd.torch.state.dcp_reader`.

Plain (unsharded) modules work too, in a process group (DCP then saves each replicated tensor once) or in a process
with no process group at all (DCP's single-process mode: one part, rank 0).

Example:
    >>> import torch
    >>> part = save_parts({"w": torch.arange(3.0), "step": 7})
    >>> part.file_name, part.metadata is not None
    ('__0_0.distcp', True)
    >>> target = {"w": torch.zeros(3), "step": 0}
    >>> _ = load_parts(target, part.metadata, {part.file_name: part.blob}.__getitem__)
    >>> target["w"].tolist(), target["step"]
    ([0.0, 1.0, 2.0], 7)
    >>> consolidate_parts(part.metadata, {part.file_name: part.blob}.__getitem__)["w"].tolist()
    [0.0, 1.0, 2.0]
"""
import contextlib
import dataclasses
import logging
import warnings
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from raysgd.base.checks import expect
from raysgd.torch.operator import compiled
from raysgd.torch.state import dcp_blobs, dcp_reader
from raysgd.torch.state.dcp_blobs import as_metadata, file_sizes, renamed_files  # noqa: F401 (renamed_files: public here)

logger = logging.getLogger(__name__)



class LoadStats:
    """What a process's latest :func:`load_parts` read (a worker process has one: :func:`process_load_stats`; tests
    and benchmarks read it there): ``read`` (bytes of the items' ranges), ``needed`` (bytes the loaded values take:
    this rank's new shard and the replicated values), ``pulled`` (bytes the source moved here), ``files`` (files
    read).

    Example:
        >>> stats = LoadStats()
        >>> stats.record({"read": 8, "needed": 8, "files": 1}, pulled=8)
        >>> stats.latest()["pulled"], LoadStats().latest()
        (8, {})
    """

    def __init__(self):
        self._last_load = {}

    def record(self, counts, pulled):
        """A load read ``counts`` (the reader's) and moved ``pulled`` bytes here."""
        self._last_load = {**counts, "pulled": pulled}

    def latest(self):
        """The latest load's counts (a copy); empty before the first."""
        return dict(self._last_load)


_PROCESS_LOAD_STATS = LoadStats()


def process_load_stats():
    """This process's :class:`LoadStats`, which :func:`load_parts` records into.

    Example:
        >>> isinstance(process_load_stats().latest(), dict)
        True
    """
    return _PROCESS_LOAD_STATS


# ----------------------------------------------------------------- models and optimizers
def _owner(models, optimizer):
    """The module whose parameters include all of ``optimizer``'s: its model, or all models together when it spans
    several (then its keys are prefixed with the model's index: ``1.net.weight``)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if params <= {id(p) for p in model.parameters()}:
            return model
    together = torch.nn.ModuleList(models)
    foreign = params - {id(p) for p in together.parameters()}
    if foreign:
        raise ValueError(f"an optimizer expected over the registered models' parameters; got one with "
                         f"{len(foreign)} parameter(s) of no registered model")
    return together


def models_and_optimizers_state(models, optimizers, full=False, metadata=None):
    """``{"models": [...], "optimizers": [...]}``: each model's and optimizer's state dict from DCP's
    ``get_model_state_dict``/``get_optimizer_state_dict`` (keys are parameter names; an FSDP2 model's values are
    DTensors holding this rank's shard). An optimizer's state is keyed by its model's parameter names; one spanning
    several models by ``{model index}.{name}``. ``full``: whole tensors on CPU instead (gathered: a collective of the
    models' process group, every rank gets them).

    An optimizer that has not stepped yet has no state, and keeps none: its entry's ``state`` is empty (DCP would
    give it one by a step with a learning rate of 0, which counts as a step for Adam's bias correction: a state
    saved so would not resume bit-exact). With ``metadata`` (a checkpoint's) the result is what :func:`load_parts`
    loads that checkpoint into: state to fill wherever the checkpoint holds some, none where it holds none.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> adam = torch.optim.Adam(model.parameters())
        >>> models_and_optimizers_state([model], [adam])["optimizers"][0]["state"], len(adam.state)
        ({}, 0)
        >>> model(torch.ones(1, 2)).sum().backward(); adam.step()
        >>> sorted(models_and_optimizers_state([model], [adam])["optimizers"][0]["state"]["weight"])
        ['exp_avg', 'exp_avg_sq', 'step']
    """
    models, optimizers = list(models), list(optimizers)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if full else None
    metadata = as_metadata(metadata) if metadata is not None else None  # (read once)
    with_state = optimizers_with_state(metadata) if metadata is not None else None
    if metadata is not None:  # DCP would load what matches and leave the rest of the checkpoint unread, silently
        for kind, given in saved_counts(metadata).items():
            registered = len(models if kind == "models" else optimizers)
            if given != registered:
                raise ValueError(f"load: the checkpoint holds {given} {kind} but {registered} "
                                 f"{'is' if registered == 1 else 'are'} registered; a partial load would be silently "
                                 f"wrong (was the checkpoint written by a different operator?)")
    states = []
    for index, optimizer in enumerate(optimizers):
        fresh = not optimizer.state
        state = get_optimizer_state_dict(_owner(models, optimizer), optimizer, options=options)
        if fresh and (with_state is None or index not in with_state):
            optimizer.state.clear()  # DCP stepped it with a learning rate of 0 to make its state: undone
            state = {**state, "state": {}}
        elif with_state is not None and index not in with_state:
            state = {**state, "state": {}}  # the checkpoint holds none: loading it clears this optimizer's
        if metadata is not None:  # a group setting the checkpoint lacks (an older torch's optimizer saved it) is
            state = {**state, "param_groups": _saved_settings(state.get("param_groups", ()), metadata, index)}
        states.append(state)
    return {"models": [get_model_state_dict(model, options=options) for model in models], "optimizers": states}


def _saved_settings(groups, metadata, index):
    """``groups`` (optimizer ``index``'s ``param_groups``) without the settings the checkpoint's ``metadata`` lacks:
    DCP would refuse the load (``Missing key in checkpoint state_dict``); the optimizer keeps its own values, as
    torch's ``load_state_dict`` keeps its defaults for them."""
    keys = as_metadata(metadata).state_dict_metadata
    prefix = f"optimizers.{index}.param_groups."
    saved = {key[len(prefix):] for key in keys if key.startswith(prefix)}
    # "{group}.{setting}" of each saved item (a setting that is a dict is saved as its items, one key deeper)
    held = {".".join(name.split(".")[:depth]) for name in saved for depth in range(2, name.count(".") + 2)}
    return [{key: value for key, value in group.items() if key == "params" or f"{number}.{key}" in held}
            for number, group in enumerate(groups)]


def saved_counts(metadata):
    """``{"models": n, "optimizers": m}``: how many models and optimizers a checkpoint's ``metadata`` holds.

    Example:
        >>> import torch
        >>> saved_counts(save_parts(models_and_optimizers_state([torch.nn.Linear(1, 1)], [])).metadata)
        {'models': 1, 'optimizers': 0}
    """
    counts = {"models": 0, "optimizers": 0}
    for key in as_metadata(metadata).state_dict_metadata:
        kind, _, rest = key.partition(".")
        index = rest.partition(".")[0]
        if kind in counts and index.isdigit():
            counts[kind] = max(counts[kind], int(index) + 1)
    return counts


def optimizers_with_state(metadata):
    """The indices of the optimizers whose state a checkpoint's ``metadata`` holds (any ``optimizers.{i}.state.``)."""
    with_state = set()
    for key in as_metadata(metadata).state_dict_metadata:
        parts = key.split(".")
        if len(parts) > 3 and parts[0] == "optimizers" and parts[2] == "state":
            with_state.add(int(parts[1]))
    return with_state


def load_models_and_optimizers(models, optimizers, state, full=False):
    """Load :func:`models_and_optimizers_state`'s ``state`` (e.g. after :func:`load_parts` filled it) into ``models``
    and ``optimizers`` (strict for models). The counts must match what ``state`` holds. ``full``: ``state`` holds
    whole tensors (e.g. :func:`consolidate_parts`' result), of which each rank keeps its shard. An optimizer's
    entry without state leaves it without state (as one that has not stepped).

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> load_models_and_optimizers([b], [], models_and_optimizers_state([a], []))
        >>> bool((a.weight == b.weight).all())
        True
    """
    models, optimizers = list(models), list(optimizers)
    for kind, given in (("models", models), ("optimizers", optimizers)):
        if len(state.get(kind, ())) != len(given):
            raise ValueError(f"load_models_and_optimizers: the state holds {len(state.get(kind, ()))} {kind}; "
                             f"got {len(given)} to load it into")
    for model, model_state in zip(models, state["models"]):
        set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=full))
    # not strict for optimizers, as torch's own load_state_dict: a parameter may have no state (SGD without
    # momentum keeps none), and DCP's strict check would refuse that
    options = StateDictOptions(full_state_dict=full, strict=False)
    for optimizer, optimizer_state in zip(optimizers, state["optimizers"]):
        if full:  # a whole state may come from strategy="ddp": torch's own form, its parameters numbered
            optimizer_state = keyed_by_name(_owner(models, optimizer), optimizer, optimizer_state)
        if not optimizer_state.get("state"):
            optimizer.state.clear()
            for group, saved in zip(optimizer.param_groups, optimizer_state.get("param_groups", ())):
                group.update({key: value for key, value in saved.items() if key != "params"})
            continue
        # a parameter without state (SGD without momentum) gets an empty one, which every optimizer reads as none:
        # torch 2.9's set_optimizer_state_dict wants an entry for each parameter even when not strict
        with_state = dict(optimizer_state["state"])
        for group in optimizer_state.get("param_groups", ()):
            for name in group.get("params", ()):
                with_state.setdefault(name, {})
        # a group setting the optimizer lacks (a scheduler's initial_lr, saved by a run with one) is added first, as
        # torch's load_state_dict adds it: DCP maps the saved values onto the optimizer's own keys only
        own = [dict(group) for group in optimizer.param_groups]
        for group, saved in zip(optimizer.param_groups, optimizer_state.get("param_groups", ())):
            group.update({key: value for key, value in saved.items() if key != "params" and key not in group})
        set_optimizer_state_dict(_owner(models, optimizer), optimizer, {**optimizer_state, "state": with_state},
                                 options=options)
        for group, before in zip(optimizer.param_groups, own):  # one the state lacks keeps the optimizer's value
            for key, value in before.items():
                group.setdefault(key, value)


#: The prefixes DCP leaves out of a parameter's name (``torch.compile``'s and activation checkpointing's wrappers).
_WRAPPER_PREFIXES = (compiled.PREFIX, "_checkpoint_wrapped_module.")


def keyed_by_name(owner, optimizer, optimizer_state):
    """``optimizer_state`` in DCP's form (state and ``param_groups`` keyed by ``owner``'s parameter names) when it
    is in torch's own (``optimizer.state_dict()``: parameters numbered in the order of the groups, as a
    ``strategy="ddp"`` run saves them); as it is otherwise. The numbers map to ``optimizer``'s parameters by
    position, as ``optimizer.load_state_dict`` maps them, and the groups must match in number and size.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(1, 2)).sum().backward(); sgd.step()
        >>> named = keyed_by_name(model, sgd, sgd.state_dict())
        >>> sorted(named["state"]), named["param_groups"][0]["params"]
        (['bias', 'weight'], ['weight', 'bias'])
    """
    saved = optimizer_state.get("param_groups", ())
    if not any(isinstance(key, int) for group in saved for key in group.get("params", ())):
        return optimizer_state
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if [len(group.get("params", ())) for group in saved] != sizes:
        raise ValueError(f"load_models_and_optimizers: the state of {type(optimizer).__name__} holds parameter groups "
                         f"of {[len(group.get('params', ())) for group in saved]} parameters; the optimizer has "
                         f"groups of {sizes}")
    names = {}
    for name, param in owner.named_parameters():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        names[id(param)] = name
    current = [param for group in optimizer.param_groups for param in group["params"]]
    by_number = {number: names[id(param)] for number, param in
                 zip((key for group in saved for key in group["params"]), current)}
    return {**optimizer_state,
            "state": {by_number.get(key, key): value for key, value in optimizer_state.get("state", {}).items()},
            "param_groups": [{**group, "params": [by_number[key] for key in group["params"]]} for group in saved]}


# ----------------------------------------------------------------- parts
@dataclasses.dataclass
class Part:
    """One rank's share of a sharded checkpoint.

    Attributes:
        rank: the rank (in the saving group) that wrote it.
        file_name: its file's name in a DCP checkpoint folder (``__{rank}_0.distcp``).
        blob: the file's bytes (a ``bytearray``; empty when the rank had nothing to save).
        metadata: the checkpoint's ``.metadata`` bytes on rank 0 (the same for every rank's part); None elsewhere.
        layout: on rank 0, where each tensor item's raw bytes start in its file (``{item key: offset}``, every
            rank's: :attr:`~raysgd.torch.state.dcp_blobs.BlobWriter.layout`), which lets a load read only the rows
            it needs; None elsewhere.

    Example:
        >>> Part(1, "__1_0.distcp", bytearray(b"x"), None).nbytes
        1
    """

    rank: int
    file_name: str
    blob: bytearray
    metadata: bytes | None = None
    layout: dict | None = None

    @property
    def nbytes(self):
        """The blob's size in bytes."""
        return len(self.blob)


def _single_process(process_group):
    """Whether DCP runs without collectives here (no process group initialised and none given)."""
    return process_group is None and not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _dcp_call(single, process_group=None):
    """Around a DCP call: without a process group DCP warns on every call that it assumes a single process (that is
    the intent here), and a failure on any rank comes back as DCP's ``CheckpointException`` (a ``BaseException``
    holding every rank's error): the error itself is raised instead (this rank's, else the lowest failed rank's),
    with DCP's report of every rank as its cause."""
    with warnings.catch_warnings() if single else contextlib.nullcontext():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            yield
        except CheckpointException as err:
            rank = 0 if single else dist.get_rank(process_group)
            failures = err.failures
            error = (failures.get(rank) or failures[min(failures)])[0] if failures else None
            if not isinstance(error, Exception):
                raise
            raise error from err


def save_parts(state_dict, process_group=None):
    """Save ``state_dict`` (e.g. :func:`models_and_optimizers_state`'s) as this rank's :class:`Part`: a collective of
    ``process_group`` (the default group; none: this process alone). Each rank's blob holds its own shards and its
    share of the replicated values; rank 0's part also holds the metadata. The deadline of the collectives is the
    process group's timeout.

    Example:
        >>> import torch
        >>> save_parts({"w": torch.ones(2)}).rank
        0
    """
    expect(isinstance(state_dict, dict), "save_parts", "a state dict (a dict)", state_dict, TypeError,
           got=type(state_dict).__name__)
    single = _single_process(process_group)
    writer = dcp_blobs.BlobWriter()
    with _dcp_call(single, process_group):
        dcp.save(state_dict, storage_writer=writer, process_group=process_group, no_dist=single)
    return Part(rank=cast(int, writer.rank), file_name=cast(str, writer.file_name), blob=cast(bytearray, writer.blob),
                metadata=writer.metadata, layout=writer.layout)  # (rank, file_name and blob: set by the save)


def load_parts(state_dict, metadata, fetch, process_group=None, weights_only=True, layout=None):
    """Load a checkpoint saved by :func:`save_parts` (or DCP's ``FileSystemWriter``) into ``state_dict`` in place: a
    collective of ``process_group`` at any world size (each rank loads its own shard, resharded from the saved ones).

    Args:
        state_dict: what to load into, e.g. :func:`models_and_optimizers_state` of this rank's models (its tensors
            are filled in place; its other values replaced).
        metadata: the checkpoint's ``.metadata`` bytes (rank 0's :attr:`Part.metadata`) or a DCP ``Metadata``.
        fetch: where the files' bytes come from: a source (``read(relative_path, [(offset, length), ...]) ->
            [buffer, ...]``: only those ranges) or ``fetch(relative_path) -> buffer`` (a whole file). Asked once
            for each file this rank needs (:func:`files_needed`), never for another; it bounds its own wait (a
            ``ray.get(ref, timeout=...)``, a filesystem's request timeout) and raises when the file is gone.
        process_group: the group loading (the default group; none: this process alone).
        weights_only: read the metadata and the non-tensor values only if a safe load accepts them.
        layout: :attr:`Part.layout` of rank 0 (saved with the checkpoint): each rank then reads only the rows of
            the saved shards that its new shard takes, and the replicated values; without it, whole items.

    Returns the reader's counts (:attr:`~raysgd.torch.state.dcp_reader.BlobReader.stats`: ``read``, ``needed``,
    ``files``).

    Example:
        >>> # load_parts(state, parts[0].metadata, {p.file_name: p.blob for p in parts}.__getitem__)
    """
    expect(isinstance(state_dict, dict), "load_parts", "a state dict (a dict) to load into", state_dict, TypeError,
           got=type(state_dict).__name__)
    source = dcp_reader.as_source(fetch)
    single = _single_process(process_group)
    reader = dcp_reader.BlobReader(metadata, source, layout=layout, weights_only=weights_only)
    with _dcp_call(single, process_group):
        dcp.load(state_dict, storage_reader=reader, process_group=process_group, no_dist=single)
    _PROCESS_LOAD_STATS.record(reader.stats, pulled=getattr(source, "pulled", reader.stats["read"]))
    return _PROCESS_LOAD_STATS.latest()


def files_needed(state_dict, metadata):
    """The files (sorted relative paths) that loading into ``state_dict`` on this rank reads: the saved shards that
    overlap this rank's new ones (with the replicated values' files). Local and cheap: DCP's load planner on this
    rank alone, no collective, no data read.

    Example:
        >>> import torch
        >>> part = save_parts({"w": torch.ones(2)})
        >>> files_needed({"w": torch.zeros(2)}, part.metadata)
        ['__0_0.distcp']
    """
    metadata = as_metadata(metadata)
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state_dict, metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    return sorted({metadata.storage_data[item.storage_index].relative_path for item in plan.items})


def file_names(metadata):
    """The files (sorted relative paths) ``metadata`` (a ``Metadata`` or its bytes) refers to.

    Example:
        >>> file_names(save_parts({"w": torch.ones(2)}).metadata)
        ['__0_0.distcp']
    """
    return list(file_sizes(metadata))


# ----------------------------------------------------------------- one full state
def _empty_state(metadata):
    """A flat state dict to load the whole checkpoint into: a full CPU tensor per tensor, None per other value."""
    state: dict[str, torch.Tensor | None] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, dcp_metadata.TensorStorageMetadata):
            state[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            state[key] = None
    return state


def _unflatten(flat, paths):
    """``flat`` (DCP's flattened keys) nested again by ``paths`` (``{key: (k1, k2, ...)}``, the planner's mapping; an
    int is a list index). A key without a path stays at the top."""
    nested: dict = {}
    for key, value in flat.items():
        path = tuple(paths.get(key, (key,)))
        node = nested
        for step, following in zip(path[:-1], path[1:]):
            node = _slot(node, step, list if isinstance(following, int) else dict)
        _slot(node, path[-1], None, value)
    return nested


def _slot(node, step, kind, value=None):
    """``node[step]``, created as ``kind()`` (or set to ``value`` when ``kind`` is None); a list grows to hold it."""
    if isinstance(node, list):
        node.extend([None] * (step + 1 - len(node)))
        if kind is None or node[step] is None:
            node[step] = value if kind is None else kind()
        return node[step]
    if kind is None:
        node[step] = value
        return value
    return node.setdefault(step, kind())


def consolidate_parts(metadata, fetch, weights_only=True, layout=None):
    """The whole checkpoint as one state dict of full CPU tensors, nested as it was saved (e.g.
    ``{"models": [{"weight": tensor}], "optimizers": [...]}``), read through ``fetch`` in this process alone (never a
    collective, also where a process group exists): for serving, or a model's copy on the driver. Every file is
    fetched once; the peak is the full state plus one file.

    Example:
        >>> part = save_parts({"m": {"w": torch.ones(2)}})
        >>> consolidate_parts(part.metadata, {part.file_name: part.blob}.__getitem__)["m"]["w"].tolist()
        [1.0, 1.0]
    """
    metadata = as_metadata(metadata, weights_only=weights_only)
    flat = _empty_state(metadata)
    reader = dcp_reader.BlobReader(metadata, fetch, layout=layout, weights_only=weights_only)
    with _dcp_call(True):
        dcp.load(flat, storage_reader=reader, no_dist=True)
    return _unflatten(flat, metadata.planner_data or {})
