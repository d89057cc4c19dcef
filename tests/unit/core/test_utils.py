"""raysgd.utils: meters, timers, override, constants (no Ray)."""
import math
import time

import pytest

from raysgd.utils import (BATCH_COUNT, BATCH_SIZE, NUM_SAMPLES, AverageMeter, AverageMeterCollection, TimerCollection,
                          TimerStat, override)


def test_constants_match_1x():
    assert (BATCH_COUNT, NUM_SAMPLES, BATCH_SIZE) == ("batch_count", "num_samples", "*batch_size")


def test_average_meter_weighted():
    meter = AverageMeter()
    meter.update(1.0, n=3)
    meter.update(5.0, n=1)
    assert meter.avg == pytest.approx(2.0)
    assert meter.val == 5.0 and meter.count == 4 and meter.sum == pytest.approx(8.0)
    meter.reset()
    assert meter.count == 0


def test_meter_collection_summary_matches_1x_example():
    meters = AverageMeterCollection()
    meters.update({"loss": 0.5}, n=32)
    meters.update({"loss": 0.1}, n=32)
    assert meters.summary() == {"batch_count": 2, "num_samples": 64, "loss": pytest.approx(0.3), "last_loss": 0.1}


def test_meter_collection_nan_poisons_mean_not_last():
    meters = AverageMeterCollection()
    meters.update({"x": float("nan")})
    meters.update({"x": 1.0})
    summary = meters.summary()
    assert math.isnan(summary["x"]) and summary["last_x"] == 1.0


def test_timer_stat_records_and_is_not_reentrant():
    timer = TimerStat(window_size=2)
    for _ in range(3):
        with timer:
            time.sleep(0.001)
    assert timer.count == 3 and timer.size == 2
    assert timer.mean >= 0.001
    with pytest.raises(RuntimeError):
        with timer:
            with timer:
                pass


def test_timer_collection_disabled_records_nothing():
    timers = TimerCollection()
    timers.disable()
    with timers.record("fwd"):
        pass
    assert timers.stats() == {}
    timers.enable()
    with timers.record("fwd"):
        pass
    assert set(timers.stats(mean=True, last=True)) == {"mean_fwd_s", "last_fwd_s"}
    timers.reset()
    assert timers.stats() == {}


def test_override_checks_the_interface():
    class Base:
        def setup(self):
            pass

    @override(Base)
    def setup(self):
        pass

    with pytest.raises(NameError, match="stup"):
        @override(Base)
        def stup(self):
            pass


def test_meter_collection_accepts_tensors_and_keeps_last_non_numbers():
    import numpy as np
    import torch

    meters = AverageMeterCollection()
    meters.update({"loss": torch.tensor(1.0), "acc": np.float32(0.5), "phase": "warmup"})
    meters.update({"loss": torch.tensor([3.0]), "acc": np.float32(1.0), "phase": "main"})
    summary = meters.summary()
    assert summary["loss"] == pytest.approx(2.0) and isinstance(summary["loss"], float)
    assert summary["acc"] == pytest.approx(0.75) and summary["phase"] == "main"


def test_a_tensor_or_numpy_weight_gives_python_numbers():
    """``num_samples`` as a tensor (``mask.sum()``) or a numpy int weighs like an int, and the summary holds Python
    numbers. Before, a tensor weight left the mean of Python-number metrics a tensor, and a numpy one numpy's."""
    import numpy as np
    import torch

    meters = AverageMeterCollection()
    meters.update({"loss": 0.5}, n=torch.tensor(4))
    meters.update({"loss": torch.tensor(1.5)}, n=torch.tensor(4))
    summary = meters.summary()
    assert summary == {"batch_count": 2, "num_samples": 8, "loss": pytest.approx(1.0), "last_loss": 1.5}
    assert type(summary["loss"]) is float and type(summary["num_samples"]) is int
    meter = AverageMeter()
    meter.update(0.5, n=torch.tensor(2))
    assert type(meter.sum) is float and meter.avg == pytest.approx(0.5)
    meters = AverageMeterCollection()
    meters.update({"loss": 0.5}, n=np.int64(4))
    summary = meters.summary()
    assert summary == {"batch_count": 1, "num_samples": 4, "loss": 0.5, "last_loss": 0.5}
    assert type(summary["num_samples"]) is int and type(summary["loss"]) is float


def test_timer_stat_takes_a_numpy_window_and_refuses_a_bad_one():
    """``TimerStat(window_size=np.int64(3))`` raised TypeError ('an integer is required') from inside deque."""
    import numpy as np

    timer = TimerStat(window_size=np.int64(2))
    for _ in range(3):
        timer.push(1.0)
    assert timer.size == 2 and timer.count == 3
    assert TimerStat(window_size=None).size == TimerStat(window_size=0).size == 0  # 0: as deque(maxlen=0)
    for bad in (2.5, "3", True):
        with pytest.raises(TypeError, match="TimerStat: window_size expects an int >= 0 or None"):
            TimerStat(window_size=bad)
    with pytest.raises(ValueError, match="TimerStat: window_size expects an int >= 0 or None; got -1"):
        TimerStat(window_size=-1)
