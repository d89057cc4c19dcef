"""Sharding registered DataLoaders across workers: a shuffling train sampler, exact validation shards.

Layer 1: imports torch only.

Example:
    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> loader = DataLoader(TensorDataset(torch.arange(5.)), batch_size=2)
    >>> shard = shard_loader(loader, rank=1, world_size=2, training=False)
    >>> [b[0].tolist() for b in shard]
    [[1.0, 3.0]]
"""
import logging

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

logger = logging.getLogger(__name__)

# DataLoader settings carried over when a loader is rebuilt with a distributed sampler.
_COPIED = ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
           "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device")


class ExactShardSampler(Sampler):
    """Indices ``rank, rank + world_size, ...``: every sample lands on exactly one worker, none twice.

    Used for validation so that metrics over N workers equal those of one process.
    """

    def __init__(self, dataset, rank, world_size):
        self._indices = range(rank, len(dataset), world_size)

    def __iter__(self):
        return iter(self._indices)

    def __len__(self):
        return len(self._indices)


def shard_loader(loader, rank, world_size, training):
    """Rebuild ``loader`` so that this rank reads only its shard; loaders that cannot be sharded pass through.

    Training uses ``DistributedSampler`` (shuffled when the original loader shuffled; call
    ``set_epoch`` every epoch); validation uses :class:`ExactShardSampler`.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if loader.batch_size is None:
        logger.warning("DataLoader with a custom batch_sampler is not sharded: every worker reads all of it.")
        return loader
    if training:
        sampler = DistributedSampler(loader.dataset, num_replicas=world_size, rank=rank,
                                     shuffle=isinstance(loader.sampler, RandomSampler), seed=0)
    else:
        sampler = ExactShardSampler(loader.dataset, rank, world_size)
    kwargs = {name: getattr(loader, name) for name in _COPIED if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    else:
        kwargs.pop("persistent_workers", None)
    return DataLoader(loader.dataset, sampler=sampler, shuffle=False, **kwargs)


def set_sampler_epoch(loader, epoch):
    """Call ``loader.sampler.set_epoch(epoch)`` when the sampler has it (DistributedSampler)."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def to_device(batch, device, non_blocking=True):
    """Move every tensor in a (nested) batch to ``device``; other objects pass through."""
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(item, device, non_blocking) for item in batch]
        return type(batch)(moved) if isinstance(batch, list) else tuple(moved)
    if isinstance(batch, dict):
        return {key: to_device(value, device, non_blocking) for key, value in batch.items()}
    return batch
