"""The data cursor (raysgd.torch.sharding.cursor) without Ray: shards, the tail in lockstep, the cursor, seeded streams."""
import collections
import itertools
import random

import numpy as np
import pytest
import torch
from torch.utils.data import (BatchSampler, RandomSampler, Sampler, SequentialSampler, SubsetRandomSampler,
                              WeightedRandomSampler)

from raysgd.torch.sharding import cursor, epoch_order
from raysgd.torch.sharding.cursor import ShardSampler, shard_positions
from raysgd.torch.sharding.epoch_order import draw_stream, epoch_seed


class EveryThird(Sampler):
    """A user sampler with no generator and no length: it shuffles with the global streams."""

    def __iter__(self):
        order = list(range(0, 31, 3))
        random.shuffle(order)
        return iter([order[i] for i in torch.randperm(len(order)).tolist()])


def samplers():
    return {
        "subset": SubsetRandomSampler(list(range(3, 40, 2))),
        "weighted": WeightedRandomSampler([1.0] * 10 + [5.0] * 7, num_samples=23, replacement=True),
        "random_replacement": RandomSampler(range(17), replacement=True, num_samples=29),
        "random_num_samples": RandomSampler(range(17), num_samples=11),
        "random": RandomSampler(range(17)),
        "sequential": SequentialSampler(range(17)),
        "user": EveryThird(),
    }


def shards(base, world_size, **kwargs):
    return [ShardSampler(base, rank, world_size, **kwargs) for rank in range(world_size)]


@pytest.mark.parametrize("name", sorted(samplers()))
def test_two_ranks_together_read_the_samplers_stream_exactly_once(name):
    base = samplers()[name]
    for lockstep, batch_size in ((False, 1), (True, 4)):
        ranks = shards(base, 2, seed=3, batch_size=batch_size, lockstep=lockstep)
        stream = draw_stream(base, 3, 0)
        assert len(stream) % 2 == 1  # a size that does not divide among the ranks
        read = [list(shard) for shard in ranks]
        tail = len(stream) % (2 * batch_size)
        padded = 2 - tail if lockstep and 0 < tail < 2 else 0  # one rank short of a last batch: one re-read
        assert read[0] == stream[0::2] and read[1] == stream[1::2] + stream[:padded]  # every second position
        assert collections.Counter(read[0] + read[1]) == collections.Counter(stream + stream[:padded])
        if lockstep:
            assert len({-(-len(r) // batch_size) for r in read}) == 1  # the same batch count: DDP's lockstep


def test_the_stream_is_a_function_of_seed_and_epoch_and_leaves_global_streams_alone():
    base = RandomSampler(range(50))
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    first = draw_stream(base, seed=0, epoch=0)
    assert torch.equal(states[0], torch.get_rng_state()) and states[1] == random.getstate()
    assert np.array_equal(states[2], np.random.get_state()[1])
    torch.manual_seed(99)  # the global seed does not matter
    assert draw_stream(RandomSampler(range(50)), seed=0, epoch=0) == first
    assert draw_stream(base, seed=0, epoch=1) != first
    assert draw_stream(base, seed=1, epoch=0) != first
    assert sorted(first) == list(range(50))
    assert epoch_seed(0, 1) != epoch_seed(1, 0)
    own = torch.Generator().manual_seed(5)
    with_generator = RandomSampler(range(50), generator=own)
    before = own.get_state()
    draw_stream(with_generator, seed=0, epoch=0)
    assert torch.equal(before, own.get_state()) and with_generator.generator is own  # put back untouched
    user = EveryThird()  # global streams inside the draw are seeded, then restored
    assert draw_stream(user, 4, 2) == draw_stream(user, 4, 2)


def test_iterating_shards_leaves_the_global_streams_alone():
    before = torch.get_rng_state()
    for shard in shards(SubsetRandomSampler(list(range(20))), 2, lockstep=True, batch_size=3):
        list(shard)
    assert torch.equal(before, torch.get_rng_state())
    list(SubsetRandomSampler(list(range(20))))  # what the unsharded sampler would have done
    assert not torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("drop_last", [False, True])
def test_lockstep_shards_over_every_size(drop_last):
    for total, world_size, batch_size in itertools.product(range(0, 26), range(1, 5), range(1, 5)):
        for start in range(0, total + 1, 3):
            read = [list(shard_positions(total, start, r, world_size, batch_size=batch_size, drop_last=drop_last,
                                         lockstep=True)) for r in range(world_size)]
            batches = {-(-len(r) // batch_size) if not drop_last else len(r) // batch_size for r in read}
            assert len(batches) == 1, (total, start, world_size, batch_size, read)
            flat = sorted(itertools.chain(*read))
            left, per_round = total - start, world_size * batch_size
            tail = left % per_round
            if drop_last:
                assert flat == list(range(start, start + left - tail))
                assert all(len(r) % batch_size == 0 for r in read)
            elif tail == 0 or tail >= world_size:
                assert flat == list(range(start, total))  # exactly once
            else:  # the only padded case: W - t positions twice
                assert sorted(set(flat)) == list(range(start, total))
                assert len(flat) - left == world_size - tail


def test_exact_shards_are_unpadded():
    for total, world_size, start in itertools.product(range(0, 12), range(1, 5), range(0, 4)):
        if start > total:
            continue
        read = [list(shard_positions(total, start, r, world_size)) for r in range(world_size)]
        assert sorted(itertools.chain(*read)) == list(range(start, total))
        assert max(map(len, read)) - min(map(len, read)) <= 1


def test_exact_shards_with_drop_last_keep_one_processs_full_batches():
    for total, world_size, start, batch_size in itertools.product(range(0, 14), range(1, 5), range(0, 4), range(1, 5)):
        if start > total:
            continue
        read = [list(shard_positions(total, start, r, world_size, batch_size=batch_size, drop_last=True))
                for r in range(world_size)]
        kept = start + (total - start) // batch_size * batch_size  # one process drops only its partial batch
        assert sorted(itertools.chain(*read)) == list(range(start, kept)), (total, world_size, start, batch_size)
        assert max(map(len, read)) - min(map(len, read)) <= 1


class Endless(Sampler):
    def __iter__(self):
        return itertools.count()


def test_a_stream_longer_than_the_limit_is_refused_not_drawn_forever():
    with pytest.raises(ValueError, match="more than 100 positions"):
        draw_stream(Endless(), 0, 0, limit=100)
    assert draw_stream(SequentialSampler(range(100)), 0, 0, limit=100) == list(range(100))


def test_lazy_shards_of_a_sized_stream_read_what_exact_shards_read():
    for total, world_size, batch_size in itertools.product(range(0, 14), range(1, 5), range(1, 4)):
        for drop_last, lockstep in itertools.product((False, True), repeat=2):
            base = SubsetRandomSampler(list(range(total)))
            kwargs = {"seed": 5, "batch_size": batch_size, "drop_last": drop_last, "lockstep": lockstep}
            exact = [list(shard) for shard in shards(base, world_size, **kwargs)]
            lazy = [cursor.StreamShardSampler(base, r, world_size, **kwargs) for r in range(world_size)]
            assert [list(shard) for shard in lazy] == exact, (total, world_size, batch_size, drop_last, lockstep)
            assert [len(shard) for shard in lazy] == [len(r) for r in exact]
    endless = [cursor.StreamShardSampler(Endless(), r, 3, lockstep=True) for r in range(3)]
    assert [list(itertools.islice(shard, 4)) for shard in endless] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    with pytest.raises(TypeError, match="no length"):
        len(endless[0])


def test_a_cursor_reshards_what_is_left_over_a_new_world_size():
    base = SubsetRandomSampler(list(range(100, 157)))  # 57 indices
    stream = draw_stream(base, 11, 4)
    before = shards(base, 2, seed=11, batch_size=4, lockstep=True)
    consumed = []
    for shard in before:
        shard.set_epoch(4)
        consumed += list(shard)[:3 * 4]  # 3 batches on each rank, then a failure
    cursor = before[0].position_after(3)
    assert cursor == 3 * 4 * 2 and before[1].position_after(3, batch_size=4) == cursor
    assert sorted(consumed) == sorted(stream[:cursor])
    after = shards(base, 3, seed=11, batch_size=4, lockstep=True)
    rest = []
    for shard in after:
        shard.set_epoch(4)
        shard.set_start(cursor)
        assert shard.total == 57 and shard.start == cursor
        rest += list(shard)
    assert sorted(consumed + rest) == sorted(stream)  # 33 left, 3 ranks, tail 9 >= 3: exactly once
    assert after[0].position_after(3) == 57  # capped at the end
    assert after[0].start == cursor


def test_start_applies_to_one_pass_and_epochs_reset_it():
    shard = ShardSampler(SequentialSampler(range(10)), 0, 2, batch_size=1)
    shard.set_start(6)
    shard.set_epoch(1)  # a pinned start survives set_epoch
    assert shard.start == 6 and len(shard) == 2 and list(shard) == [6, 8]
    assert list(shard) == [0, 2, 4, 6, 8] and shard.start == 0
    shard.set_start(4)
    list(shard)
    shard.set_epoch(2)
    assert shard.start == 0 and shard.epoch == 2
    shard.set_start(11)
    with pytest.raises(ValueError, match="past the end"):
        list(shard)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="set_start"):
            shard.set_start(bad)
    with pytest.raises(ValueError, match="set_epoch"):
        shard.set_epoch(-1)


def test_a_batch_sampler_is_sharded_by_batches():
    base = BatchSampler(RandomSampler(range(23)), batch_size=4, drop_last=False)  # 6 batches
    ranks = shards(base, 4, seed=2, batch_size=1, lockstep=True)
    read = [list(shard) for shard in ranks]
    stream = draw_stream(base, 2, 0)
    assert len(stream) == 6 and all(len(r) == 2 for r in read)  # lockstep: 6 % 4 = 2 < 4 pads two ranks
    assert sorted(map(tuple, itertools.chain(*read))) == sorted(map(tuple, stream + stream[:2]))
    exact = [list(shard) for shard in shards(base, 4, seed=2, batch_size=1)]
    assert sorted(map(tuple, itertools.chain(*exact))) == sorted(map(tuple, stream))
    assert ranks[0].position_after(1) == 4  # the cursor counts batches


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(SequentialSampler(range(3)), 2, 2)
    with pytest.raises(TypeError, match="seed"):
        ShardSampler(SequentialSampler(range(3)), 0, 2, seed="x")
    with pytest.raises(ValueError, match="start"):
        shard_positions(3, 4, 0, 1)
    with pytest.raises(TypeError, match="total"):
        shard_positions(3.0, 0, 0, 1)


class OwnGenerator(Sampler):
    """Shuffles with a ``random.Random`` made in ``__init__``: raysgd cannot seed it."""

    def __init__(self):
        self.rng = random.Random(4)

    def __iter__(self):
        return iter(self.rng.sample(range(9), 9))

    def __len__(self):
        return 9


class NumpyOwn(OwnGenerator):
    def __init__(self):
        self.rng = np.random.default_rng(4)

    def __iter__(self):
        return iter(self.rng.permutation(9).tolist())


class NumpyOwnNamedGenerator(OwnGenerator):
    """Its own numpy random object in an attribute named ``generator`` (where torch's samplers keep theirs)."""

    def __init__(self):
        self.generator = np.random.default_rng(4)

    def __iter__(self):
        return iter(self.generator.permutation(9).tolist())


@pytest.mark.parametrize("name", sorted(samplers()))
def test_samplers_raysgd_can_seed_draw_the_same_stream_twice(name):
    base = samplers()[name]
    assert epoch_order.draws_repeat(base, seed=3, epoch=1)
    assert epoch_order.draws_repeat(BatchSampler(base, batch_size=4, drop_last=False), seed=3)  # lists of indices


@pytest.mark.parametrize("make", [OwnGenerator, NumpyOwn, NumpyOwnNamedGenerator],
                         ids=["random.Random", "numpy-default_rng", "numpy-default_rng-as-generator"])
def test_a_sampler_with_a_random_object_of_its_own_does_not_repeat(make):
    """A numpy Generator in ``generator`` is the sampler's own: it was replaced by a torch one while drawing, and the
    sampler raised AttributeError ('Generator' object has no attribute 'permutation')."""
    base = make()
    assert sorted(draw_stream(base, 3, 0)) == list(range(9)) and isinstance(getattr(base, "generator", None),
                                                                           (type(None), np.random.Generator))
    assert not epoch_order.draws_repeat(base, seed=3)
    assert draw_stream(make(), 3, 0) != draw_stream(base, 3, 0)  # why: a fresh process draws another order
    with pytest.raises(epoch_order.StreamTooLong):
        epoch_order.draws_repeat(Endless(), 0, limit=50)


def test_numpy_ints_are_ints_and_the_cursor_keeps_plain_ones():
    """An epoch from ``np.arange`` (``for epoch in np.arange(3): loader.sampler.set_epoch(epoch)``), a cursor or a seed
    read back as numpy's int is taken like Python's, and kept as a plain int (it goes into JSON markers)."""
    shard = ShardSampler(RandomSampler(range(10)), np.int64(1), np.int64(2), seed=np.int64(3), batch_size=np.int64(2))
    plain = ShardSampler(RandomSampler(range(10)), 1, 2, seed=3, batch_size=2)
    for sampler, epoch in ((shard, np.int64(4)), (plain, 4)):
        sampler.set_epoch(epoch)
        sampler.set_start(np.int32(2))
    assert list(shard) == list(plain) and type(shard.epoch) is int and type(shard.start) is int
    assert shard.position_after(np.int64(1)) == 6 and type(shard.position_after(np.int64(1))) is int
    lazy = cursor.StreamShardSampler(SequentialSampler(range(6)), 0, 2)
    lazy.set_epoch(np.uint8(1))
    assert type(lazy.epoch) is int and list(lazy) == [0, 2, 4]
    state = cursor.DataCursor(np.int64(2), np.int64(16), np.int32(2)).state_dict()
    assert state == {"epoch": 2, "consumed": 16, "steps": 2, "call_steps": 0}
    assert all(type(value) is int for value in state.values())
    assert shard_positions(np.int64(5), np.int64(0), np.int64(1), np.int64(2), batch_size=np.int64(1),
                           lockstep=True) == [1, 3, 0]
    with pytest.raises(ValueError, match="set_epoch"):
        shard.set_epoch(np.int64(-1))
    with pytest.raises(ValueError, match="set_epoch"):
        shard.set_epoch(True)
