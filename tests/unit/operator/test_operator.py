"""TrainingOperator and the worker's epoch loop in one process (world size 1, no Ray)."""
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import ClassifierOperator
from raysgd.torch import TrainingOperator
from raysgd.torch.examples import train_example as ex
from raysgd.torch.training_operator import get_test_metrics_operator, get_test_operator
from raysgd.torch.execution.worker import TorchWorker
from raysgd.utils import NUM_SAMPLES


def make_worker(operator_cls, config=None, **options):
    worker = TorchWorker(operator_cls, dict(config or {}), is_local=True, **options)
    worker.setup_operator()
    return worker


class LinearOperator(TrainingOperator):
    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.MSELoss())
        self.register_data(train_loader=DataLoader(ex.LinearDataset(2, 5, size=64), batch_size=8),
                           validation_loader=DataLoader(ex.LinearDataset(2, 5, size=24), batch_size=8))


def test_register_keeps_the_shapes_given():
    seen = {}

    class Shapes(TrainingOperator):
        def setup(self, config):
            m1, m2 = nn.Linear(1, 1), nn.Linear(1, 1)
            o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
            s1 = torch.optim.lr_scheduler.StepLR(o1, 1)
            seen["single"] = self.register(models=m1, optimizers=o1)
            seen["tuple"] = self.register(models=(m1, m2), optimizers=(o1, o2), criterion=nn.MSELoss())
            seen["list"] = self.register(models=[m1], optimizers=[o1], schedulers=[s1])
            seen["sched"] = self.register(models=m1, optimizers=o1, schedulers=s1)

    make_worker(Shapes, scheduler_step_freq="epoch")
    models, optimizers = seen["single"]
    assert isinstance(models, nn.Linear) and isinstance(optimizers, torch.optim.SGD)
    models, optimizers, criterion = seen["tuple"]
    assert isinstance(models, tuple) and len(models) == 2 and isinstance(optimizers, tuple)
    assert isinstance(criterion, nn.MSELoss)
    models, optimizers, schedulers = seen["list"]
    assert isinstance(models, list) and isinstance(optimizers, list) and isinstance(schedulers, list)
    assert isinstance(seen["sched"][2], torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ddp_args=[1]), ValueError, "ddp_args"),
    (dict(apex_args="x"), ValueError, "apex_args"),
    (dict(models="not a model"), TypeError, "models"),
    (dict(optimizers=[3]), TypeError, "optimizers"),
    (dict(schedulers="sched"), ValueError, "scheduler_step_freq"),
])
def test_register_rejects_bad_input(kwargs, error, match):
    class Bad(TrainingOperator):
        def setup(self, config):
            model = nn.Linear(1, 1)
            args = dict(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1))
            args.update(kwargs)
            self.register(**args)

    with pytest.raises(error, match=match):
        make_worker(Bad)


def test_setup_must_be_implemented():
    with pytest.raises(NotImplementedError, match="setup"):
        make_worker(TrainingOperator)


def test_default_loop_trains_and_reports_1x_metrics():
    worker = make_worker(LinearOperator)
    first = worker.train_epoch()
    for _ in range(20):
        last = worker.train_epoch()
    assert list(first)[:3] == ["epoch", "batch_count", "num_samples"]
    assert first["epoch"] == 1 and last["epoch"] == 21
    assert first["batch_count"] == 8 and first["num_samples"] == 64
    assert last["train_loss"] < first["train_loss"] / 10
    val = worker.validate()
    assert set(val) == {"batch_count", "num_samples", "val_loss", "last_val_loss", "val_accuracy",
                        "last_val_accuracy"}
    assert val["num_samples"] == 24 and worker.epochs == 21  # validation never counts epochs
    assert worker.operator.global_step == 21 * 8


def test_profile_adds_timings_only_when_asked():
    worker = make_worker(LinearOperator)
    assert "profile" not in worker.train_epoch()
    profile = worker.train_epoch(profile=True)["profile"]
    assert set(profile) == {"mean_train_epoch_s", "mean_fwd_s", "mean_grad_s", "mean_apply_s"}
    assert set(worker.validate(profile=True)["profile"]) == {"mean_validation_s", "mean_eval_fwd_s"}


def test_num_steps_cycles_the_persistent_iterator_as_1x():
    """The table of the API notes, section 2.4 (10 items: 5 zeros then 5 ones, batch size 1)."""
    data = torch.tensor([0.0] * 5 + [1.0] * 5).view(-1, 1)

    def mean_of_batches(op, iterator, info):
        values = [batch[0].item() for batch in iterator]
        return {"mean": sum(values) / len(values), "n": len(values)}

    class Items(TrainingOperator):
        def setup(self, config):
            register_a_model(self)
            loader = DataLoader(TensorDataset(data), batch_size=1)
            self.register_data(train_loader=loader, validation_loader=loader)

    worker = make_worker(get_test_operator(Items), {"custom_func": mean_of_batches})
    expected = [(None, 0.5, 10, 1), (5, 0.0, 5, 2), (3, 1.0, 3, 2), (5, 0.4, 5, 3), (None, 5 / 7, 7, 3)]
    for num_steps, mean, count, epoch in expected:
        result = worker.train_epoch(num_steps=num_steps)
        assert (result["mean"], result["n"], result["epoch"]) == (pytest.approx(mean), count, epoch), num_steps
    assert worker.validate(num_steps=3)["mean"] == 0.0
    assert worker.validate()["n"] == 7


def test_empty_loader_stops_instead_of_looping():
    class Empty(TrainingOperator):
        def setup(self, config):
            register_a_model(self)
            self.register_data(train_loader=[])

    worker = make_worker(get_test_operator(Empty), {"custom_func": lambda op, it, info: {"n": len(list(it))}})
    assert worker.train_epoch(num_steps=5)["n"] == 0


def test_info_reaches_batches_and_is_not_mutated():
    seen = []

    class Recording(LinearOperator):
        def train_batch(self, batch, batch_info):
            seen.append(dict(batch_info))
            return super().train_batch(batch, batch_info)

    worker = make_worker(Recording)
    info = {"custom": 7}
    worker.train_epoch(num_steps=2, info=info)
    assert info == {"custom": 7}
    assert seen[0]["custom"] == 7 and seen[1]["batch_idx"] == 1 and seen[1]["global_step"] == 1
    assert seen[0]["epoch_idx"] == 0 and seen[0]["__num_steps__"] == 2


def test_multi_input_models_get_every_feature():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 1), nn.Linear(3, 1)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    class Op(TrainingOperator):
        def setup(self, config):
            model = TwoInputs()
            dataset = TensorDataset(torch.randn(16, 2), torch.randn(16, 3), torch.randn(16, 1))
            self.model, self.optimizer, self.criterion = self.register(
                models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.MSELoss())
            self.register_data(train_loader=DataLoader(dataset, batch_size=4), validation_loader=DataLoader(dataset))

    worker = make_worker(Op)
    assert worker.train_epoch()["num_samples"] == 16
    assert worker.validate()["num_samples"] == 16


def test_schedulers_step_per_epoch_or_batch_or_manually():
    def lrs(freq, metrics=()):
        class Op(LinearOperator):
            def setup(self, config):
                super().setup(config)
                if freq == "manual":
                    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5, patience=0)
                else:
                    sched = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
                self.register(models=self.model, optimizers=self.optimizer, criterion=self.criterion,
                              schedulers=sched)

        worker = make_worker(Op, {"lr": 1.0}, scheduler_step_freq=freq)
        worker.train_epoch()
        for metric in metrics:
            worker.update_scheduler(metric)
        return worker.operator.optimizer.param_groups[0]["lr"]

    assert lrs("epoch") == 0.5
    assert lrs("batch") == 0.5 ** 8
    assert lrs("manual") == 1.0
    assert lrs("manual", metrics=[1.0, 2.0]) == 0.5  # the second metric is worse: plateau


@pytest.mark.parametrize("freq", ["epoch", "batch"])
def test_plateau_scheduler_stepped_without_a_metric_is_refused_at_register(freq):
    class Plateau(LinearOperator):
        def setup(self, config):
            super().setup(config)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer)
            self.register(models=self.model, optimizers=self.optimizer, schedulers=[sched])

    with pytest.raises(ValueError, match=rf"ReduceLROnPlateau.*scheduler_step_freq='{freq}'.*"
                                         r"scheduler_step_freq=\"manual\".*update_scheduler\(metric\)"):
        make_worker(Plateau, scheduler_step_freq=freq)


@pytest.mark.parametrize("given, words", [
    ("optimizer", "got an instance of SGD"),  # it has step() and state_dict(): it was stepped again, silently
    ("text", "got str 'StepLR'"),  # an AttributeError at the end of the first epoch
    ("class", "got the class StepLR (not an instance)"),  # a TypeError at the end of the first epoch
    ("listed", "got a list whose item 1 is str 'StepLR'"),
])
def test_register_refuses_what_is_no_scheduler(given, words):
    class NoScheduler(LinearOperator):
        def setup(self, config):
            super().setup(config)
            schedulers = {"optimizer": self.optimizer, "text": "StepLR", "class": torch.optim.lr_scheduler.StepLR,
                          "listed": [torch.optim.lr_scheduler.StepLR(self.optimizer, 1), "StepLR"]}[given]
            self.register(models=self.model, optimizers=self.optimizer, schedulers=schedulers)

    with pytest.raises(TypeError, match=r"^register\(schedulers=\.\.\.\) expects a learning-rate scheduler") as info:
        make_worker(NoScheduler, scheduler_step_freq="epoch")
    assert words in str(info.value)


def test_default_validation_skips_accuracy_for_multi_output_regression():
    class MultiOutput(TrainingOperator):
        def setup(self, config):
            torch.manual_seed(0)
            model = nn.Linear(3, 2)
            self.model, self.optimizer, self.criterion = self.register(
                models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.MSELoss())
            x, y = torch.randn(10, 3), torch.randn(10, config["k"])
            loader = DataLoader(TensorDataset(x, y if config["k"] > 1 else y.view(-1)), batch_size=4)
            self.model_x, self.model_y = x, y
            self.register_data(train_loader=loader, validation_loader=loader)

    worker = make_worker(MultiOutput, {"k": 2})  # (N, 2) float targets: regression, no accuracy
    stats = worker.validate()
    op = worker.operator
    with torch.no_grad():
        expected = nn.functional.mse_loss(op.model(op.model_x), op.model_y).item()
    assert stats[NUM_SAMPLES] == 10 and stats["val_loss"] == pytest.approx(expected, rel=1e-5)
    assert stats["val_accuracy"] == 0.0

    val = make_worker(ClassifierOperator).validate()  # class-index targets still get their accuracy
    assert 0.5 < val["val_accuracy"] <= 1.0


def test_default_loop_needs_a_model():
    class TwoModels(TrainingOperator):
        def setup(self, config):
            models = [nn.Linear(1, 1), nn.Linear(1, 1)]
            self.register(models=models, optimizers=[torch.optim.SGD(m.parameters(), lr=0.1) for m in models])
            self.register_data(train_loader=[(torch.ones(1), torch.ones(1))])

    with pytest.raises(RuntimeError, match="self.model"):
        make_worker(TwoModels).train_epoch()


def register_a_model(operator):
    """What an operator with its own loops registers anyway (checkpoints and get_model() need its models)."""
    model = nn.Linear(1, 1)
    operator.model, operator.optimizer = operator.register(models=model,
                                                           optimizers=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("registers", ["nothing", "only data", "an empty list"])
def test_an_operator_that_registers_no_model_is_refused_when_it_is_built(registers):
    """It was accepted, and failed at the first train() (inside a RayTaskError on a remote worker)."""
    class NoModel(TrainingOperator):
        def setup(self, config):
            if registers == "only data":
                self.register_data(train_loader=[(torch.ones(1), torch.ones(1))])
            elif registers == "an empty list":
                self.register(models=[], optimizers=[])

        def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
            return {"batches": len(list(iterator))}  # its own loop: it still needs a model for the state

    with pytest.raises(ValueError, match=r"NoModel.setup\(\) registered no model.*register\(models=\.\.\., "
                                         r"optimizers=\.\.\.\)"):
        make_worker(get_test_operator(NoModel))


def test_operators_with_their_own_loops_that_register_models_are_accepted():
    class OwnLoop(TrainingOperator):
        def setup(self, config):
            register_a_model(self)
            self.register_data(train_loader=[(torch.ones(1), torch.ones(1))] * 3)

        def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
            return {"batches": len(list(iterator))}

    assert make_worker(OwnLoop).train_epoch()["batches"] == 3
    creators = TrainingOperator.from_creators(lambda config: nn.Linear(1, 1),
                                              lambda model, config: torch.optim.SGD(model.parameters(), lr=0.1),
                                              lambda config: [(torch.ones(1), torch.ones(1))])
    assert make_worker(creators).operator.model is not None


def test_missing_validation_loader_is_a_clear_error():
    class NoVal(LinearOperator):
        def setup(self, config):
            super().setup(config)
            self.register_data(train_loader=self._train_loader)

    with pytest.raises(RuntimeError, match=r"register_data\(validation_loader=...\)"):
        make_worker(NoVal).validate()


def test_state_round_trip_is_exact():
    worker = make_worker(LinearOperator, {"lr": 0.05})
    worker.train_epoch()
    state = worker.state_dict()
    other = make_worker(LinearOperator, {"lr": 0.05})
    other.load_state_stream(worker.state_stream())
    assert other.epochs == 1 and other.operator.global_step == 8
    for a, b in zip(worker.operator.model.parameters(), other.operator.model.parameters()):
        assert torch.equal(a, b)
    assert worker.train_epoch() == other.train_epoch()
    assert set(state) == {"epoch", "global_step", "operator", "models", "optimizers", "rng"}  # + random streams


def test_operator_state_hooks_are_checkpointed():
    class WithState(LinearOperator):
        def setup(self, config):
            super().setup(config)
            self.best = None

        def state_dict(self):
            return {"best": 1.25}

        def load_state_dict(self, state):
            self.best = state["best"]

    worker = make_worker(WithState)
    other = make_worker(WithState)
    other.load_state_dict(worker.state_dict())
    assert other.operator.best == 1.25


def test_get_models_to_cpu_returns_copies():
    worker = make_worker(LinearOperator)
    copy = worker.get_models(to_cpu=True)[0]
    assert copy is not worker.operator.model
    with torch.no_grad():
        copy.weight.fill_(42.0)
    assert worker.operator.model.weight.item() != 42.0
    assert worker.get_models()[0] is worker.operator.model


def test_from_creators_1x_and_fixed_cases():
    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator, ex.data_creator,  # noqa: N806
                                        scheduler_creator=ex.scheduler_creator, loss_creator=nn.MSELoss)
    op = make_worker(Op, {"batch_size": 100}, scheduler_step_freq="epoch").operator
    assert isinstance(op.model, nn.Linear) and isinstance(op.criterion, nn.MSELoss)
    assert isinstance(op.scheduler, torch.optim.lr_scheduler.StepLR)

    def two_models(config):
        return nn.Linear(1, 1), nn.Linear(1, 1)

    def two_optimizers(models, config):
        return tuple(torch.optim.SGD(m.parameters(), lr=0.1) for m in models)

    Two = TrainingOperator.from_creators(two_models, two_optimizers)  # noqa: N806
    op = make_worker(Two).operator
    assert len(op.optimizers) == 2 and op.optimizer is op.optimizers[0]  # several optimizers (1.12 bug)
    assert not hasattr(op, "criterion")

    NoLoss = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                            scheduler_creator=ex.scheduler_creator)
    op = make_worker(NoLoss, scheduler_step_freq="epoch").operator
    assert isinstance(op.scheduler, torch.optim.lr_scheduler.StepLR) and not hasattr(op, "criterion")

    with pytest.raises(ValueError, match="model_creator"):
        TrainingOperator.from_creators(None, ex.optimizer_creator)


def test_from_creators_checks_the_loader_count():
    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                        data_creator=lambda config: (1, 2, 3))
    with pytest.raises(ValueError, match="3 loaders"):
        make_worker(Op)


def test_from_creators_takes_one_loader_over_an_iterable_dataset():
    class Stream(torch.utils.data.IterableDataset):  # no __len__: bool(DataLoader) would raise
        def __iter__(self):
            return iter([(torch.tensor([float(i)]), torch.tensor([2.0 * i])) for i in range(32)])

    Op = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                        lambda config: DataLoader(Stream(), batch_size=8), loss_creator=nn.MSELoss)
    worker = make_worker(Op)
    assert worker.train_epoch()[NUM_SAMPLES] == 32
    Empty = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                           lambda config: DataLoader(TensorDataset(torch.ones(0, 1)), batch_size=2))
    assert make_worker(Empty).operator._train_loader is not None  # an empty map-style loader is a loader too
    for bad in (None, ()):
        NoLoader = TrainingOperator.from_creators(ex.model_creator, ex.optimizer_creator,  # noqa: N806
                                                  lambda config, bad=bad: bad)
        with pytest.raises(ValueError, match="data_creator must return"):
            make_worker(NoLoader)


def test_metrics_operator_helper_reports_what_1_12_did():
    # 1.12: each batch's score divided by that batch's num_samples, the default loop's metrics kept.
    config = {"scores": [1.0, 3.0] + [0.0] * 6, "val_scores": [2.0, 4.0, 12.0], "key": "score"}
    worker = make_worker(get_test_metrics_operator(LinearOperator), config)
    stats = worker.train_epoch(num_steps=2)
    assert stats["score"] == pytest.approx((1.0 / 8 + 3.0 / 8) / 2) and stats["last_score"] == 3.0 / 8
    assert stats[NUM_SAMPLES] == 16 and "train_loss" in stats and "last_train_loss" in stats
    val = worker.validate()  # 3 batches of 8 samples
    assert val["last_score"] == pytest.approx(12.0 / 8) and val[NUM_SAMPLES] == 24
    assert val["score"] == pytest.approx((2.0 + 4.0 + 12.0) / 8 / 3)
    assert {"val_loss", "val_accuracy"} <= set(val)
