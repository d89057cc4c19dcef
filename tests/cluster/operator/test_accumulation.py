"""fixed_worker_batch: the same global batch at every size, by accumulating micro-batches under DDP's no_sync."""
import time

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

from helpers import stored_commit
from raysgd import TorchTrainer, TrainingOperator
from raysgd.utils import BATCH_SIZE

pytestmark = pytest.mark.usefixtures("ray_2cpus")

N, GLOBAL, MAX, LR = 36, 8, 4, 0.1  # per worker 2; 1 worker: k=4; 2 workers: k=2; each epoch ends on a partial step


def dataset():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(N, 3, generator=generator)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3 * torch.randn(N, 1, generator=generator))


class CountingSyncOperator(TrainingOperator):
    """A linear model on sequential data; counts the calls of DDP's communication hook (one bucket: one per sync)."""

    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=LR), criterion=nn.MSELoss())
        self.register_data(train_loader=DataLoader(dataset(), batch_size=config[BATCH_SIZE]))
        self.syncs = [0]
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            def counting(state, bucket):
                self.syncs[0] += 1
                return default_hooks.allreduce_hook(state, bucket)

            self.model.register_comm_hook(None, counting)


def expected_parameters(epochs):
    """Plain SGD on global batches of GLOBAL in order; the last batch of an epoch holds the N % GLOBAL left."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = dataset()
    for _ in range(epochs):
        for start in range(0, N, GLOBAL):
            x, y = data[start:start + GLOBAL]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return model.state_dict()


def run(trainer_factory, cpus_per_worker, epochs=2, **kwargs):
    trainer = trainer_factory(training_operator_cls=CountingSyncOperator, num_workers=(1, MAX),
                              num_cpus_per_worker=cpus_per_worker, fixed_worker_batch=True,
                              config={BATCH_SIZE: GLOBAL}, timeout_s=30, **kwargs)
    stats = [trainer.train() for _ in range(epochs)]
    return trainer, stats


def check_parameters(trainer, epochs):
    got, want = trainer.state_dict()["models"][0], expected_parameters(epochs)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), (name, got[name], want[name])


def test_one_worker_accumulates_to_the_global_batch(trainer_factory):
    trainer, stats = run(trainer_factory, cpus_per_worker=2, commit_every_n_steps=0)  # only 1 fits: k=4
    info = trainer.apply_all_operators(lambda op: (op.accumulation_steps, op.config[BATCH_SIZE], op.global_step))
    assert info == [(4, 2, 10)]  # 5 optimizer steps an epoch (4 full, 1 partial), not 18
    assert trainer.config[BATCH_SIZE] == GLOBAL and stats[-1]["num_samples"] == N
    check_parameters(trainer, epochs=2)


def test_two_workers_skip_the_allreduce_on_inner_steps_and_commit_on_step_boundaries(trainer_factory):
    trainer, _ = run(trainer_factory, cpus_per_worker=1, commit_every_n_steps=1)  # 2 workers: k=2
    info = trainer.apply_all_operators(lambda op: (op.accumulation_steps, op.global_step, op.syncs[0]))
    # 9 micro-batches an epoch per rank: DDP syncs at 4 step ends (the partial step is averaged by the flush).
    assert info == [(2, 10, 8), (2, 10, 8)]
    check_parameters(trainer, epochs=2)
    commit = stored_commit(trainer, 8)  # the last step's commit may still be on its way when train() returns
    assert commit["cursor"]["steps"] == 8  # never between the micro-batches of one step (9 would be)


def test_a_commit_taken_on_two_workers_resumes_on_one_with_the_same_global_batch(trainer_factory):
    first, _ = run(trainer_factory, cpus_per_worker=1, epochs=0, commit_every_n_steps=4)  # 2 workers: k=2
    first.train(num_steps=4)  # 2 optimizer steps; a commit after the 4th micro-batch (16 samples)
    deadline = time.monotonic() + 30  # the commit is stored in the background
    while (commit := first.latest_commit()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert commit is not None and commit["cursor"]["consumed"] == 16
    first.shutdown()
    second, _ = run(trainer_factory, cpus_per_worker=2, epochs=0, commit_every_n_steps=0)  # 1 worker: k=4
    second.load_state_dict(commit)
    assert second.train()["num_samples"] == N  # the whole epoch 0: the 16 committed samples and the rest, once each
    assert second.train()["num_samples"] == N
    assert second.apply_all_operators(lambda op: (op.accumulation_steps, op.global_step)) == [(4, 10)]
    check_parameters(second, epochs=2)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"fixed_worker_batch": "yes"}, TypeError, "fixed_worker_batch expects True or False; got 'yes'"),
    ({"config": {BATCH_SIZE: 6}}, ValueError, "multiple of the maximum number of workers (4)"),
    ({"use_fp16": "apex"}, ValueError, "got use_fp16='apex'"),
])
def test_bad_values_are_rejected_before_any_actor_starts(kwargs, error, words, monkeypatch):
    import raysgd.torch.torch_trainer as torch_trainer

    def no_workers(*args, **kw):
        raise AssertionError("a worker group was built")

    monkeypatch.setattr(torch_trainer, "WorkerGroup", no_workers)
    arguments = {"training_operator_cls": CountingSyncOperator, "num_workers": (1, MAX), "fixed_worker_batch": True,
                 "config": {BATCH_SIZE: GLOBAL}, **kwargs}
    with pytest.raises(error) as raised:
        TorchTrainer(**arguments)
    assert words in str(raised.value)
