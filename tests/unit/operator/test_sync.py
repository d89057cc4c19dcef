"""No host sync per batch: the default loops, the meters and the progress reporter read tensors once per epoch.

On CPU a "sync" is counted as any call that copies a tensor's value to Python (``item``, ``tolist``,
``float(t)``, ...): on a GPU each of those waits for the device. The counts must not grow with the number
of batches. The CUDA test at the end checks the same with ``torch.cuda.set_sync_debug_mode`` on a real GPU.
"""
import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd.torch import TrainingOperator
from raysgd.torch.integrations.progress import ProgressReporter
from raysgd.torch.execution.worker import TorchWorker
from raysgd.utils import NUM_SAMPLES, AverageMeter, AverageMeterCollection

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


@pytest.fixture
def host_reads(monkeypatch):
    """A list that gets one entry per tensor-to-Python read while the test runs."""
    calls = []

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    return calls


class Classifier(TrainingOperator):
    """A small classifier on fixed random data: ``config["batches"]`` batches of 8 (train and validation)."""

    def setup(self, config):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(8 * config["batches"], 4, generator=generator)
        y = (x[:, 0] > 0).long()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            criterion=nn.CrossEntropyLoss())
        batches = list(zip(x.split(8), y.split(8)))  # not a DataLoader: it reads a seed tensor every epoch
        self.register_data(train_loader=batches, validation_loader=batches)


class Recording(Classifier):
    """Keeps every batch's returned metrics (tensors, never read during the epoch)."""

    def setup(self, config):
        super().setup(config)
        self.seen = []

    def train_batch(self, batch, batch_info):
        metrics = super().train_batch(batch, batch_info)
        self.seen.append(dict(metrics))
        return metrics

    def validate_batch(self, batch, batch_info):
        metrics = super().validate_batch(batch, batch_info)
        self.seen.append(dict(metrics))
        return metrics


class UserTensors(Classifier):
    """A user's train_batch returning its metrics as tensors (and a string)."""

    def train_batch(self, batch, batch_info):
        features, target = batch
        output = self.model(features)
        loss = self.criterion(output, target)
        self.backward_and_step(loss, self.optimizer)
        correct = (output.argmax(1) == target).sum()
        return {"loss": loss.detach(), "correct": correct, "phase": "main", NUM_SAMPLES: len(target)}


def make_worker(operator_cls, batches):
    worker = TorchWorker(operator_cls, {"batches": batches}, is_local=True)
    worker.setup_operator()
    return worker


def reads_during(calls, fn):
    start = len(calls)
    result = fn()
    return result, calls[start:]


@pytest.mark.parametrize("phase", ["train", "validate"])
def test_default_loops_read_the_device_once_per_epoch(host_reads, phase):
    counts = {}
    for batches in (4, 32):
        worker = make_worker(Classifier, batches)
        run = worker.train_epoch if phase == "train" else worker.validate
        run()  # a first epoch: whatever happens once (lazy set-up) is not counted below
        stats, reads = reads_during(host_reads, run)
        assert stats["batch_count"] == batches and stats["num_samples"] == 8 * batches
        counts[batches] = reads
    assert len(counts[32]) == len(counts[4]) <= 1, counts  # the one read is the end-of-epoch summary


def test_progress_reporter_reads_once_per_update_sent(host_reads):
    worker = make_worker(Classifier, 32)
    sent = []
    for interval_s in (60, 0):  # 60: the first batch and the end; 0: every batch sends, and reads, once
        reporter = ProgressReporter(lambda state, final: sent.append(state), call_id=1, interval_s=interval_s)
        sent.clear()
        stats, reads = reads_during(host_reads, lambda: worker.train_epoch(progress=reporter))
        assert len(sent) == (2 if interval_s else 33)
        assert len(reads) <= len(sent) + 1, reads  # one per update sent, plus the epoch's summary
        assert sent[-1]["n"] == 32 and sent[-1]["losses"]["loss"] == pytest.approx(stats["train_loss"])


def test_user_tensors_are_averaged_without_reads(host_reads):
    worker = make_worker(UserTensors, 16)
    stats, reads = reads_during(host_reads, worker.train_epoch)
    assert len(reads) <= 1, reads
    assert isinstance(stats["loss"], float) and isinstance(stats["last_correct"], int)
    assert 0 <= stats["correct"] <= 8 and stats["phase"] == "main" and stats["num_samples"] == 128


@pytest.mark.parametrize("phase", ["train", "validate"])
def test_reported_numbers_are_the_per_batch_values_weighted_as_before(phase):
    worker = make_worker(Recording, 5)
    # uneven batches (8, 8, 8, 8, 3) so that the sample weighting shows
    x, y = torch.randn(35, 4), torch.randint(0, 2, (35,))
    worker.operator.register_data(train_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                                  validation_loader=DataLoader(TensorDataset(x, y), batch_size=8))
    stats = worker.train_epoch() if phase == "train" else worker.validate()
    seen = worker.operator.seen
    n = [m[NUM_SAMPLES] for m in seen]
    assert stats["num_samples"] == sum(n) == 35 and stats["batch_count"] == 5
    for key in [k for k in seen[0] if k != NUM_SAMPLES]:
        values = [m[key].item() if isinstance(m[key], torch.Tensor) else m[key] for m in seen]  # 1.x: floats
        assert stats[key] == pytest.approx(sum(v * w for v, w in zip(values, n)) / sum(n), rel=1e-12)
        assert stats["last_" + key] == values[-1]
        assert type(stats[key]) is float


def test_meters_mix_floats_and_tensors_and_keep_nan_as_before():
    meters = AverageMeterCollection()
    meters.update({"x": float("nan"), "y": torch.tensor(2.0)}, n=2)
    meters.update({"x": torch.tensor(1.0), "y": 4.0, "flag": torch.tensor(True)}, n=1)
    summary = meters.summary()
    assert math.isnan(summary["x"]) and summary["last_x"] == 1.0
    assert summary["y"] == pytest.approx(8 / 3) and summary["last_y"] == 4.0 and summary["flag"] is True
    meter = AverageMeter()
    meter.update(torch.tensor(3.0), n=2)
    meter.update(1.0, n=2)
    assert meter.avg == pytest.approx(2.0) and meter.sum == pytest.approx(8.0) and meter.count == 4


def test_meter_state_round_trips_and_keeps_counting():
    meters = AverageMeterCollection()
    meters.update({"loss": torch.tensor(0.5), "acc": 1}, n=4)
    state = meters.state()
    assert state == {"batch_count": 1, "num_samples": 4, "latest": {},
                     "meters": {"loss": {"sum": 2.0, "count": 4, "val": 0.5}, "acc": {"sum": 4, "count": 4, "val": 1}}}
    restored = AverageMeterCollection.from_state(state)
    for collection in (meters, restored):
        collection.update({"loss": torch.tensor(1.5), "acc": 0}, n=4)
    assert restored.summary() == meters.summary() == {"batch_count": 2, "num_samples": 8, "loss": 1.0,
                                                      "last_loss": 1.5, "acc": 0.5, "last_acc": 0}


# ----------------------------------------------------------------------------- on a real GPU
class DeviceClassifier(TrainingOperator):
    """Data already on the GPU (a list of batches), so the loop itself is all that could sync."""

    def setup(self, config):
        torch.manual_seed(0)
        x = torch.randn(16 * 32, 64, device=self.device)
        y = (x[:, 0] > 0).long()
        model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 2))
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            criterion=nn.CrossEntropyLoss())
        batches = list(zip(x.split(32), y.split(32)))
        self.register_data(train_loader=batches, validation_loader=batches)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("use_fp16", [False, "bf16", True])
def test_cuda_default_loop_syncs_once_per_epoch(use_fp16):
    worker = TorchWorker(DeviceClassifier, {}, is_local=True, use_gpu=True, use_fp16=use_fp16)
    worker.setup_operator()
    assert worker.operator.device.type == "cuda"
    worker.train_epoch()  # warm-up: cuBLAS/cuDNN handles, the momentum buffers
    calls, steps = 3 + 2, 3 * 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                stats = worker.train_epoch()
            val = worker.validate()
            val = worker.validate()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
    # fp16's GradScaler.step reads found_inf once per step (a plain torch.amp loop does the same)
    allowed = calls + (steps if use_fp16 is True else 0)
    assert len(syncs) <= allowed, syncs
    assert stats["num_samples"] == 512 and math.isfinite(stats["train_loss"]) and 0 <= val["val_accuracy"] <= 1
