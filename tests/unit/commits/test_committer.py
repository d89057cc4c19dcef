"""A worker's commit bookkeeping in one process (raysgd.torch.commits.committer): where a loaded cursor starts the
epoch. No Ray: the loaders are sharded as each rank's are."""
import logging

import pytest
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from raysgd.torch.commits.committer import Committer
from raysgd.torch.sharding.cursor import DataCursor
from raysgd.torch.sharding.loaders import cursor_positions, loader_cursor, set_sampler_epoch, shard_loader

SAMPLES = list(range(48))


def batch_sampled(batch_size, world_size, rank):
    """Rank ``rank``'s shard of a loader whose custom batch_sampler takes ``batch_size`` (config[BATCH_SIZE] split
    over ``world_size`` workers, as a user's setup builds it), in epoch 1."""
    loader = shard_loader(DataLoader(SAMPLES, batch_sampler=BatchSampler(RandomSampler(SAMPLES), batch_size, False)),
                          rank, world_size, training=True)
    set_sampler_epoch(loader, 1)
    return loader


def resumed(cursor, loader, rank=0):
    committer = Committer()
    committer.load(cursor, None, rank=rank)
    committer.begin_epoch(loader)
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("before, after", [((2, 4), (1, 8)), ((1, 8), (2, 4)), ((2, 4), (4, 2))])
def test_a_custom_batch_samplers_cursor_resumes_exactly_when_the_batch_size_follows_the_workers(before, after, caplog):
    """Its cursor counts batches: after a resize from 2 workers (batches of 4) to 1 (batches of 8) it started 4
    batches of 8 in, so the epoch skipped 16 samples, silently. It now starts at the same share of the epoch."""
    (world, size), (new_world, new_size) = before, after
    shards = [batch_sampled(size, world, rank) for rank in range(world)]
    taken = []
    for shard in shards:
        batches = iter(shard)
        taken += [int(i) for _ in range(2) for i in next(batches)]  # every rank took 2 batches, then the failure
    cursor = DataCursor(1, loader_cursor(shards[0], 2), 2, positions=cursor_positions(shards[0])).state_dict()
    with caplog.at_level(logging.WARNING, logger="raysgd"):
        rest = [i for rank in range(new_world) for i in resumed(cursor, batch_sampled(new_size, new_world, rank), rank)]
    assert sorted(taken + rest) == SAMPLES  # every sample once in the epoch
    warned = [r.getMessage() for r in caplog.records if "another length" in r.getMessage()]
    assert len(warned) == 1 and "fixed_worker_batch=True" in warned[0], warned  # rank 0 only


def test_a_cursor_of_the_same_stream_or_without_its_length_starts_where_it_was(caplog):
    shard = batch_sampled(4, 1, 0)
    with caplog.at_level(logging.WARNING, logger="raysgd"):
        assert len(resumed(DataCursor(1, 3, 3, positions=12).state_dict(), shard)) == 36
        older = DataCursor(1, 3, 3).state_dict()  # taken before cursors kept their length: as it was
        assert len(resumed(older, batch_sampled(8, 1, 0))) == 24
    assert not caplog.records
