"""train(dataset=...) with Ray Data: one streaming-split shard per worker, each sample once per epoch."""
import os
import time

import numpy as np
import pytest

from conftest import live_actors, live_placement_groups
from helpers import LinearOperator
from raysgd import TorchTrainer
from raysgd.torch.integrations.ray_data import DatasetInput, ShardCache, _with_deadline, as_input
from raysgd.utils import BATCH_SIZE

N = 200


class RecordingOperator(LinearOperator):
    """LinearOperator that records the x of every sample it trains on; dict batches are read as x, y columns.

    ``config["fault_marker"]``: once ``<marker>.armed`` exists, rank 1 exits at its third batch, once (it
    writes the marker first).
    """

    def setup(self, config):
        super().setup(config)
        self.seen = []

    def train_batch(self, batch, batch_info):
        if isinstance(batch, dict):
            batch = (batch["x"].view(-1, 1), batch["y"].view(-1, 1))
        marker = self.config.get("fault_marker")
        if marker and self.world_rank == 1 and batch_info["batch_idx"] == 2 and os.path.exists(marker + ".armed") \
                and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        self.seen.extend(batch[0].view(-1).tolist())
        return super().train_batch(batch, batch_info)


def linear_items(n=N):
    return [{"x": i / n, "y": 2 * i / n + 5} for i in range(n)]


def take_seen(trainer):
    """Every worker's recorded x values since the last call (then forgotten)."""
    seen = trainer.apply_all_operators(lambda op: list(op.seen))
    trainer.apply_all_operators(lambda op: op.seen.clear())
    return seen


def assert_each_sample_once(seen, n=N):
    assert [len(part) for part in seen] == [n // len(seen)] * len(seen)  # equal shards
    everything = np.sort(np.concatenate([np.asarray(part, dtype=np.float32) for part in seen]))
    assert np.array_equal(everything, np.sort(np.arange(n, dtype=np.float64) / n).astype(np.float32))


@pytest.fixture(scope="module")
def fault_marker(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fault") / "died")


@pytest.fixture(scope="module")
def trainer(ray_2cpus, fault_marker):
    """Rank 0 in this process, rank 1 an actor: both ways a shard travels (by reference, pickled)."""
    trainer = TorchTrainer(training_operator_cls=RecordingOperator, num_workers=2, use_local=True, timeout_s=60,
                           config={BATCH_SIZE: 20, "lr": 0.1, "fault_marker": fault_marker})
    yield trainer
    trainer.shutdown()


def test_each_sample_once_per_epoch_and_num_steps(trainer):
    import ray

    data = DatasetInput(ray.data.from_items(linear_items()), label_column="y", label_shape=(1,))
    losses = []
    for epoch in (1, 2):
        stats = trainer.train(dataset=data)
        assert stats["num_samples"] == N and stats["batch_count"] == N / 2 / 10  # BATCH_SIZE 20 over 2 workers
        assert stats["epoch"] == epoch
        assert_each_sample_once(take_seen(trainer))
        losses.append(stats["train_loss"])
    assert losses[1] < losses[0]
    stats = trainer.train(dataset=data, num_steps=3)
    assert stats["batch_count"] == 3 and stats["num_samples"] == 2 * 3 * 10
    assert [len(part) for part in take_seen(trainer)] == [30, 30]
    trainer.train(dataset=data)  # the next call is a whole new pass
    assert_each_sample_once(take_seen(trainer))


def test_dict_batches_dtypes_and_errors(trainer):
    import ray

    ds = ray.data.from_items(linear_items())  # float64 columns: they arrive as float32
    stats = trainer.train(dataset=ds)  # RecordingOperator reads dict batches itself
    assert stats["num_samples"] == N
    assert_each_sample_once(take_seen(trainer))
    with pytest.raises(ValueError, match="without a label column yields dict batches"):
        as_input(ds, LinearOperator)  # the default train_batch cannot read dicts
    with pytest.raises(TypeError, match=r"train\(dataset=...\) expects a ray.data.Dataset .*got list"):
        trainer.train(dataset=[1, 2])
    with pytest.raises(TypeError, match=r"label_column=...\) expects a column name .*got 3"):
        DatasetInput(ds, label_column=3)
    with pytest.raises(ValueError, match=r"batch_size=...\) expects an int > 0 or None; got 0"):
        DatasetInput(ds, label_column="y", batch_size=0)
    with pytest.raises(ValueError, match=r"column\(s\) \['z'\] that the dataset lacks; its columns are \['x', 'y'\]"):
        trainer.train(dataset=DatasetInput(ds, label_column="z"))
    assert trainer.train(dataset=DatasetInput(ds, label_column="y", label_shape=(1,)))["num_samples"] == N
    take_seen(trainer)


def test_a_stuck_read_times_out_with_advice(trainer, tmp_path):
    import pandas as pd
    import ray

    pd.DataFrame(linear_items()).to_parquet(tmp_path / "data.parquet")
    stuck = ray.data.read_parquet(str(tmp_path / "data.parquet"))  # read tasks need a CPU; the workers hold both
    with pytest.raises(TimeoutError, match="no batch from this worker's Ray Data shard within 2 s.*free CPUs now: 0"):
        trainer.train(dataset=DatasetInput(stuck, label_column="y", label_shape=(1,), batch_timeout_s=2))
    assert trainer.train(dataset=ray.data.from_items(linear_items()))["num_samples"] == N  # still usable
    take_seen(trainer)


def test_workers_holding_every_cpu_fail_a_read_within_seconds_saying_what_to_free(trainer, tmp_path):
    import pandas as pd
    import ray

    from raysgd.torch import constants
    from raysgd.torch.execution import cluster_state

    assert cluster_state.ceiling() == {"CPU": 2, "GPU": 0}  # a local cluster cannot grow
    pd.DataFrame(linear_items()).to_parquet(tmp_path / "data.parquet")
    reads = ray.data.read_parquet(str(tmp_path / "data.parquet"))  # read tasks need a CPU; the workers hold both
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"within 10 s, and none can come: the trainer holds 2 of the cluster's 2 "
                                           r"CPUs, and the cluster cannot grow.*Leave at least 1 CPU free"):
        trainer.train(dataset=DatasetInput(reads, label_column="y", label_shape=(1,)))  # timeout_s is 60 here
    assert time.monotonic() - started < constants.SGD_DATA_NO_CPU_S + 20  # not timeout_s (1800 s by default)
    # a dataset that needs no task (from_items is materialized) still trains with no CPU free
    assert trainer.train(dataset=ray.data.from_items(linear_items()))["num_samples"] == N
    take_seen(trainer)


def test_with_deadline_stops_its_thread_when_abandoned():
    produced = []

    def numbers():
        for i in range(1000):
            produced.append(i)
            yield i

    iterator = _with_deadline(numbers(), timeout_s=5)
    assert [next(iterator) for _ in range(3)] == [0, 1, 2]
    iterator.close()
    time.sleep(0.3)
    count = len(produced)
    time.sleep(0.3)
    assert len(produced) == count < 10  # bounded read-ahead, and the helper stopped


def test_shard_cache_splits_again_for_a_new_worker_generation(ray_2cpus):
    import ray

    data = DatasetInput(ray.data.from_items(linear_items(10)), label_column="y")
    cache = ShardCache()
    first = cache.shards(data, 2, 1, {}, 10)
    assert [s.batch_size for s in first] == [32, 32]
    assert cache.shards(data, 2, 1, {}, 10)[0]._split is first[0]._split  # reused while nothing changed
    assert cache.shards(data, 2, 2, {}, 10)[0]._split is not first[0]._split  # restarted workers: a new split
    assert len(cache.shards(data, 1, 3, {BATCH_SIZE: 64}, 10)) == 1
    cache.close()


def test_a_lost_worker_retries_the_epoch_over_every_sample(trainer, fault_marker):
    import ray

    data = DatasetInput(ray.data.from_items(linear_items()), label_column="y", label_shape=(1,))
    trainer.train(dataset=data)
    take_seen(trainer)
    failures = trainer.num_failures
    open(fault_marker + ".armed", "w").close()
    stats = trainer.train(dataset=data, max_retries=2)
    assert os.path.exists(fault_marker) and trainer.num_failures == failures + 1
    assert stats["num_samples"] == N
    assert_each_sample_once(take_seen(trainer))  # the restarted workers saw the retried epoch only


def test_shutdown_releases_the_split(trainer):
    import ray

    trainer.train(dataset=ray.data.from_items(linear_items()))
    take_seen(trainer)
    trainer.shutdown()

    def left_behind():  # Ray Data's own detached service actors (stats, autoscaling) live with the cluster
        return [a["ActorClassName"] for a in live_actors() if not a["IsDetached"]] + live_placement_groups()

    deadline = time.monotonic() + 10
    while left_behind() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left_behind()  # workers, placement group, and the split's coordinator actor
