"""With several optimizers, ``GradScaler.update()`` runs once per iteration (precision helpers and the DCGAN example).

A real ``torch.amp.GradScaler("cpu")`` stands in for CUDA's: ``Precision`` only enables the scaler on CUDA,
so the tests put an enabled CPU scaler that counts its calls in its place. No Ray: one process.
"""
import pytest
import torch

from raysgd.torch.operator.precision import Precision
from raysgd.torch.execution.worker import TorchWorker
from raysgd.utils import BATCH_SIZE


class CountingScaler(torch.amp.GradScaler):
    """A real, enabled CPU GradScaler that records ``step`` and ``update`` calls in order."""

    def __init__(self):
        super().__init__("cpu", init_scale=2.0 ** 8, growth_interval=1)
        self.calls = []

    def step(self, optimizer, *args, **kwargs):
        self.calls.append("step")
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls.append("update")
        return super().update(new_scale)


def two_models():
    torch.manual_seed(0)
    first, second = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    return first, second, torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)


def test_step_with_update_false_then_one_update():
    precision = Precision(False)
    precision.scaler = scaler = CountingScaler()
    first, second, opt_1, opt_2 = two_models()
    for _ in range(3):
        for model, optimizer, update in ((first, opt_1, False), (second, opt_2, True)):
            optimizer.zero_grad()
            precision.backward(model(torch.ones(4, 3)).pow(2).mean())
            precision.step(optimizer, update=update)
    assert scaler.calls == ["step", "step", "update"] * 3
    assert scaler.get_scale() == 2.0 ** 11  # grew once per iteration (growth_interval=1), not twice


def test_step_of_several_optimizers_and_update_scale():
    precision = Precision(False)
    precision.scaler = scaler = CountingScaler()
    first, second, opt_1, opt_2 = two_models()
    precision.backward(first(torch.ones(2, 3)).sum() + second(torch.ones(2, 3)).sum())
    precision.step(opt_1, opt_2)
    assert scaler.calls == ["step", "step", "update"]
    precision.backward(first(torch.ones(2, 3)).sum())
    precision.step(opt_1, update=False)
    precision.update_scale()
    assert scaler.calls[3:] == ["step", "update"]


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory):
    pytest.importorskip("sklearn", reason="the DCGAN example reads scikit-learn's digits")
    from raysgd.torch.examples.dcgan import train_classifier

    return train_classifier(str(tmp_path_factory.mktemp("dcgan") / "classifier.pt"), epochs=5)


def test_dcgan_operator_updates_the_scale_once_per_iteration(classifier_path):
    from raysgd.torch.examples.dcgan import GANOperator

    worker = TorchWorker(GANOperator, {BATCH_SIZE: 16, "limit": 64, "classification_model_path": classifier_path},
                         is_local=True)
    worker.setup_operator()
    worker.operator._precision.scaler = scaler = CountingScaler()
    stats = worker.train_epoch(num_steps=3)
    assert stats["num_samples"] == 48
    assert scaler.calls.count("update") == 3  # was 6: each backward_and_step updated the scale
    assert scaler.calls == ["step", "step", "update"] * 3
