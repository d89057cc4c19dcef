"""1.x's ``raysgd.data.Dataset`` (``ray.util.sgd.data``) through ``train(dataset=...)``, and mlp_identity's smoke run.

One local 4-CPU Ray cluster for the module (2 workers, CPUs left for Ray Data's tasks).
"""
import pytest
import torch

pytest.importorskip("ray.data", reason="needs ray[data]")

from raysgd import TorchTrainer, TrainingOperator  # noqa: E402
from raysgd.data import Dataset  # noqa: E402
from raysgd.data.dataset import ConcatBatch  # noqa: E402
from raysgd.utils import NUM_SAMPLES  # noqa: E402


class SeenOperator(TrainingOperator):
    """Records the batches each worker trained on (no model update needed)."""

    def setup(self, config):
        model = torch.nn.Linear(1, 1)
        self.model, self.optimizer = self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), 0.0))

    def train_batch(self, batch, batch_info):
        x, y = batch
        return {NUM_SAMPLES: len(x), "shapes": f"{tuple(x.shape)}|{tuple(y.shape)}",
                "seen": ",".join(str(int(v)) for v in y.flatten().tolist()), "x_sum": float(x.sum())}

    def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
        seen, shapes, count, x_sum = [], set(), 0, 0.0
        for index, batch in enumerate(iterator):
            out = self.train_batch(batch, {"batch_idx": index})
            seen.append(out["seen"])
            shapes.add(out["shapes"])
            count += out[NUM_SAMPLES]
            x_sum += out["x_sum"]
        return {NUM_SAMPLES: count, "batches": len(seen), "seen": ";".join(seen), "shapes": sorted(shapes),
                "x_sum": x_sum}


def pair(i):
    return torch.tensor([[float(i), float(i)]]), torch.tensor([float(i)])  # x: (1, 2), y: (1,)


def test_arguments_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="batch_size"):
        Dataset([1], batch_size=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        Dataset([1], max_concurrency=-1)
    with pytest.raises(TypeError, match="download_func"):
        Dataset([1], download_func="not callable")
    with pytest.raises(TypeError, match="iterable"):
        Dataset(5)
    with pytest.raises(ValueError, match="empty"):
        Dataset([])


def test_batches_concatenate_like_1x_with_the_transform_on_inputs_only():
    convert = ConcatBatch(transform=lambda x: x * 10)
    x, y = convert({"x": torch.ones(3, 1, 2), "y": torch.ones(3, 1)})
    assert x.shape == (3, 2) and float(x.sum()) == 60.0 and y.shape == (3,) and float(y.sum()) == 3.0


def test_one_shard_per_worker_and_num_steps_per_call(ray_4cpus):
    dataset = Dataset(list(range(20)), batch_size=4, max_concurrency=2, download_func=pair, transform=lambda x: -x)
    # timeout_s also bounds the wait for each batch: Ray Data's first tasks start new processes (slow on a busy host)
    trainer = TorchTrainer(training_operator_cls=SeenOperator, num_workers=2, timeout_s=300, use_gpu=False)
    try:
        # One pass: 10 items per worker -> batches of 4, 4, 2; disjoint shards covering every item once.
        stats = trainer.train(dataset=dataset, num_steps=3, reduce_results=False)
        assert [s["batches"] for s in stats] == [3, 3] and [s[NUM_SAMPLES] for s in stats] == [10, 10]
        items = [[int(v) for v in s["seen"].replace(";", ",").split(",")] for s in stats]
        assert sorted(items[0] + items[1]) == list(range(20)) and not set(items[0]) & set(items[1])
        assert stats[0]["shapes"] == ["(2, 2)|(2,)", "(4, 2)|(4,)"]  # torch.cat of (1, 2) inputs and (1,) labels
        assert stats[0]["x_sum"] == -2 * sum(items[0])  # the transform ran on the inputs, not on the labels

        # num_steps beyond one pass: the shard is read again (1.12 repeated it), exactly 7 batches per worker.
        stats = trainer.train(dataset=dataset, num_steps=7, reduce_results=False)
        assert [s["batches"] for s in stats] == [7, 7]
        assert [s[NUM_SAMPLES] for s in stats] == [4 + 4 + 2 + 4 + 4 + 2 + 4] * 2

        # num_steps=None reads each shard once (1.12's endless shards never finished).
        stats = trainer.train(dataset=dataset)
        assert stats[NUM_SAMPLES] == 20
    finally:
        trainer.shutdown()


def test_get_shard_in_the_driver(ray_4cpus):
    dataset = Dataset([pair(i) for i in range(6)], batch_size=2)
    dataset.set_num_shards(2)
    shard = dataset.get_shard(1)
    batches = [next(shard) for _ in range(3)]  # endless: the second pass starts over
    assert [[int(y) for _, y in batch] for batch in batches] == [[1, 3], [5, 1], [3, 5]]
    with pytest.raises(IndexError, match="set_num_shards"):
        next(dataset.get_shard(2))


def test_mlp_identity_smoke_run(ray_4cpus):
    from raysgd.data.examples import mlp_identity

    prediction = mlp_identity.main(["--smoke-test", "--num-workers", "2"])
    assert 0.3 <= prediction <= 0.7, prediction  # learning f(x) = x: f(0.5) is near 0.5
