"""raysgd.data.Dataset's shards read in the driver (``get_shard``), over a stand-in for its Ray Data dataset: no Ray."""
import itertools

import numpy as np
import pytest
import torch

from raysgd.data import Dataset


class Rows:
    """What ``get_shard`` reads of a Ray Data dataset: ``iter_rows()``."""

    def __init__(self, count):
        self.rows = [{"x": np.array([float(i)]), "y": np.array([0.0])} for i in range(count)]

    def iter_rows(self):
        return iter(self.rows)


def dataset(count, num_shards, batch_size=2):
    ds = Dataset([(torch.ones(1), torch.zeros(1))] * count, batch_size=batch_size)
    ds._ray_dataset = Rows(count)  # the stand-in: ray_dataset() builds it on first use
    ds.set_num_shards(num_shards)
    return ds


def test_a_shard_repeats_its_items_in_batches():
    batches = list(itertools.islice(dataset(5, 2).get_shard(np.int64(1)), 3))
    assert [[float(x) for x, _ in batch] for batch in batches] == [[1.0, 3.0], [1.0, 3.0], [1.0, 3.0]]


def test_a_shard_with_no_item_ends_instead_of_hanging():
    """More shards than items: shard 3 of 4 over 3 items held nothing, and next() on it never returned."""
    assert list(itertools.islice(dataset(3, 4).get_shard(3), 2)) == []


def test_a_shard_index_out_of_range_or_a_bad_count_is_refused_at_once():
    ds = dataset(3, 2)
    with pytest.raises(IndexError, match="shard 2 of 2"):
        ds.get_shard(2)  # at the call, not at the first next()
    with pytest.raises(ValueError, match="set_num_shards"):
        ds.set_num_shards(True)
