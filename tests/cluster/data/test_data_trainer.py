"""Data on real workers: custom samplers sharded, validation on ranks with no batches, iterators after errors."""
import itertools
import logging

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Sampler, SubsetRandomSampler

from raysgd import TrainingOperator
from raysgd.utils import DATA_SEED

pytestmark = pytest.mark.usefixtures("ray_4cpus")


class IndexDataset(Dataset):
    """Sample ``i`` is ``([i, i % 2], i % 2)``: the index travels with the batch."""

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return torch.tensor([float(index), float(index % 2)]), index % 2


class Endless(Sampler):
    """Endless indices from its own generator and no length, like detectron2's TrainingSampler.

    It raises (failing the test instead of hanging it) once drawn 50,000 deep: it is being materialised.
    """

    def __init__(self, size):
        self.size = size

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for drawn in itertools.count(1):
            if drawn > 50_000:
                raise RuntimeError("Endless was drawn 50,000 indices deep for a few batches")
            yield int(torch.randint(self.size, (1,), generator=generator))


class Recording(TrainingOperator):
    """A BatchNorm classifier that records the indices each rank trains and validates on.

    config: size, train_idx (SubsetRandomSampler) or endless (an Endless sampler), val_idx (SubsetRandomSampler)
    or val_size (plain validation loader),
    val_batch, val_drop_last, fail_at ({"phase": ..., "batch": ...}: raise ValueError there).
    """

    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        if config.get("compile"):  # trained as compile(DDP(model)): the DDP inside must still be found
            model = torch.compile(model, backend="eager")
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.05), criterion=nn.CrossEntropyLoss())
        dataset = IndexDataset(config.get("size", 60))
        sampler = Endless(len(dataset)) if config.get("endless") else SubsetRandomSampler(config["train_idx"])
        train = DataLoader(dataset, batch_size=4, sampler=sampler)
        if "val_idx" in config:
            val = DataLoader(dataset, batch_size=4, sampler=SubsetRandomSampler(config["val_idx"]))
        else:
            val = DataLoader(IndexDataset(config["val_size"]), batch_size=config.get("val_batch", 4),
                             drop_last=config.get("val_drop_last", False))
        self.register_data(train_loader=train, validation_loader=val)
        self.seen = {"train": [], "validate": []}
        self.fail_at = None

    def _record(self, phase, batch, batch_info):
        if self.fail_at == (phase, batch_info["batch_idx"]):
            raise ValueError(f"user code failed in {phase} at batch {batch_info['batch_idx']}")
        self.seen[phase] += [int(i) for i in batch[0][:, 0]]

    def train_batch(self, batch, batch_info):
        self._record("train", batch, batch_info)
        return super().train_batch(batch, batch_info)

    def validate_batch(self, batch, batch_info):
        self._record("validate", batch, batch_info)
        return super().validate_batch(batch, batch_info)


def take_seen(op):
    seen, op.seen = op.seen, {"train": [], "validate": []}
    return seen


def set_fail_at(where):
    def apply(op):
        op.fail_at = where

    return apply


@pytest.fixture
def make_trainer(trainer_factory):
    return lambda config, **kwargs: trainer_factory(**{"training_operator_cls": Recording, "timeout_s": 30,
                                                       "config": config, **kwargs})


def test_the_loaders_own_samplers_are_sharded_across_two_workers(make_trainer):
    train_idx = [i for i in range(60) if i % 3 != 0]  # 40 indices
    val_idx = list(range(0, 60, 3))[:-1]  # 19 indices: the shards differ by one
    trainer = make_trainer({"train_idx": train_idx, "val_idx": val_idx, DATA_SEED: 7}, num_workers=2)
    assert trainer.apply_all_operators(lambda op: op._train_loader.sampler.seed) == [7, 7]
    stats = trainer.train()
    val = trainer.validate()
    seen = trainer.apply_all_operators(take_seen)
    trained = [s["train"] for s in seen]
    validated = [s["validate"] for s in seen]
    assert not set(trained[0]) & set(trained[1]) and sorted(trained[0] + trained[1]) == train_idx
    assert not set(validated[0]) & set(validated[1]) and sorted(validated[0] + validated[1]) == val_idx
    assert stats["num_samples"] == 40 and val["num_samples"] == 19
    trainer.train()  # a new epoch: a new order, still exactly the training indices
    again = [s["train"] for s in trainer.apply_all_operators(take_seen)]
    assert sorted(again[0] + again[1]) == train_idx and again != trained


@pytest.mark.parametrize("val_size, val_batch, drop_last, compiled",
                         [(2, 4, False, False), (3, 2, True, False), (2, 4, False, True)],
                         ids=["fewer-samples-than-workers", "drop_last", "torch.compile"])
def test_a_rank_without_validation_batches_hangs_nobody(make_trainer, val_size, val_batch, drop_last, compiled):
    config = {"train_idx": list(range(24)), "val_size": val_size, "val_batch": val_batch, "val_drop_last": drop_last,
              "compile": compiled}
    trainer = make_trainer(config, num_workers=3, timeout_s=15)
    trainer.train()  # the next forward would broadcast BatchNorm's buffers
    per_rank = trainer.validate(reduce_results=False)
    assert [r["batch_count"] for r in per_rank] == [1, 1, 0]
    assert trainer.num_failures == 0
    val = trainer.validate()
    model = trainer.get_model().eval()
    dataset = IndexDataset(val_size)
    kept = [dataset[i] for i in range(2)]  # drop_last: one process's full batch [0, 1] of 3 samples, sharded
    with torch.no_grad():
        losses = nn.CrossEntropyLoss(reduction="none")(model(torch.stack([x for x, _ in kept])),
                                                       torch.tensor([y for _, y in kept]))
    assert val["num_samples"] == 2
    assert val["val_loss"] == pytest.approx(losses.mean().item(), rel=1e-5)  # exactly one process's metric
    assert trainer.num_failures == 0


def test_an_endless_sampler_trains_num_steps_lazily_sharded(make_trainer, caplog):
    stream = list(itertools.islice(iter(Endless(60)), 80))
    trainer = make_trainer({"endless": True, "val_size": 8}, num_workers=2, use_local=True, commit_every_n_steps=2)
    with caplog.at_level(logging.WARNING, logger="raysgd.torch.commits.committer"):
        stats = trainer.train(num_steps=5)
    assert stats["num_samples"] == 40 and trainer.num_failures == 0
    assert "no data cursor" in caplog.text  # commits inside such an epoch are skipped, with a warning
    assert [s["train"] for s in trainer.apply_all_operators(take_seen)] == [stream[0:40:2], stream[1:40:2]]
    trainer.train(num_steps=5)  # the same endless epoch goes on
    assert [s["train"] for s in trainer.apply_all_operators(take_seen)] == [stream[40:80:2], stream[41:80:2]]


def test_after_a_user_error_the_next_call_starts_a_fresh_iterator(make_trainer):
    trainer = make_trainer({"train_idx": list(range(32)), "val_size": 24}, num_workers=2)
    trainer.apply_all_operators(set_fail_at(("validate", 1)))
    with pytest.raises(ValueError, match="validate at batch 1"):
        trainer.validate()
    trainer.apply_all_operators(set_fail_at(None))
    trainer.apply_all_operators(take_seen)
    val = trainer.validate()
    assert val["num_samples"] == 24 and val["batch_count"] == 3  # not the rest of the broken pass
    validated = [s["validate"] for s in trainer.apply_all_operators(take_seen)]
    assert sorted(validated[0] + validated[1]) == list(range(24))

    trainer.apply_all_operators(set_fail_at(("train", 2)))
    with pytest.raises(ValueError, match="train at batch 2"):
        trainer.train(max_retries=0)  # no snapshot to restore: the workers themselves must drop the iterator
    trainer.apply_all_operators(set_fail_at(None))
    first = [s["train"] for s in trainer.apply_all_operators(take_seen)]
    stats = trainer.train()
    assert stats["num_samples"] == 32 and stats["epoch"] == 1  # the failed epoch starts again, in full
    second = [s["train"] for s in trainer.apply_all_operators(take_seen)]
    assert [s[:8] for s in second] == first  # the same order as the abandoned pass
    assert sorted(second[0] + second[1]) == list(range(32))
