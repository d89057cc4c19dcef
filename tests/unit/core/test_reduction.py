"""Cross-worker reduction of metrics (Decisions 6)."""
import math

import pytest

from raysgd.meters import reduce_worker_stats


def test_sample_weighted_mean_and_summed_samples():
    stats = [{"epoch": 1, "num_samples": 300, "batch_count": 75, "loss": 1.0, "last_loss": 0.5},
             {"epoch": 1, "num_samples": 100, "batch_count": 25, "loss": 3.0, "last_loss": 1.5}]
    out = reduce_worker_stats(stats)
    assert out["num_samples"] == 400
    assert out["loss"] == pytest.approx(1.5)          # (300 * 1 + 100 * 3) / 400
    assert out["last_loss"] == pytest.approx(1.0)     # plain mean over workers
    assert out["batch_count"] == pytest.approx(50)    # plain mean over workers
    assert out["epoch"] == 1 and isinstance(out["epoch"], int)
    assert list(out)[0] == "num_samples"


def test_equal_shards_equal_plain_mean():
    out = reduce_worker_stats([{"num_samples": 10, "x": 2.0}, {"num_samples": 10, "x": 4.0}])
    assert out["x"] == pytest.approx(3.0)


def test_nan_and_missing_values_are_left_out():
    out = reduce_worker_stats([{"num_samples": 1, "x": float("nan"), "y": 1.0}, {"num_samples": 1, "x": 2.0}])
    assert out["x"] == pytest.approx(2.0) and out["y"] == pytest.approx(1.0)
    assert math.isnan(reduce_worker_stats([{"x": float("nan")}, {"x": float("nan")}])["x"])


def test_non_numbers_come_from_rank_0_and_no_samples_key_without_samples():
    out = reduce_worker_stats([{"profile": {"a": 1}, "done": 1, "flag": True}, {"profile": {"a": 2}, "done": 1,
                                                                                "flag": False}])
    assert out == {"profile": {"a": 1}, "done": 1, "flag": True}
    assert reduce_worker_stats([]) == {}


def test_a_nan_metric_is_logged_once_per_call_naming_the_ranks(caplog):
    stats = [{"num_samples": 8, "loss": 1.0, "last_loss": 1.0},
             {"num_samples": 8, "loss": float("nan"), "last_loss": float("nan")},
             {"num_samples": 8, "loss": 2.0, "last_loss": 2.0},
             {"num_samples": 8}]  # no batches on this rank: missing, not NaN
    with caplog.at_level("WARNING", logger="raysgd.meters"):
        out = reduce_worker_stats(stats)
    assert out["loss"] == pytest.approx(1.5) and out["num_samples"] == 32  # 1.12's nanmean is kept
    warnings = [r for r in caplog.records if r.name == "raysgd.meters"]
    assert len(warnings) == 1
    assert "loss on rank(s) [1]" in warnings[0].getMessage() and "[3]" not in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="raysgd.meters"):
        reduce_worker_stats([{"num_samples": 8, "loss": 1.0}, {"num_samples": 8, "loss": 3.0}])
    assert not caplog.records


def test_one_element_tensors_and_arrays_are_reduced_as_numbers():
    """A custom train_epoch/validate returning ``total / n`` (a 0-d tensor) or a tensor ``num_samples``."""
    import numpy as np
    import torch

    out = reduce_worker_stats([{"score": torch.tensor(3.0), "num_samples": 4},
                               {"score": torch.tensor(4.0), "num_samples": 4}])
    assert out == {"num_samples": 8, "score": pytest.approx(3.5)} and isinstance(out["score"], float)
    out = reduce_worker_stats([{"score": 3.0, "num_samples": torch.tensor(6)},
                               {"score": 4.0, "num_samples": torch.tensor([2])}])
    assert out == {"score": pytest.approx(3.25), "num_samples": 8} and isinstance(out["num_samples"], int)
    out = reduce_worker_stats([{"score": np.array(3.0), "acc": np.array([0.5]), "num_samples": np.array(4)},
                               {"score": np.array(4.0), "acc": np.array([1.0]), "num_samples": np.array(4)}])
    assert out == {"num_samples": 8, "score": pytest.approx(3.5), "acc": pytest.approx(0.75)}
    same = reduce_worker_stats([{"epoch": torch.tensor(2), "flag": torch.tensor(True)}] * 2)
    assert same == {"epoch": 2, "flag": True} and type(same["epoch"]) is int
    vector = torch.tensor([1.0, 2.0])  # not one number: rank 0's, as any non-number
    assert reduce_worker_stats([{"v": vector}, {"v": torch.tensor([3.0, 4.0])}])["v"] is vector



def test_a_complex_metric_is_not_averaged_but_comes_from_rank_0():
    """A complex value (Python's, numpy's or a 0-d tensor's) is no number to average: rank 0's, as a string's is.
    Before, Python's and numpy's reached the float mean over workers and train() raised TypeError at its end."""
    import numpy as np
    import torch

    from raysgd.meters import AverageMeterCollection

    out = reduce_worker_stats([{"num_samples": 2, "z": 1 + 2j, "loss": 1.0},
                               {"num_samples": 2, "z": 3 + 2j, "loss": 3.0}])
    assert out == {"num_samples": 4, "z": 1 + 2j, "loss": pytest.approx(2.0)}
    meters = AverageMeterCollection()
    for z in (np.complex64(1 + 2j), np.complex64(3 + 2j)):
        meters.update({"z": z, "t": torch.tensor(1j), "loss": np.float32(2.0)})
    summary = meters.summary()
    assert summary["z"] == 3 + 2j and summary["t"] == torch.tensor(1j) and summary["loss"] == 2.0
    assert "last_z" not in summary and "last_loss" in summary  # only the averaged numbers have a last_ value

def test_merge_partial_counts_tensor_samples():
    from raysgd.meters import merge_partial
    import torch

    merged = merge_partial({"num_samples": torch.tensor(30), "loss": torch.tensor(1.0)},
                           {"num_samples": 10, "loss": torch.tensor(3.0)})
    assert merged == {"num_samples": 40, "loss": pytest.approx(1.5)}


def test_a_metric_rank_0_lacks_is_reduced_over_the_ranks_that_report_it():
    """Rank 0 ran no batch (its summary holds only the counts) or reported None: the other ranks' metrics are kept.
    Before, only rank 0's keys were reduced: ``loss`` vanished from the result, or came back None."""
    import numpy as np

    out = reduce_worker_stats([{"num_samples": 0, "batch_count": 0},
                               {"num_samples": 30, "batch_count": 3, "loss": 1.0, "profile": "p1"},
                               {"num_samples": 10, "batch_count": 1, "loss": 3.0, "profile": "p2"}])
    assert out == {"num_samples": 40, "batch_count": pytest.approx(4 / 3), "loss": pytest.approx(1.5),
                   "profile": "p1"}
    out = reduce_worker_stats([{"num_samples": 2, "loss": None}, {"num_samples": 2, "loss": 2.0}])
    assert out == {"num_samples": 4, "loss": pytest.approx(2.0)}
    assert reduce_worker_stats([{"x": None}, {"x": None}]) == {"x": None}
    out = reduce_worker_stats([{"num_samples": np.int64(3), "epoch": np.int64(1)},
                               {"num_samples": np.int64(1), "epoch": np.int64(1)}])
    assert out == {"num_samples": 4, "epoch": 1} and type(out["num_samples"]) is int and type(out["epoch"]) is int


def test_numpy_scalars_come_back_as_python_numbers():
    """A custom loop's ``np.sum(mask)`` as ``num_samples``: the results held np.int64, which json.dumps refuses."""
    import json

    import numpy as np

    from raysgd.meters import AverageMeterCollection

    meters = AverageMeterCollection()
    meters.update({"acc": np.float32(0.5)}, n=np.int64(4))
    meters.update({"acc": np.float32(1.0)}, n=np.int64(4))
    summary = meters.summary()
    assert summary == {"batch_count": 2, "num_samples": 8, "acc": 0.75, "last_acc": 1.0}
    assert type(summary["num_samples"]) is int and type(summary["acc"]) is float
    out = reduce_worker_stats([{"num_samples": np.int64(3), "epoch": np.int64(1), "x": np.int64(2)},
                               {"num_samples": np.int64(3), "epoch": np.int64(1), "x": np.int64(4)}])
    assert out == {"num_samples": 6, "epoch": 1, "x": 3.0}
    assert [type(v) for v in out.values()] == [int, int, float]
    json.dumps([summary, out])
