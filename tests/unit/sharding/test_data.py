"""Rebuilding DataLoaders with a shard of their own sampler (raysgd.torch.sharding.loaders), and batches moved to a device."""
import collections
import itertools
import logging
import multiprocessing
import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              SubsetRandomSampler, TensorDataset)

from raysgd.torch.sharding import loaders as data
from raysgd.torch.sharding.cursor import ShardSampler, StreamShardSampler
from raysgd.torch.sharding.epoch_order import draw_stream
from raysgd.utils import DATA_SEED

DATASET = TensorDataset(torch.arange(40))


def indices(loader):
    return [int(i) for batch in loader for i in batch[0]]


def _collate(batch):
    return torch.utils.data.default_collate(batch)


def _init(worker_id):
    pass


def test_every_setting_carries_over():
    generator = torch.Generator().manual_seed(21)
    context = multiprocessing.get_context("spawn")
    loader = DataLoader(DATASET, batch_size=5, sampler=SubsetRandomSampler(range(10)), num_workers=2,
                        collate_fn=_collate, pin_memory=True, drop_last=True, timeout=7, worker_init_fn=_init,
                        multiprocessing_context=context, generator=generator, prefetch_factor=3,
                        persistent_workers=True, pin_memory_device="cpu", in_order=False)
    shard = data.shard_loader(loader, rank=1, world_size=2, training=True)
    for name in ("batch_size", "num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                 "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
                 "pin_memory_device"):
        assert getattr(shard, name) == getattr(loader, name), name
    assert shard.in_order is True  # a training shard reads in the sampler's order: the cursor counts batches by it
    assert shard.prefetch_factor == 3 and shard.generator is generator
    assert data.shard_loader(loader, rank=1, world_size=2, training=False).in_order is False  # no cursor needed
    assert isinstance(shard.sampler, ShardSampler) and shard.sampler.base is loader.sampler
    assert shard.sampler.seed == 21 and shard.sampler.drop_last and shard.sampler.lockstep
    single = data.shard_loader(DataLoader(DATASET, batch_size=4, shuffle=True), 0, 2, training=False)
    assert single.prefetch_factor is None and single.persistent_workers is False
    assert isinstance(single.sampler.base, RandomSampler) and not single.sampler.lockstep


def test_subset_samplers_stay_subsets_and_shards_are_disjoint():
    train_idx, val_idx = list(range(0, 40, 3)), list(range(1, 40, 3))  # 14 and 13 indices
    for idx, training in ((train_idx, True), (val_idx, False)):
        loader = DataLoader(DATASET, batch_size=3, sampler=SubsetRandomSampler(idx))
        read = [indices(data.shard_loader(loader, r, 2, training=training)) for r in range(2)]
        assert not set(read[0]) & set(read[1])
        assert sorted(read[0] + read[1]) == sorted(idx)


def test_the_seed_comes_from_the_config_key_or_the_generator():
    def order(seed=None, **loader_kwargs):
        loader = DataLoader(DATASET, batch_size=40, shuffle=True, **loader_kwargs)
        return indices(data.shard_loader(loader, 0, 1, training=True, seed=seed))

    assert order() == order(seed=0) != order(seed=1)  # the default seed is 0
    assert order(generator=torch.Generator().manual_seed(1)) == order(seed=1)
    assert order(seed=2, generator=torch.Generator().manual_seed(1)) == order(seed=2)  # the config key wins
    assert DATA_SEED == "data_seed"
    with pytest.raises(TypeError, match="data_seed"):
        data.resolve_seed(DataLoader(DATASET), "3")
    assert data.resolve_seed(DataLoader(DATASET), np.int64(3)) == 3  # e.g. from a Tune search space


def test_epochs_reshuffle_and_the_cursor_resumes():
    loader = DataLoader(DATASET, batch_size=4, shuffle=True)
    shard = data.shard_loader(loader, 0, 2, training=True)
    first = indices(shard)
    data.set_sampler_epoch(shard, 1)
    second = indices(shard)
    assert first != second
    assert data.loader_cursor(shard, 2) == 16
    assert data.set_sampler_start(shard, 16)
    assert indices(shard) == second[8:]  # rank 0 continues where 2 batches on each of 2 ranks ended
    stream = draw_stream(loader.sampler, 0, 1)
    assert second == stream[0::2]


def test_a_custom_batch_sampler_is_sharded_by_batches():
    batches = BatchSampler(RandomSampler(range(40)), batch_size=6, drop_last=False)  # 7 batches
    loader = DataLoader(DATASET, batch_sampler=batches)
    shards = [data.shard_loader(loader, r, 2, training=False) for r in range(2)]
    assert isinstance(shards[0].batch_sampler, ShardSampler) and shards[0].batch_sampler.base is batches
    assert [len(s) for s in shards] == [4, 3]
    read = [indices(s) for s in shards]
    assert sorted(read[0] + read[1]) == list(range(40))
    assert data.loader_cursor(shards[0], 2) == 4  # batches, not samples
    lockstep = [data.shard_loader(loader, r, 2, training=True) for r in range(2)]
    assert [len(s) for s in lockstep] == [4, 4]


def test_what_is_not_sharded_passes_through():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    own = DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=0))
    for loader in (range(5), DataLoader(Stream()), own):
        assert data.shard_loader(loader, 0, 2, training=True) is loader
        assert data.loader_cursor(loader, 3) is None and not data.set_sampler_start(loader, 3)
    data.set_sampler_epoch(own, 4)
    assert own.sampler.epoch == 4
    no_batching = data.shard_loader(DataLoader(DATASET, batch_size=None), 1, 2, training=False)
    assert [int(x[0]) for x in no_batching][:3] == [1, 3, 5]


DRAW_LIMIT = 50_000  # far more than a few batches, and than the probe of a sampler with no length


class Endless(Sampler):
    """Endless indices from its own generator and no length, like detectron2's TrainingSampler.

    It fails the test (instead of hanging it) once drawn ``DRAW_LIMIT`` deep: the stream is being materialised.
    """

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for drawn in itertools.count(1):
            if drawn > DRAW_LIMIT:
                raise RuntimeError(f"Endless was drawn {DRAW_LIMIT} indices deep for a few batches")
            yield int(torch.randint(self.size, (1,), generator=generator))


class HugeRandom(RandomSampler):
    """``RandomSampler(replacement=True, num_samples=10**9)``, failing the test once drawn ``DRAW_LIMIT`` deep."""

    def __init__(self, dataset):
        super().__init__(dataset, replacement=True, num_samples=10**9)

    def __iter__(self):
        for drawn, index in enumerate(super().__iter__(), 1):
            if drawn > DRAW_LIMIT:
                raise RuntimeError(f"HugeRandom was drawn {DRAW_LIMIT} indices deep for a few batches")
            yield index


class FiniteNoLength(Sampler):
    """A finite user sampler with no ``__len__``: it keeps the data cursor."""

    def __iter__(self):
        return iter(range(39, -1, -2))


@pytest.mark.parametrize("training", [True, False], ids=["train", "validate"])
@pytest.mark.parametrize("make", [lambda: Endless(40), lambda: HugeRandom(DATASET)], ids=["endless", "huge"])
def test_an_endless_or_huge_sampler_is_sharded_lazily_without_a_cursor(make, training):
    def first(loader, batches):
        return [int(i) for batch in itertools.islice(loader, batches) for i in batch[0]]

    one = data.shard_loader(DataLoader(DATASET, batch_size=4, sampler=make()), 0, 1, training=training)
    stream = first(one, 6)  # one worker reads the sampler's own (seeded) stream
    assert len(stream) == 24
    ranks = [data.shard_loader(DataLoader(DATASET, batch_size=4, sampler=make()), r, 2, training=training)
             for r in range(2)]
    assert [first(shard, 3) for shard in ranks] == [stream[0::2], stream[1::2]]  # every second position
    before = torch.get_rng_state()
    assert list(itertools.islice(ranks[1].sampler, 12)) == stream[1::2]
    assert torch.equal(before, torch.get_rng_state())  # drawing the shard leaves the process's stream alone
    for shard in (one, *ranks):  # no data cursor: commits inside such an epoch are skipped
        assert data.loader_cursor(shard, 1) is None and not data.set_sampler_start(shard, 4)
    data.set_sampler_epoch(one, 1)
    assert len(first(one, 6)) == 24


def test_a_finite_sampler_without_a_length_keeps_the_cursor():
    shards = [data.shard_loader(DataLoader(DATASET, batch_size=4, sampler=FiniteNoLength()), r, 2, training=True)
              for r in range(2)]
    assert sorted(indices(shards[0]) + indices(shards[1])) == list(range(1, 40, 2))
    assert data.loader_cursor(shards[0], 1) == 8 and data.set_sampler_start(shards[1], 8)
    assert indices(shards[1]) == [21, 17, 13, 9, 5, 1]  # positions 9, 11, ..., 19 of 39, 37, ..., 1


class OwnRandom(Sampler):
    """Shuffles with a random object of its own, made in ``__init__`` (``random.Random`` or numpy's ``default_rng``):
    every draw is another order, whatever raysgd seeds, and a restarted process draws the first order again."""

    def __init__(self, n, kind):
        self.n, self.kind = n, kind
        self.rng = random.Random(0) if kind == "random" else np.random.default_rng(0)

    def __iter__(self):
        if self.kind == "random":
            return iter(self.rng.sample(range(self.n), self.n))
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self):
        return self.n


@pytest.mark.parametrize("kind", ["random", "numpy"])
def test_a_sampler_whose_draws_do_not_repeat_has_no_cursor_and_is_sharded_lazily(kind, caplog):
    """Such a sampler's epoch cannot be replayed: a resume at a cursor would read the rest of another order (some
    samples twice, others never). It is read lazily, once per pass, with no cursor (so no commit inside its
    epochs); a sampler that draws from a `generator` raysgd seeds keeps its cursor."""
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.sharding.loaders"):
        shards = [data.shard_loader(DataLoader(DATASET, batch_size=4, sampler=OwnRandom(40, kind)), r, 2,
                                    training=True) for r in range(2)]  # as two worker processes would
    assert "draws another order each time" in caplog.text
    assert all(isinstance(shard.sampler, StreamShardSampler) for shard in shards)
    assert data.loader_cursor(shards[0], 1) is None and not data.set_sampler_start(shards[0], 8)
    read = [indices(shard) for shard in shards]
    assert sorted(read[0] + read[1]) == list(range(40))  # one pass each: the shards still split one order
    seeded = DataLoader(DATASET, batch_size=4, sampler=RandomSampler(DATASET, generator=torch.Generator()))
    assert data.loader_cursor(data.shard_loader(seeded, 0, 2, training=True), 1) == 8


class SlowFirst(torch.utils.data.Dataset):
    """``range(40)``; index 0 takes a moment to load, so the loader's second process finishes its batch first."""

    def __len__(self):
        return 40

    def __getitem__(self, index):
        if index == 0:
            time.sleep(0.5)
        return index


def test_a_training_shard_reads_its_batches_in_the_samplers_order():
    """``DataLoader(num_workers=2, in_order=False)`` hands out batches as its processes finish them, so its first k
    batches need not be the first k of the shard: the cursor, which counts batches, would name the wrong samples.
    A training shard reads in order (validation, with no cursor, keeps in_order=False)."""
    # Its processes start by forkserver (why: tests/conftest.py); a forked one here once hung until pytest's 600 s
    # timeout. A stuck one now fails within the loader's own timeout, as tests/helpers.py's loaders do.
    loader = DataLoader(SlowFirst(), batch_size=2, num_workers=2, in_order=False, multiprocessing_context="forkserver",
                        timeout=120)
    shard = data.shard_loader(loader, 0, 2, training=True)
    assert shard.in_order is True
    got = [int(i) for batch in itertools.islice(iter(shard), 3) for i in batch]
    assert got == list(shard.sampler.positions())[:6] == [0, 2, 4, 6, 8, 10]  # the first 3 batches, in order
    assert data.shard_loader(loader, 0, 2, training=False).in_order is False


@pytest.mark.parametrize("shuffle", [False, True])
def test_validation_drop_last_drops_one_processs_partial_batch(shuffle):
    loader = DataLoader(TensorDataset(torch.arange(10)), batch_size=4, drop_last=True, shuffle=shuffle)
    kept = sorted(draw_stream(loader.sampler, 0, 0)[:8])  # what one process validates
    for world_size in (1, 2, 3, 4):
        shards = [data.shard_loader(loader, r, world_size, training=False) for r in range(world_size)]
        assert sorted(itertools.chain(*map(indices, shards))) == kept, world_size
        assert not any(shard.drop_last for shard in shards)
    training = [data.shard_loader(loader, r, 3, training=True) for r in range(3)]  # lockstep: unchanged
    assert [len(indices(shard)) for shard in training] == [0, 0, 0] and training[0].drop_last


Pair = collections.namedtuple("Pair", "features target")


class Batch(list):
    pass


def test_to_device_keeps_container_types():
    batch = Pair(torch.zeros(2), {"a": (torch.ones(1), Batch([torch.ones(1)]))})
    moved = data.to_device(batch, "cpu")
    assert type(moved) is Pair and type(moved.target["a"][1]) is Batch
    ordered = data.to_device(collections.OrderedDict(x=torch.ones(1)), torch.device("cpu"))
    assert type(ordered) is collections.OrderedDict
    default = data.to_device(collections.defaultdict(list, x=[torch.ones(1)]), "cpu")
    assert type(default) is collections.defaultdict and default.default_factory is list
    assert data.to_device(batch, None) is batch


def test_a_batch_sampler_over_a_distributed_sampler_is_not_sharded_again():
    """A custom batch_sampler over the user's own DistributedSampler is theirs already: sharding it again read a
    W-th of each rank's batches (and padded), so samples were never trained."""
    def loader(rank):
        own = DistributedSampler(DATASET, num_replicas=2, rank=rank, shuffle=True, seed=1)
        return DataLoader(DATASET, batch_sampler=BatchSampler(own, 4, drop_last=False))

    loaders = [loader(r) for r in range(2)]
    shards = [data.shard_loader(loaders[r], r, 2, training=True) for r in range(2)]
    assert shards[0] is loaders[0] and data.loader_cursor(shards[0], 1) is None
    read = [int(i) for shard in shards for batch in shard for i in batch[0]]
    assert sorted(read) == list(range(len(DATASET)))
    first = [batch[0].tolist() for batch in shards[0]]
    data.set_sampler_epoch(shards[0], 1)  # reaches the DistributedSampler under the batch sampler
    assert shards[0].batch_sampler.sampler.epoch == 1 and [batch[0].tolist() for batch in shards[0]] != first


def test_a_distributed_sampler_built_for_another_world_is_used_but_warned_about(caplog):
    """A DistributedSampler made with num_replicas=4 on 2 workers reads half the data, silently; now it warns."""
    loader = DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=4, rank=1))
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.sharding.loaders"):
        assert data.shard_loader(loader, 1, 2, training=True) is loader
    assert "reads shard 1 of 4, but this worker is rank 1 of 2" in caplog.text
    caplog.clear()
    matching = DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=1))
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.sharding.loaders"):
        assert data.shard_loader(matching, 1, 2, training=True) is matching
    assert not caplog.text
