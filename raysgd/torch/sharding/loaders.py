"""Sharding registered DataLoaders across workers by their own samplers, and moving batches to a device.

Layer 1: imports torch and :mod:`raysgd.torch.sharding.cursor` (which decides the positions each rank reads).

A map-style ``DataLoader`` is rebuilt with every setting it had, its sampler (or custom
``batch_sampler``) wrapped in a :class:`~raysgd.torch.sharding.cursor.ShardSampler`: each rank reads every
``world_size``-th position of the sampler's stream for the epoch, so a ``SubsetRandomSampler`` over
the training indices stays exactly those indices. Training shards keep DDP in lockstep; validation
shards are exact (``drop_last`` drops one process's partial batch, not each rank's).

A sampler whose epoch cannot be drawn whole (endless, or longer than ``SGD_MAX_CURSOR_POSITIONS``), or
whose draws do not repeat for the same ``(seed, epoch)`` (it shuffles with a random object of its own), is
wrapped in a :class:`~raysgd.torch.sharding.cursor.StreamShardSampler` instead: read lazily, with no data cursor.

A training loader with a cursor reads its batches in the sampler's order: ``in_order=False`` (with
``num_workers > 0``) is turned into ``in_order=True``, since the cursor counts the first ``k`` batches as the
first ``k`` batches of that order. A loader raysgd does not shard has no cursor when it reads out of order.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> loader = DataLoader(TensorDataset(torch.arange(5.)), batch_size=2)
    >>> shard = shard_loader(loader, rank=1, world_size=2, training=False)
    >>> [b[0].tolist() for b in shard]
    [[1.0, 3.0]]
    >>> loader_cursor(shard, batches_taken=1)  # positions consumed by both ranks after one batch each
    4
"""
import collections.abc
import logging

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from raysgd.base import environment
from raysgd.base.checks import is_int
from raysgd.torch.sharding.cursor import ShardSampler, StreamShardSampler
from raysgd.torch.sharding.epoch_order import StreamTooLong, draws_repeat, stream_length

logger = logging.getLogger(__name__)

#: The samplers raysgd shards a loader with: with a data cursor, and lazily drawn (no cursor).
SHARD_SAMPLERS = (ShardSampler, StreamShardSampler)

# A sampler with no length whose stream does not end within this many positions per dataset sample (or
# _PROBE_FLOOR) is taken to be endless: it is sharded lazily, without a cursor.
_PROBE_FACTOR, _PROBE_FLOOR = 4, 1024

# DataLoader settings carried over when a loader is rebuilt (batch_size and drop_last are set apart).
_COPIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
           "generator", "persistent_workers", "pin_memory_device", "in_order")


def resolve_seed(loader, seed=None):
    """The shuffle seed: ``seed`` (the ``DATA_SEED`` config key) if given, else the loader's or its
    sampler's ``generator.initial_seed()``, else 0. It must be the same on every rank.

    Example:
        >>> resolve_seed(DataLoader(range(3), generator=torch.Generator().manual_seed(5)))
        5
    """
    if seed is not None:
        if not is_int(seed):
            raise TypeError(f"the data seed (config key 'data_seed') must be an int; got {type(seed).__name__} "
                            f"{seed!r}")
        return int(seed)
    for owner in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator):
            return int(generator.initial_seed())
    return 0


def shard_loader(loader, rank, world_size, training, seed=None):
    """Rebuild ``loader`` so that this rank reads only its shard; loaders that cannot be sharded pass through.

    Passed through: anything that is not a ``DataLoader``, iterable-style datasets, and loaders whose
    sampler, or custom ``batch_sampler``'s inner sampler, is already a ``DistributedSampler`` (sharded by the
    user). ``training`` keeps every rank at the same batch count; validation shards are exact. ``seed``: see
    :func:`resolve_seed`. A sampler that is endless or longer than ``SGD_MAX_CURSOR_POSITIONS`` is sharded lazily,
    without a cursor.

    Example:
        >>> import itertools
        >>> from torch.utils.data import RandomSampler
        >>> huge = DataLoader(range(8), batch_size=2, sampler=RandomSampler(range(8), True, 10**12))
        >>> shard = shard_loader(huge, rank=0, world_size=2, training=True)
        >>> len(next(iter(shard))), loader_cursor(shard, 1)  # the first batch at once; no cursor
        (2, None)
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    own = _user_sampler(loader)
    if own is not None:
        logger.debug("DataLoader already has a DistributedSampler: it is used as it is, not sharded again.")
        if (getattr(own, "num_replicas", world_size), getattr(own, "rank", rank)) != (world_size, rank):
            logger.warning("The DataLoader's DistributedSampler reads shard %s of %s, but this worker is rank %d of "
                           "%d: it is used as it is, so some samples are read by no worker or by several. Build it "
                           "without num_replicas and rank (they come from the process group), or let raysgd shard "
                           "the loader's sampler.", getattr(own, "rank", "?"), getattr(own, "num_replicas", "?"),
                           rank, world_size)
        return loader
    seed = resolve_seed(loader, seed)
    kwargs = {name: getattr(loader, name) for name in _COPIED if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    else:
        kwargs.pop("persistent_workers", None)
    if loader.batch_size is None and loader.batch_sampler is not None:  # a custom batch_sampler: shard batches
        kind = _sharding(loader.batch_sampler, loader.dataset, seed, rank)
        _keep_order(kwargs, kind, training, rank)
        shard = kind(loader.batch_sampler, rank, world_size, seed=seed, batch_size=1, lockstep=training)
        return DataLoader(loader.dataset, batch_sampler=shard, **kwargs)
    # batch_size=None turns automatic batching off: each index is a batch.
    kind = _sharding(loader.sampler, loader.dataset, seed, rank)
    _keep_order(kwargs, kind, training, rank)
    shard = kind(loader.sampler, rank, world_size, seed=seed, batch_size=loader.batch_size or 1,
                 drop_last=loader.drop_last, lockstep=training)
    # Validation drops one process's partial batch in the shard (exact); a rank's own partial batch is kept.
    return DataLoader(loader.dataset, sampler=shard, batch_size=loader.batch_size,
                      drop_last=loader.drop_last and training, shuffle=False, **kwargs)


def _user_sampler(loader):
    """The loader's sampler, or its custom batch sampler's inner ``sampler``, that is a ``DistributedSampler``;
    None when neither is."""
    inner = getattr(loader.batch_sampler, "sampler", None) if loader.batch_size is None else None
    return next((s for s in (loader.sampler, inner) if isinstance(s, DistributedSampler)), None)


def _sharding(base, dataset, seed, rank):
    """:class:`ShardSampler` when ``base``'s epoch can be drawn whole and repeats (the cursor), else
    :class:`StreamShardSampler`.

    Epoch 0 is drawn twice (a cost at set-up only) and must come out the same: a sampler shuffling with a
    random object of its own would give every draw, and every restart, another order. Without a length,
    the draws stop at a bound: a stream that ends within it is finite, one that goes on is taken to be endless.
    """
    length, most = stream_length(base), environment.get("SGD_MAX_CURSOR_POSITIONS")
    if length is not None and length > most:
        why = f"has {length} positions, more than SGD_MAX_CURSOR_POSITIONS={most}"
    else:
        probe = most if length is not None else min(
            most, max(_PROBE_FACTOR * (stream_length(dataset) or 0), _PROBE_FLOOR))
        try:
            if draws_repeat(base, seed, 0, limit=probe):
                return ShardSampler
            why = ("draws another order each time for the same seed and epoch (it shuffles with a random object "
                   "of its own, such as random.Random or numpy's default_rng, which raysgd cannot seed; keep a "
                   "torch.Generator in its `generator` attribute, or draw from the global torch, numpy or random "
                   "streams, to keep the cursor)")
        except StreamTooLong:
            why = f"{'has no length and ' if length is None else ''}yields more than {probe} positions (endless?)"
    if rank == 0:
        logger.warning("The DataLoader's sampler %s %s: it is sharded lazily, without a data cursor, so no commit "
                       "is taken inside its epochs and a failure replays the epoch.", type(base).__name__, why)
    return StreamShardSampler


def _keep_order(kwargs, kind, training, rank):
    """A training loader with a cursor reads its batches in the sampler's order: ``in_order=False`` becomes True."""
    if not (training and kind is ShardSampler and kwargs.get("num_workers", 0) > 0 and kwargs.get("in_order") is False):
        return
    kwargs["in_order"] = True
    if rank == 0:
        logger.warning("The training DataLoader(in_order=False) reads its batches in order (in_order=True): the data "
                       "cursor counts the first k batches as the first k of the sampler's order, which out-of-order "
                       "batches are not.")


def shard_sampler(loader, kinds=(ShardSampler,)):
    """The :class:`~raysgd.torch.sharding.cursor.ShardSampler` (one of ``kinds``) of a loader built by :func:`shard_loader`.

    None when the loader has none (it was passed through, or is read lazily without a cursor).
    """
    for name in ("batch_sampler", "sampler"):
        sampler = getattr(loader, name, None)
        if isinstance(sampler, kinds):
            return sampler
    return None


def set_sampler_epoch(loader, epoch):
    """Call ``set_epoch(epoch)`` on the loader's shard sampler, else on its own sampler when it has one, else on
    its batch sampler or that one's inner sampler (a ``DistributedSampler`` under a custom ``batch_sampler``)."""
    sampler = shard_sampler(loader, SHARD_SAMPLERS)
    if sampler is None:  # not "or": a sampler's truth is its length, which may be 0 or unknown
        batch_sampler = getattr(loader, "batch_sampler", None)
        owners = (getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
        sampler = next((owner for owner in owners if hasattr(owner, "set_epoch")), None)
    if sampler is not None:
        sampler.set_epoch(epoch)


def _cursor_sampler(loader):
    """The loader's sampler with the cursor's API: our shard, or a sampler of the user's own with ``set_start`` and
    ``position_after`` (``add_dist_sampler=False``); None when it has none."""
    sampler = shard_sampler(loader)
    if sampler is not None:
        return sampler
    own = getattr(loader, "sampler", None)
    if hasattr(own, "set_start") and hasattr(own, "position_after") and getattr(loader, "batch_size", None):
        return own
    return None


def reads_out_of_order(loader):
    """True for a ``DataLoader(num_workers > 0, in_order=False)``: its batches come as its processes finish them.

    Example:
        >>> reads_out_of_order(DataLoader(range(4), num_workers=2, in_order=False))
        True
    """
    return isinstance(loader, DataLoader) and loader.num_workers > 0 and getattr(loader, "in_order", True) is False


def set_sampler_start(loader, consumed):
    """Make the loader's next pass start at the global cursor ``consumed``; False when it has no cursor.

    Example:
        >>> shard = shard_loader(DataLoader(range(6), batch_size=1), rank=0, world_size=2, training=True)
        >>> set_sampler_start(shard, 2), [int(b) for b in shard]
        (True, [2, 4])
    """
    sampler = _cursor_sampler(loader)
    if sampler is None:
        return False
    sampler.set_start(consumed)
    return True


def loader_cursor(loader, batches_taken):
    """The global cursor after every rank took ``batches_taken`` batches of this pass; None when it has none.

    It counts positions of the epoch's stream (batches, for a custom ``batch_sampler``). A loader reading
    out of order (:func:`reads_out_of_order`; raysgd's own training shards never do) has none: its first
    ``k`` batches are not the first ``k`` of the stream.
    """
    sampler = _cursor_sampler(loader)
    if sampler is None or reads_out_of_order(loader):
        return None
    if isinstance(sampler, ShardSampler):
        return sampler.position_after(batches_taken)
    return int(sampler.position_after(batches_taken, loader.batch_size))


def cursor_positions(loader):
    """How many positions the loader's epoch stream has (what its cursor counts: samples, or batches of a custom
    ``batch_sampler``); None when it has no cursor of raysgd's.

    Example:
        >>> cursor_positions(shard_loader(DataLoader(range(6), batch_size=2), rank=0, world_size=2, training=True))
        6
    """
    sampler = shard_sampler(loader)
    return sampler.total if sampler is not None else None


def resumed_start(loader, consumed, positions, warn=True):
    """Where a cursor of ``consumed`` positions, taken on an epoch stream of ``positions`` (None: unknown, a cursor
    of an older raysgd), starts ``loader``'s epoch: at ``consumed``; or, when the loader's stream has another length
    (a custom ``batch_sampler`` counts batches, whose size follows ``config[BATCH_SIZE]`` split over the workers, so
    a resize changes them), at the same share of it, rounded down, logged when ``warn`` (rank 0 says it once).

    Example:
        >>> shard = shard_loader(DataLoader(range(8), batch_size=1), rank=0, world_size=1, training=True)
        >>> resumed_start(shard, 3, 8), resumed_start(shard, 3, None), resumed_start(shard, 4, 16, warn=False)
        (3, 3, 2)
    """
    now = cursor_positions(loader)
    if not positions or now is None or positions == now:
        return consumed
    start = consumed * now // positions
    if warn:
        logger.warning(
            "The loaded data cursor (%d of %d positions) was taken on an epoch stream of another length than this "
            "train loader's (%d): it starts at %d, the same share of the epoch, rounded down (a few samples may be "
            "trained again). A custom batch_sampler's stream counts batches, whose size follows config[BATCH_SIZE] "
            "split over the workers; with a fixed batch size (TorchTrainer(fixed_worker_batch=True)) or "
            "DataLoader(batch_size=...), whose cursor counts samples, the cursor is exact.",
            consumed, positions, now, start)
    return start


def to_device(batch, device, non_blocking=True):
    """Move every tensor in a (nested) batch to ``device``; containers keep their type, other objects pass through.

    Namedtuples, tuple and list subclasses and ``dict`` subclasses (``OrderedDict``, ``defaultdict``)
    come back as the same type.

    Example:
        >>> import collections
        >>> Pair = collections.namedtuple("Pair", "x y")
        >>> to_device(Pair(torch.zeros(1), [torch.ones(1)]), "cpu")
        Pair(x=tensor([0.]), y=[tensor([1.])])
    """
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(item, device, non_blocking) for item in batch))
    if isinstance(batch, (list, tuple)):
        moved = [to_device(item, device, non_blocking) for item in batch]
        return _rebuild(batch, moved)
    if isinstance(batch, collections.abc.Mapping):
        moved = [(key, to_device(value, device, non_blocking)) for key, value in batch.items()]
        return _rebuild(batch, moved)
    return batch


def _rebuild(container, items):
    """``type(container)(items)``, keeping a defaultdict's factory; a plain list/tuple/dict if that fails."""
    kind = type(container)
    if kind in (list, tuple, dict):
        return kind(items)
    try:
        if isinstance(container, collections.defaultdict):
            return kind(container.default_factory, items)
        return kind(items)
    except Exception:  # a subclass whose constructor takes other arguments
        fallback = dict if isinstance(container, collections.abc.Mapping) else (
            list if isinstance(container, list) else tuple)
        logger.debug("to_device: rebuilding %s failed; returning a %s", kind.__name__, fallback.__name__)
        return fallback(items)
