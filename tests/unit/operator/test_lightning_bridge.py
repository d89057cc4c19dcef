"""from_ptl's configure_optimizers parsing and scheduler stepping in one process (a local TorchWorker, no Ray)."""
import numpy as np
import pytest

pl = pytest.importorskip("pytorch_lightning", reason="the Lightning tests need pip install 'raysgd[test]'")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from raysgd import TrainingOperator  # noqa: E402
from raysgd.torch.execution.worker import TorchWorker  # noqa: E402
from raysgd.torch.operator.lightning_bridge import parse_optimizers  # noqa: E402


class Scheduled(pl.LightningModule):
    """``config["lr_scheduler"](optimizer)`` is what configure_optimizers returns as its lr_scheduler."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        return {"optimizer": optimizer, "lr_scheduler": self.config["lr_scheduler"](optimizer)}

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 4, generator=generator), torch.randint(0, 2, (64,), generator=generator))
        return DataLoader(data, batch_size=8)


def in_process(module_cls, config):
    worker = TorchWorker(TrainingOperator.from_ptl(module_cls), dict(config), is_local=True)
    worker.setup_operator()
    return worker


@pytest.mark.parametrize("frequency", [np.int64(2), np.int32(2), 2.0])
def test_a_numpy_scheduler_frequency_counts_as_an_int(frequency):
    """``{"interval": "step", "frequency": np.int64(2)}`` (a frequency computed with numpy, or Tune's 2.0) steps
    every 2nd batch. Before, it was refused as no int ('frequency' must be an int >= 1; got np.int64(2))."""
    def lr_scheduler(optimizer):
        return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), "interval": "step",
                "frequency": frequency}

    worker = in_process(Scheduled, {"lr_scheduler": lr_scheduler})
    worker.train_epoch()
    assert worker.operator.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 ** 4)  # 8 batches, every 2nd
    assert type(worker.operator.scheduler_dicts[0].frequency) is int


@pytest.mark.parametrize("frequency", [True, 0, 1.5, "2"])
def test_a_frequency_that_is_no_whole_number_above_zero_is_refused(frequency):
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(ValueError, match="'frequency' must be an int >= 1"):
        parse_optimizers({"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "frequency": frequency}})


@pytest.mark.parametrize("given, words", [
    (lambda opt: [torch.optim.lr_scheduler.StepLR(opt, 1)], r"got \[<torch.optim.lr_scheduler.StepLR"),
    (lambda opt: {"scheduler": torch.optim.lr_scheduler.StepLR}, "got class torch.optim.lr_scheduler.StepLR"),
    (lambda opt: "cosine", "got 'cosine'"),
])
def test_an_lr_scheduler_that_is_no_scheduler_is_refused_at_setup(given, words):
    """A list (``"lr_scheduler": [sched]``), a class or a name was accepted, and the first epoch trained before
    ``scheduler.step()`` failed with AttributeError at its end."""
    with pytest.raises(TypeError, match="an lr_scheduler must be a learning-rate scheduler.*" + words):
        in_process(Scheduled, {"lr_scheduler": given})


def test_an_own_lr_scheduler_step_takes_any_scheduler_with_a_state():
    class OwnStep(Scheduled):
        def lr_scheduler_step(self, scheduler, metric):
            scheduler.steps += 1

    class Counter:  # no step(): the module's lr_scheduler_step steps it
        steps = 0

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    counter = Counter()
    worker = in_process(OwnStep, {"lr_scheduler": lambda opt: counter})
    worker.train_epoch()
    assert counter.steps == 1
    with pytest.raises(TypeError, match="with an overridden lr_scheduler_step, the last two.*got 'cosine'"):
        in_process(OwnStep, {"lr_scheduler": lambda opt: "cosine"})  # it could not be checkpointed


class Clipped(Scheduled):
    """``self.clip_gradients(optimizer, gradient_clip_val=config["clip"], ...)`` at every step."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=self.config["clip"],
                            gradient_clip_algorithm=self.config["algorithm"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def trained_weight(config):
    torch.manual_seed(0)
    worker = in_process(Clipped, config)
    worker.train_epoch()
    return worker.operator.get_model().net.weight.detach()


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_gradient_clip_value_of_0_clips_nothing_as_under_lightnings_trainer(algorithm):
    """``gradient_clip_val=0`` (a config's "off") is no clipping under Lightning's Trainer. Before, it reached
    clip_grad_norm_(max_norm=0) (or clip_grad_value_(0)), which zeroed every gradient: the model never trained."""
    unclipped = trained_weight({"clip": None, "algorithm": None})
    assert torch.equal(trained_weight({"clip": 0.0, "algorithm": algorithm}), unclipped)
    assert not torch.equal(trained_weight({"clip": 0.01, "algorithm": algorithm}), unclipped)  # a real clip clips


def test_a_non_finite_gradient_norm_is_clipped_without_an_error():
    """An fp16 overflow leaves inf gradients, whose step the GradScaler skips: under Lightning's Trainer clipping
    them is no error. Before, the stand-in asked clip_grad_norm_ to raise (error_if_nonfinite=True)."""
    from raysgd.torch.operator.lightning_bridge import TrainerStandIn

    class Operator:
        def unscale_once(self, optimizer):
            pass

    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    norm = TrainerStandIn(Operator()).clip_gradients(model, optimizer, max_norm=1.0)
    assert not torch.isfinite(norm)


class ValidatedPlateau(Scheduled):
    """A ReduceLROnPlateau on ``val_loss``, which only validate() reports."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def val_dataloader(self):
        return self.train_dataloader()


def test_a_plateau_waiting_for_validate_over_several_epochs_steps_once_per_validation():
    """train() three times, then validate(): the plateau scheduler sees one value of its metric, so it steps once,
    as under Lightning's Trainer. Before, it stepped once per waiting epoch with that one value: three steps, and
    with patience=1 the learning rate was cut on a single measurement."""
    def lr_scheduler(optimizer):
        return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1), "monitor": "val_loss"}

    worker = in_process(ValidatedPlateau, {"lr_scheduler": lr_scheduler})
    scheduler = worker.operator.scheduler_dicts[0].scheduler
    for _ in range(3):
        worker.train_epoch()
    worker.validate()
    assert scheduler.last_epoch == 1 and worker.operator.optimizers[0].param_groups[0]["lr"] == 1.0
    worker.train_epoch()
    worker.validate()
    assert scheduler.last_epoch == 2


def test_a_monitor_in_a_list_of_dicts_applies_to_its_own_dicts_schedulers_only():
    """A dict's ``monitor`` without an ``lr_scheduler`` of its own went to every earlier dict's schedulers: a
    ReduceLROnPlateau given no monitor silently watched another optimizer's metric instead of being refused."""
    model = nn.Linear(2, 1)
    first, second = (torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(first)
    with pytest.raises(ValueError, match="ReduceLROnPlateau scheduler needs a 'monitor'"):
        parse_optimizers([{"optimizer": first, "lr_scheduler": plateau}, {"optimizer": second, "monitor": "other"}])
    step = torch.optim.lr_scheduler.StepLR(first, 1)
    _, configs = parse_optimizers([{"optimizer": first, "lr_scheduler": step},
                                   {"optimizer": second, "lr_scheduler": plateau, "monitor": "val_loss"}])
    assert [c.monitor for c in configs] == [None, "val_loss"]


class Overflowing(Clipped):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1e36 if batch_idx == 0 else 1.0)  # inf once scaled


def test_an_fp16_overflow_with_clipping_skips_that_step_and_training_goes_on():
    """The first step's scaled gradients overflow: clipping them raised (error_if_nonfinite=True) and train()
    failed; as under Lightning's Trainer the scaler now skips that step and halves its scale."""
    worker = in_process(Overflowing, {"clip": 1.0, "algorithm": "norm", "lr_scheduler": None})
    worker.operator.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)  # CUDA's fp16 scaler
    assert worker.train_epoch()["num_samples"] == 64
    assert worker.operator.precision.scaler.get_scale() == 2.0 ** 15
    assert torch.isfinite(worker.operator.get_model().net.weight).all()


class TwoValLoaders(ValidatedPlateau):
    def val_dataloader(self):
        return [self.train_dataloader(), self.train_dataloader()]


def test_several_validation_loaders_are_refused_at_setup_naming_the_hook():
    """Lightning's list of loaders was taken as one loader whose batches were DataLoaders: validate() handed a
    whole DataLoader to validation_step ('too many values to unpack')."""
    with pytest.raises(TypeError, match=r"TwoValLoaders.val_dataloader\(\) returned a list of 2 DataLoaders"):
        in_process(TwoValLoaders, {"lr_scheduler": lambda opt: None})
    loader = Scheduled({}).train_dataloader()
    with pytest.raises(TypeError, match=r"from_ptl\(train_dataloader=...\) returned a dict of 1 DataLoaders"):
        worker = TorchWorker(TrainingOperator.from_ptl(Scheduled, train_dataloader={"a": loader}),
                             {"lr_scheduler": lambda opt: None}, is_local=True)
        worker.setup_operator()
    batches = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 2  # a list of batches is one loader
    worker = TorchWorker(TrainingOperator.from_ptl(Scheduled, train_dataloader=batches),
                         {"lr_scheduler": lambda opt: None}, is_local=True)
    worker.setup_operator()
    assert worker.train_epoch()["num_samples"] == 16
