"""TorchTrainer end to end on a real local Ray cluster: 1 and 2 workers, use_local both ways."""
import os

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from helpers import ClassifierOperator, LinearOperator, parameters_of, pid_and_threads
from raysgd import TrainingOperator
from raysgd.torch.training_operator import get_test_operator
from raysgd.utils import BATCH_SIZE

pytestmark = pytest.mark.usefixtures("ray_4cpus")

LAYOUTS = [pytest.param(1, False, id="1-remote"), pytest.param(1, True, id="1-local"),
           pytest.param(2, False, id="2-remote"), pytest.param(2, True, id="2-local")]


@pytest.fixture
def make_trainer(trainer_factory):
    return lambda **kwargs: trainer_factory(**{"training_operator_cls": LinearOperator, **kwargs})


@pytest.mark.parametrize("num_workers, use_local", LAYOUTS)
def test_train_validate_metrics_and_state(make_trainer, num_workers, use_local):
    """Also, on the same trainer (each trainer start is ~3 s of worker start-up): the model is wrapped in DDP on 2
    workers (as wrap_ddp=False leaves it unwrapped), get_local_operator() needs use_local, and update_scheduler()
    without a registered scheduler says so."""
    trainer = make_trainer(num_workers=num_workers, use_local=use_local, config={"lr": 0.02, "data_size": 200})
    assert trainer.worker_group.num_workers == num_workers
    if num_workers == 2:
        assert trainer.apply_all_operators(lambda op: type(op.model).__name__) == ["DistributedDataParallel"] * 2
    first = trainer.train()
    for _ in range(3):
        last = trainer.train()
    assert first["num_samples"] == 200 and last["epoch"] == 4
    assert first["batch_count"] == pytest.approx(13 / num_workers if num_workers == 1 else 7)
    assert last["train_loss"] < first["train_loss"]
    val = trainer.validate()
    assert val["num_samples"] == 100 and set(val) >= {"val_loss", "last_val_loss", "val_accuracy"}
    state = trainer.state_dict()
    assert state["epoch"] == 4 and state["global_step"] == 4 * (13 if num_workers == 1 else 7)
    params = trainer.apply_all_operators(parameters_of)
    assert len(params) == num_workers
    for other in params[1:]:
        assert torch.equal(params[0], other)  # DDP replicas hold identical parameters
    model = trainer.get_model()
    assert isinstance(model, nn.Linear)  # unwrapped, no DDP
    assert torch.equal(torch.cat([p.reshape(-1) for p in model.parameters()]), params[0])
    if not use_local:
        with pytest.raises(NotImplementedError, match="use_local=True"):
            trainer.get_local_operator()
        with pytest.raises(TypeError, match="schedulers"):
            trainer.update_scheduler(1.0)  # LinearOperator registers no scheduler


def test_validation_over_two_workers_equals_one_process(make_trainer):
    config = {"n": 240, "batch_size": 16}
    one = make_trainer(training_operator_cls=ClassifierOperator, num_workers=1, config=config)
    two = make_trainer(training_operator_cls=ClassifierOperator, num_workers=2, config=config)
    a, b = one.validate(), two.validate()
    assert b["num_samples"] == a["num_samples"] == 240  # exact shards: no padded duplicates
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-6)
    assert b["val_accuracy"] == pytest.approx(a["val_accuracy"], rel=1e-6)
    per_worker = two.validate(reduce_results=False)
    assert [w["num_samples"] for w in per_worker] == [120, 120]


def test_exact_validation_shards_with_uneven_split(make_trainer):
    trainer = make_trainer(training_operator_cls=ClassifierOperator, num_workers=3, config={"n": 100})
    assert [w["num_samples"] for w in trainer.validate(reduce_results=False)] == [34, 33, 33]
    assert trainer.validate()["num_samples"] == 100


def test_batch_size_is_split_among_workers(make_trainer):
    trainer = make_trainer(num_workers=2, config={BATCH_SIZE: 21, "data_size": 200})
    assert trainer.config[BATCH_SIZE] == 20
    assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [10, 10]
    assert trainer.train()["batch_count"] == 10  # 100 samples per worker in batches of 10
    with pytest.raises(TypeError):
        trainer.config[BATCH_SIZE] = 5  # read-only


def test_save_load_and_state_dict_round_trips_are_exact(make_trainer, tmp_path):
    trainer = make_trainer(num_workers=2, config={"lr": 0.02, "momentum": 0.9})
    trainer.train()
    trainer.train()
    path = trainer.save(str(tmp_path / "checkpoint"))
    saved = trainer.state_dict()
    expected_next = trainer.train()
    trainer.shutdown()

    restored = make_trainer(num_workers=2, config={"lr": 0.02, "momentum": 0.9, "seed": 123})
    restored.load(path)
    loaded = restored.state_dict()
    assert loaded["epoch"] == saved["epoch"] == 2
    for a, b in zip(loaded["models"][0].values(), saved["models"][0].values()):
        assert torch.equal(a, b)
    assert loaded["optimizers"][0]["state"][0]["momentum_buffer"].equal(
        saved["optimizers"][0]["state"][0]["momentum_buffer"])
    assert restored.train() == expected_next  # same state, same data: the same next epoch
    restored.shutdown()

    again = make_trainer(num_workers=1, config={"lr": 0.02, "momentum": 0.9, "seed": 5})
    again.load_state_dict(saved, blocking=True)
    assert torch.equal(again.get_model().weight, saved["models"][0]["weight"])


def test_get_model_to_cpu_returns_copies(make_trainer):
    trainer = make_trainer(num_workers=1, use_local=True)
    live = trainer.get_model()
    assert live is trainer.get_local_operator().model
    copy = trainer.get_model(to_cpu=True)
    assert copy is not live and torch.equal(copy.weight, live.weight)
    with torch.no_grad():
        copy.weight.add_(1.0)
    assert not torch.equal(copy.weight, live.weight)


def test_local_rank_0_lives_in_the_driver(make_trainer):
    trainer = make_trainer(num_workers=2, use_local=True, num_cpus_per_worker=2)
    pids = [pid for pid, _ in trainer.apply_all_workers(pid_and_threads)]
    assert pids[0] == os.getpid() and pids[1] != os.getpid()
    assert trainer.apply_all_workers(pid_and_threads)[1][1] == 2  # the remote worker uses its 2 CPUs


def test_workers_use_their_cpus_and_run_the_hook(make_trainer):
    def hook():
        os.environ["RAYSGD_HOOK_RAN"] = "yes"

    for num_workers in (1, 2):
        trainer = make_trainer(num_workers=num_workers, num_cpus_per_worker=2 if num_workers == 1 else 1,
                               initialization_hook=hook)
        assert trainer.apply_all_workers(lambda: os.environ.get("RAYSGD_HOOK_RAN")) == ["yes"] * num_workers
        threads = [t for _, t in trainer.apply_all_workers(pid_and_threads)]
        assert threads == [2] if num_workers == 1 else threads == [1, 1]
        trainer.shutdown()


def test_distributed_sampler_reshuffles_every_epoch(make_trainer):
    class Recording(LinearOperator):
        def train_batch(self, batch, batch_info):
            self.seen = getattr(self, "seen", []) + batch[0].view(-1).tolist()
            return super().train_batch(batch, batch_info)

    trainer = make_trainer(training_operator_cls=Recording, num_workers=2, config={"shuffle": True, "data_size": 40})
    orders = []
    for _ in range(2):
        trainer.apply_all_operators(lambda op: setattr(op, "seen", []))
        trainer.train()
        orders.append(trainer.apply_all_operators(lambda op: op.seen))
    (epoch0_rank0, epoch0_rank1), (epoch1_rank0, _) = orders
    assert sorted(epoch0_rank0 + epoch0_rank1) == sorted(x / 4 for x in range(40))  # each sample once
    assert epoch0_rank0 != epoch1_rank0


def test_num_steps_profile_and_unreduced_results(make_trainer):
    trainer = make_trainer(num_workers=2, config={"data_size": 200})
    stats = trainer.train(num_steps=3, profile=True)
    assert stats["batch_count"] == 3 and stats["num_samples"] == 2 * 3 * 16
    assert {"mean_train_epoch_s", "mean_fwd_s", "mean_grad_s", "mean_apply_s"} <= set(stats["profile"])
    per_worker = trainer.train(num_steps=2, reduce_results=False)
    assert isinstance(per_worker, list) and len(per_worker) == 2 and per_worker[0]["num_samples"] == 32
    assert "profile" in trainer.validate(num_steps=1, profile=True)


def test_num_steps_is_checked_in_the_driver_before_any_work(make_trainer):
    trainer = make_trainer(num_workers=1, use_local=True, config={"data_size": 64})
    for call in (trainer.train, trainer.validate):
        for bad, error in ((-1, ValueError), (2.5, TypeError), ("2", TypeError), (True, TypeError)):
            with pytest.raises(error, match=rf"num_steps expects None or an int >= 0.*; got {bad!r}"):
                call(num_steps=bad)
    assert trainer.state_dict()["global_step"] == 0  # nothing ran
    assert trainer.train(num_steps=0)["num_samples"] == 0  # 0 is allowed: no batch (1.x's islice(0))
    assert trainer.train(num_steps=2)["num_samples"] == 32 and trainer.state_dict()["global_step"] == 2


def test_custom_loops_and_info(make_trainer):
    def custom(op, iterator, info):
        return {"batches": len(list(iterator)), "marker": info.get("marker"), "rank": op.world_rank}

    trainer = make_trainer(training_operator_cls=get_test_operator(LinearOperator), num_workers=2,
                           config={"custom_func": custom, "data_size": 64})
    info = {"marker": 9}
    stats = trainer.train(info=info, reduce_results=False)
    assert [s["rank"] for s in stats] == [0, 1] and stats[0]["marker"] == 9 and stats[0]["batches"] == 2
    assert info == {"marker": 9}
    assert trainer.validate(reduce_results=False)[1]["rank"] == 1


def test_custom_ddp_wrapper_with_wrap_ddp_false(make_trainer):
    class CustomWrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args):
            return self.module(*args)

    class Op(LinearOperator):
        def setup(self, config):
            super().setup(config)
            self.new_model = CustomWrapper(self.model)

        def train_batch(self, batch, batch_info):
            x, y = batch
            loss = self.criterion(self.new_model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            return {"loss": loss.item(), "wrapped": type(self.model).__name__}

    trainer = make_trainer(training_operator_cls=Op, num_workers=2, wrap_ddp=False)
    assert trainer.train()["wrapped"] == "Linear"  # (wrapped by default: test_train_validate_metrics_and_state)


def test_self_model_passed_to_register_trains_the_ddp_wrapper(make_trainer):
    """setup() keeps ``self.model`` (the plain module) and ignores register's return: still synchronised."""
    class KeepsOwnModel(TrainingOperator):
        def setup(self, config):
            torch.manual_seed(0)
            self.model = nn.Linear(1, 1)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.criterion = nn.MSELoss()
            self.register(models=self.model, optimizers=self.optimizer, criterion=self.criterion)
            x = torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
            self.register_data(train_loader=DataLoader(TensorDataset(x, 3 * x + 1), batch_size=8))

    trainer = make_trainer(training_operator_cls=KeepsOwnModel, num_workers=2, use_local=True)
    trainer.train()
    assert trainer.apply_all_operators(lambda op: type(op.model).__name__) == ["Linear"] * 2  # as the user set it
    params = trainer.apply_all_operators(parameters_of)
    assert torch.equal(params[0], params[1])  # gradients were averaged: the replicas stayed identical


def test_update_scheduler_manual(make_trainer):
    class Plateau(LinearOperator):
        def setup(self, config):
            super().setup(config)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(self.optimizer, factor=0.5, patience=0)
            self.register(models=self.model, optimizers=self.optimizer, criterion=self.criterion, schedulers=sched)

    trainer = make_trainer(training_operator_cls=Plateau, num_workers=2, scheduler_step_freq="manual",
                           config={"lr": 0.1})
    trainer.update_scheduler(1.0)
    trainer.update_scheduler(2.0)
    assert trainer.apply_all_operators(lambda op: op.optimizer.param_groups[0]["lr"]) == [0.05, 0.05]
    # (without a registered scheduler it raises: test_train_validate_metrics_and_state)


def test_missing_validation_loader_and_shutdown(make_trainer):
    class NoValidation(TrainingOperator):
        def setup(self, config):
            model = nn.Linear(1, 1)
            self.model, self.optimizer, self.criterion = self.register(
                models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.MSELoss())
            self.register_data(train_loader=DataLoader(TensorDataset(torch.ones(4, 1), torch.ones(4, 1))))

    trainer = make_trainer(training_operator_cls=NoValidation, num_workers=2)
    assert trainer.train()["num_samples"] == 4
    with pytest.raises(RuntimeError, match=r"register_data\(validation_loader=...\)"):
        trainer.validate()
    trainer.shutdown()
    for call in (trainer.train, trainer.validate, trainer.get_model, trainer.state_dict):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    trainer.shutdown()  # twice is fine


def test_user_error_in_training_keeps_its_type_and_trainer_recovers(make_trainer):
    class Fails(LinearOperator):
        def train_batch(self, batch, batch_info):
            if self.config.get("fail") and batch_info["batch_idx"] == 1:
                raise ValueError(f"bad batch on rank {self.world_rank}")
            return super().train_batch(batch, batch_info)

    trainer = make_trainer(training_operator_cls=Fails, num_workers=2, config={"fail": True})
    with pytest.raises(ValueError, match="bad batch on rank"):
        trainer.train(max_retries=3)
    assert trainer.num_failures == 0  # a user error is not a worker failure: not retried
    trainer.apply_all_operators(lambda op: op.config.update(fail=False))
    assert trainer.train()["num_samples"] == 200
