"""``get_model(to_cpu=True)``: a separate CPU model, built without deep-copying any of the worker's tensors."""
import copy

import pytest
import torch

from raysgd.torch.state.model_copy import cpu_copy
from raysgd.torch.training_operator import TrainingOperator
from raysgd.torch.execution.worker import TorchWorker


class NoDeepcopyParameter(torch.nn.Parameter):
    """A parameter that refuses ``deepcopy``: the old ``copy.deepcopy(model).cpu()`` trips on it."""

    def __deepcopy__(self, memo):
        raise AssertionError("a worker's parameter was deep-copied (a second copy on its device)")


class NoDeepcopyTensor(torch.Tensor):
    def __deepcopy__(self, memo):
        raise AssertionError("a worker's buffer was deep-copied (a second copy on its device)")


def guarded_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3))
    model(torch.randn(8, 4)).sum().backward()  # gradients and BatchNorm running statistics
    for layer in (model[0], model[2]):
        layer.weight = NoDeepcopyParameter(layer.weight.detach().clone(), requires_grad=True)
        layer.weight.grad = torch.full_like(layer.weight, 0.5)
    model[1].running_mean = model[1].running_mean.as_subclass(NoDeepcopyTensor)
    return model.eval()


def test_the_guards_catch_a_deepcopy():
    with pytest.raises(AssertionError, match="deep-copied"):
        copy.deepcopy(guarded_model()).cpu()  # what get_models(to_cpu=True) did before


def test_cpu_copy_is_separate_equal_and_never_deepcopies_the_originals():
    model = guarded_model()
    copied = cpu_copy(model)
    assert copied is not model
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(copied(x), model(x))
    originals = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert not originals & {id(t) for t in [*copied.parameters(), *copied.buffers()]}
    assert all(p.device.type == "cpu" for p in copied.parameters())
    assert torch.equal(copied[0].weight.grad, model[0].weight.grad)  # gradients come along, as .cpu() kept them
    assert copied[0].weight.requires_grad and copied.training is False
    with torch.no_grad():
        copied[0].weight.fill_(7.0)
        copied[1].running_mean.fill_(7.0)
    assert not torch.equal(model[0].weight, copied[0].weight)
    assert not torch.equal(model[1].running_mean, copied[1].running_mean)


def test_tied_weights_stay_tied():
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    copied = cpu_copy(model)
    assert copied[1].weight is copied[0].weight and copied[0].weight is not model[0].weight


class GuardedOperator(TrainingOperator):
    def setup(self, config):
        model = guarded_model()
        self.model, self.optimizer = self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), 0.1))


def test_worker_get_models_to_cpu_uses_the_device_free_copy():
    worker = TorchWorker(GuardedOperator, {}, is_local=True)
    worker.setup_operator()
    [copied] = worker.get_models(to_cpu=True)  # raised AssertionError with copy.deepcopy(model).cpu()
    assert copied is not worker.operator.model
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(copied.eval()(x), worker.operator.model.eval()(x))
