"""``DatasetInput``'s argument checks, over a stand-in ``ray.data.Dataset`` (no Ray: nothing is read)."""
import numpy as np
import pytest
import torch

ray_data = pytest.importorskip("ray.data")

from raysgd.torch.integrations.ray_data import DatasetInput  # noqa: E402 (after the skip)


class _StandIn(ray_data.Dataset):
    """Passes ``isinstance(ds, ray.data.Dataset)``; never iterated here."""

    def __init__(self, columns=None):  # noqa: D107 (no plan, no executor: nothing to read)
        self._known = columns

    def columns(self, fetch_if_missing=True):
        assert not fetch_if_missing, "DatasetInput must not run the dataset to learn its columns"
        return self._known

    def __del__(self):
        pass


@pytest.fixture
def ds():
    return _StandIn()


@pytest.mark.parametrize("options, named", [
    (dict(drop_last="no"), "drop_last"),
    (dict(prefetch_batches=-1), "prefetch_batches"),
    (dict(prefetch_batches=1.5), "prefetch_batches"),
    (dict(local_shuffle_buffer_size=0), "local_shuffle_buffer_size"),
    (dict(dtypes="float32"), "dtypes"),
    (dict(dtypes={"x": np.float32}), "dtypes"),
    (dict(repeat="no"), "repeat"),
])
def test_bad_batch_options_are_refused_up_front(ds, options, named):
    with pytest.raises((TypeError, ValueError), match=rf"DatasetInput\({named}=\.\.\.\) expects"):
        DatasetInput(ds, label_column="y", **options)


def test_good_batch_options_reach_ray_data_as_plain_values(ds):
    data = DatasetInput(ds, label_column="y", drop_last=np.True_, prefetch_batches=np.int64(0),
                        local_shuffle_buffer_size=np.int32(64), dtypes={"x": torch.float64}, repeat=True)
    assert data.iter_options == dict(dtypes={"x": torch.float64}, drop_last=True, prefetch_batches=0,
                                     local_shuffle_buffer_size=64)
    assert type(data.iter_options["prefetch_batches"]) is int and data.repeat is True
    assert DatasetInput(ds, dtypes=torch.float16).iter_options["dtypes"] is torch.float16


def test_feature_columns_holding_the_label_are_refused(ds):
    with pytest.raises(ValueError, match=r"feature_columns=\.\.\.\) expects columns apart from the label column 'y'"):
        DatasetInput(ds, label_column="y", feature_columns=["x", "y"])
    with pytest.raises(ValueError, match=r"feature_columns=\.\.\.\) expects at least one column"):
        DatasetInput(ds, label_column="y", feature_columns=[])


class _Split:
    """A stand-in streaming split: ``iter_torch_batches`` yields the given batches, recording its options."""

    def __init__(self, *batches):
        self.batches, self.options = batches, None

    def iter_torch_batches(self, **options):
        self.options = options
        return iter(self.batches)


def _batches(data, *batches):
    from raysgd.torch.integrations.ray_data import Shard  # noqa: PLC0415

    split = _Split(*batches)
    return list(Shard(split, 4, data, timeout_s=10)), split.options


def test_float64_columns_that_dtypes_does_not_name_arrive_as_float32(ds):
    batch = {"x": torch.zeros(4, dtype=torch.float64), "z": torch.zeros(4, 2, dtype=torch.float64),
             "y": torch.tensor([0, 1, 2, 3])}
    data = DatasetInput(ds, label_column="y", dtypes={"y": torch.int64})
    [(x, z, y)], options = _batches(data, batch)
    assert (x.dtype, x.shape, z.dtype, z.shape, y.dtype, y.shape) == (
        torch.float32, (4, 1), torch.float32, (4, 2), torch.int64, (4,))
    assert options["dtypes"] == {"y": torch.int64} and options["batch_size"] == 4
    named = DatasetInput(ds, label_column="y", dtypes={"x": torch.float64}, label_shape=(1,))
    [(x, z, y)], _ = _batches(named, batch)
    assert (x.dtype, z.dtype, y.shape) == (torch.float64, torch.float32, (4, 1))


def test_columns_the_dataset_lacks_are_named_up_front_when_its_schema_is_known():
    known = _StandIn(columns=["x", "z", "y"])
    with pytest.raises(ValueError, match=r"names column\(s\) \['label'\] that the dataset lacks; its columns are "
                                         r"\['x', 'z', 'y'\]"):
        DatasetInput(known, label_column="label")
    with pytest.raises(ValueError, match=r"\['w'\] that the dataset lacks"):
        DatasetInput(known, label_column="y", feature_columns=["x", "w"])
    assert DatasetInput(known, label_column="y", feature_columns=["z"]).feature_columns == ["z"]
    assert DatasetInput(known).label_column is None  # dict batches: every column, none named
    assert DatasetInput(_StandIn(), label_column="label").label_column == "label"  # unknown (map_batches): workers
