"""Data sharding: which samples each rank reads, in which order, and how the global batch divides.

Layer 1 (torch, no Ray, no process group): the epoch's order as a function of ``(seed, epoch)``
(:mod:`~raysgd.torch.sharding.epoch_order`), the data cursor that re-shards what is left of an epoch over any
number of ranks (:mod:`~raysgd.torch.sharding.cursor`), the registered loaders rebuilt around it
(:mod:`~raysgd.torch.sharding.loaders`), and the batch size each worker gets at each size
(:mod:`~raysgd.torch.sharding.batch_split`).

Example:
    >>> from raysgd.torch.sharding.cursor import shard_positions
    >>> list(shard_positions(total=10, start=4, rank=1, world_size=2))  # positions 4.. are left: rank 1 of 2
    [5, 7, 9]
"""
