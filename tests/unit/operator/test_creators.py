"""TrainingOperator.from_creators (RaySGD 1.x's creator functions) in one process: the loss creator's forms."""
import pytest
import torch
import torch.nn as nn

from raysgd.torch import TrainingOperator
from raysgd.torch.examples import train_example as ex
from raysgd.torch.execution.worker import TorchWorker

CONFIG = {"batch_size": 8, "data_size": 32, "val_size": 8}


def make_worker(operator_cls, config=CONFIG):
    worker = TorchWorker(operator_cls, dict(config), is_local=True)
    worker.setup_operator()
    return worker


class ForwardOnly(nn.Module):  # a loss of one's own: nn.Module's constructor, takes no config
    def forward(self, output, target):
        return ((output - target) ** 2).mean()


class TakesConfig(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale = config.get("scale", 1.0)

    def forward(self, output, target):
        return self.scale * ((output - target) ** 2).mean()


@pytest.mark.parametrize("loss_creator, expected", [
    (nn.MSELoss, nn.MSELoss),  # a torch loss class: instantiated with no argument (1.x)
    (lambda config: nn.SmoothL1Loss(), nn.SmoothL1Loss),  # a function of the config (1.x)
    (TakesConfig, TakesConfig),  # a class taking the config (1.x)
    (nn.MSELoss(), nn.MSELoss),  # a loss module: was called with the config, TypeError "missing 'target'"
    (ForwardOnly, ForwardOnly),  # was ForwardOnly(config): TypeError "takes 1 positional argument"
], ids=["loss-class", "function", "class-of-config", "loss-instance", "module-class"])
def test_loss_creator_forms_train(loss_creator, expected):
    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator,  # noqa: N806
                                        loss_creator=loss_creator)
    worker = make_worker(Op)
    assert isinstance(worker.operator.criterion, expected)
    assert worker.train_epoch()["num_samples"] == 32


def test_a_loss_instance_is_copied_not_shared():
    loss = nn.CrossEntropyLoss(weight=torch.ones(2))
    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator,  # noqa: N806
                                        loss_creator=loss)
    assert make_worker(Op).operator.criterion is not loss


def test_a_missing_creator_is_named_not_setup():
    """The default loop's errors spoke of self.criterion / register_data in setup(), which a creator user never
    wrote."""
    NoLoss = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator)  # noqa: N806
    with pytest.raises(RuntimeError, match="pass loss_creator= to TrainingOperator.from_creators") as info:
        make_worker(NoLoss).train_epoch()
    assert isinstance(info.value.__cause__, RuntimeError)
    NoData = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                            loss_creator=nn.MSELoss)
    with pytest.raises(RuntimeError, match="No training loader: pass data_creator= to"):
        make_worker(NoData).train_epoch()
    with pytest.raises(RuntimeError, match="validate.. needs a validation loader: pass data_creator= to"):
        make_worker(NoData).validate()
    TrainOnly = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                               lambda config: ex.data_creator(config)[0], loss_creator=nn.MSELoss)
    worker = make_worker(TrainOnly)
    assert worker.train_epoch()["num_samples"] == 32
    with pytest.raises(RuntimeError, match="data_creator given to TrainingOperator.from_creators returned only"):
        worker.validate()


@pytest.mark.parametrize("no_scheduler", [None, [], ()], ids=["None", "empty-list", "empty-tuple"])
@pytest.mark.parametrize("loss_creator", [None, nn.MSELoss], ids=["no-loss", "loss"])
def test_a_scheduler_creator_may_return_no_scheduler(no_scheduler, loss_creator):
    """A conditional scheduler (``StepLR(...) if config["decay"] else None``) crashed setup: IndexError."""
    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator,  # noqa: N806
                                        loss_creator=loss_creator,
                                        scheduler_creator=lambda optimizer, config: no_scheduler)
    for freq in (None, "epoch"):
        worker = TorchWorker(Op, dict(CONFIG), is_local=True, scheduler_step_freq=freq)
        worker.setup_operator()
        op = worker.operator
        assert not hasattr(op, "scheduler") and not hasattr(op, "schedulers")
        assert hasattr(op, "criterion") == (loss_creator is not None)
        if loss_creator is not None:
            assert worker.train_epoch()["num_samples"] == 32


def test_a_loss_creator_returning_none_is_named():
    """Its None was left out by register, so the scheduler after it was taken for the loss (or IndexError)."""
    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator,  # noqa: N806
                                        loss_creator=lambda config: None, scheduler_creator=ex.scheduler_creator)
    with pytest.raises(ValueError, match="loss_creator .* returned None"):
        TorchWorker(Op, dict(CONFIG), is_local=True, scheduler_step_freq="epoch").setup_operator()
