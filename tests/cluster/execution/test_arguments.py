"""Bad input: clear errors before any actor starts, and nothing left behind."""
import pytest
import torch
import torch.nn as nn

from conftest import assert_released
from helpers import LinearOperator
from raysgd import PyTorchTrainer, TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE, DATA_SEED

pytestmark = pytest.mark.usefixtures("ray_2cpus")


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_workers=0), ValueError, ["num_workers", "int >= 1", "0"]),
    (dict(num_workers=1.5), TypeError, ["num_workers", "1.5"]),
    (dict(training_operator_cls=nn.Linear), TypeError, ["training_operator_cls", "TrainingOperator", "Linear"]),
    (dict(training_operator_cls=None), TypeError, ["training_operator_cls", "None"]),
    (dict(config=[("lr", 1)]), TypeError, ["config", "dict", "[('lr', 1)]"]),
    (dict(scheduler_step_freq="weekly"), ValueError, ["scheduler_step_freq", "'batch'", "'weekly'"]),
    (dict(scheduler_step_freq=["batch"]), ValueError, ["scheduler_step_freq", "'epoch'", "['batch']"]),  # unhashable
    (dict(use_fp16="fp8"), ValueError, ["use_fp16", "'bf16'", "'fp8'"]),
    (dict(backend="mpi"), ValueError, ["backend", "'gloo'", "'mpi'"]),
    (dict(backend="nccl", use_gpu=False), ValueError, ["backend", "nccl", "GPU"]),
    (dict(use_gpu="yes"), ValueError, ["use_gpu", "'auto'", "'yes'"]),
    (dict(timeout_s=0), ValueError, ["timeout_s", "> 0", "0"]),
    (dict(timeout_s=float("inf")), ValueError, ["timeout_s", "finite", "inf"]),  # failed in the workers
    (dict(timeout_s=1e12), ValueError, ["timeout_s", "at most", "1000000000000.0"]),  # a thread cannot wait so long
    (dict(num_cpus_per_worker=float("inf")), ValueError, ["num_cpus_per_worker", "finite", "inf"]),
    (dict(num_cpus_per_worker=-1), ValueError, ["num_cpus_per_worker", "-1"]),
    (dict(num_gpus_per_worker=1.5), ValueError, ["num_gpus_per_worker", "fraction", "1.5"]),
    (dict(num_gpus_per_worker=0), ValueError, ["num_gpus_per_worker", "whole number", "0"]),
    (dict(num_gpus_per_worker=True), ValueError, ["num_gpus_per_worker", "True"]),
    (dict(num_gpus_per_worker=0.5, use_gpu=False), ValueError, ["num_gpus_per_worker", "use_gpu=False", "0.5"]),
    (dict(num_gpus_per_worker=0.5, use_gpu=True, backend="nccl"), ValueError, ["backend", "gloo", "0.5", "nccl"]),
    (dict(initialization_hook="setup.sh"), TypeError, ["initialization_hook", "callable", "setup.sh"]),
    (dict(initialization_hook=lambda config: None), TypeError,  # failed on every worker, once started
     ["initialization_hook", "no arguments", "<lambda>(config)"]),
    (dict(training_operator_cls=TrainingOperator), TypeError,  # NotImplementedError on every worker, once started
     ["training_operator_cls", "implements setup(self, config)", "TrainingOperator"]),
    (dict(use_local="no"), TypeError, ["use_local", "'no'"]),
    (dict(config={BATCH_SIZE: "64"}), ValueError, ["BATCH_SIZE", "'64'"]),
    (dict(config={DATA_SEED: "7"}), TypeError, ["DATA_SEED", "int", "'7'"]),
    (dict(num_worker=2), TypeError, ["num_worker"]),
])
def test_constructor_rejects_bad_arguments_before_starting_anything(kwargs, error, words):
    kwargs = {"training_operator_cls": LinearOperator, **kwargs}
    with pytest.raises(error) as info:
        TorchTrainer(**kwargs)
    for word in words:
        assert word in str(info.value)
    assert_released()


@pytest.mark.parametrize("name, value, words", [
    ("num_replicas", 2, "num_workers"), ("batch_size", 32, "BATCH_SIZE"), ("apex_args", {}, "register"),
    ("data_loader_args", {"shuffle": True}, "DataLoader"), ("model_creator", lambda c: None, "from_creators"),
    ("optimizer_creator", lambda m, c: None, "from_creators"), ("data_creator", lambda c: None, "from_creators"),
])
def test_deprecated_keywords_raise_helpful_deprecation_warnings(name, value, words):
    with pytest.raises(DeprecationWarning, match=words):
        TorchTrainer(training_operator_cls=LinearOperator, **{name: value})
    with pytest.raises(DeprecationWarning, match="TorchTrainer"):
        PyTorchTrainer()


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("problem, error, match", [
    ("scheduler", ValueError, "scheduler_step_freq"),
    ("ddp_args", ValueError, "ddp_args"),
    ("user", KeyError, "missing_key"),
])
def test_errors_in_setup_reach_the_caller_with_their_type_and_leave_nothing(num_workers, problem, error, match):
    class Broken(TrainingOperator):
        def setup(self, config):
            model = nn.Linear(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            if problem == "scheduler":
                self.register(models=model, optimizers=optimizer,
                              schedulers=torch.optim.lr_scheduler.StepLR(optimizer, 1))
            elif problem == "ddp_args":
                self.register(models=model, optimizers=optimizer, ddp_args="find_unused_parameters")
            else:
                config["missing_key"]

    with pytest.raises(error, match=match):
        TorchTrainer(training_operator_cls=Broken, num_workers=num_workers, timeout_s=30)
    assert_released()


def test_shutdown_releases_everything_and_later_use_says_so():
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, timeout_s=30)
    trainer.train(num_steps=1)
    trainer.shutdown()
    assert_released()
    with pytest.raises(RuntimeError, match="shut down.*new TorchTrainer"):
        trainer.train()
    with pytest.raises(RuntimeError, match="shut down"):
        trainer.worker_group.num_workers


def _refuse_to_unpickle():
    raise ValueError("this config cannot be rebuilt on a worker")


class _BuiltOnlyHere:
    """A config value whose unpickling (in the worker's constructor) raises."""

    def __reduce__(self):
        return _refuse_to_unpickle, ()


def test_a_worker_that_cannot_be_created_is_a_clear_error_keeping_its_cause():
    with pytest.raises(RuntimeError, match="could not be created") as info:
        TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, timeout_s=30,
                     config={"value": _BuiltOnlyHere()})
    assert "cannot be rebuilt on a worker" in str(info.value.__cause__)  # the constructor's own error is kept
    assert_released()
