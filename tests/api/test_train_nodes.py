"""raysgd.train on a real two-node cluster: a local ``storage_path`` of the driver's machine, with the ranks elsewhere.

The head node (the driver's) has no CPU, so the ranks run on the other nodes (three of 1 CPU). Reported files go
to the driver's folder through a task on the driver's node (the folder may not exist on the ranks' node), and a
restart reads the checkpoint back the same way; a worker killed after a report resumes from that report's
checkpoint. A node Ray drains (its preemption notice) moves its rank to the free node at the next report.
"""
import json
import os
import threading
import time

import pytest
import ray

from conftest import assert_released, local_cluster
from train_functions import counting, read_counts, trained_batches
from raysgd.torch.storage import filesystem
from raysgd.train import FailureConfig, RunConfig, ScalingConfig
from raysgd.train.torch import TorchConfig, TorchTrainer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 3) as (made, nodes):
        yield made, nodes


def test_a_killed_worker_resumes_from_the_report_written_to_the_drivers_local_folder(cluster, tmp_path):
    head = ray.get_runtime_context().get_node_id()  # the driver's node
    marker, log, resumed = str(tmp_path / "killed"), str(tmp_path / "batches.log"), str(tmp_path / "resumed.log")
    config = {"n": 32, "epochs": 2, "log": log, "resumed_log": resumed,
              "fault": {"kind": "kill", "rank": 1, "epoch": 0, "step": 1, "marker": marker}}
    result = TorchTrainer(counting, train_loop_config=config, torch_config=TorchConfig(timeout_s=30),
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="remote-ranks", storage_path=str(tmp_path / "runs"),
                                               failure_config=FailureConfig(max_failures=1))).fit()
    assert os.path.exists(marker) and result.num_failures == 1
    assert read_counts(result.checkpoint).tolist() == [2.0] * 32  # resumed from step 1's report: exact
    samples = [(epoch, i) for _, _, epoch, ids in trained_batches(log) for i in ids]
    assert sorted(samples) == sorted((epoch, i) for epoch in range(2) for i in range(32))  # none twice
    first = json.load(open(tmp_path / "runs" / "remote-ranks" / "checkpoint_000001" / filesystem.REPORT_MARKER))
    assert set(first["written_on"].values()) == {head}  # the ranks' files went through the driver's node
    starts = [line.split() for line in open(resumed).read().splitlines()]
    assert len(starts) == 2 and all(not path.startswith(str(tmp_path / "runs")) for _, path in starts)  # read back
    assert_released()


def test_a_draining_node_moves_its_rank_to_a_free_node_at_the_next_report(cluster, tmp_path):
    """Ray drains rank 1's node while the ranks hold at step 4; once asked, they stop at the report after step 5,
    and the run goes on from it with rank 1 on the free node: no failure counted, every sample once."""
    from test_draining import drain

    marker, log = str(tmp_path / "held"), str(tmp_path / "batches.log")
    config = {"n": 48, "epochs": 2, "log": log, "every": 2,
              "fault": {"kind": "hold", "epoch": 0, "step": 4, "marker": marker, "until": "asked"}}
    trainer = TorchTrainer(counting, train_loop_config=config, torch_config=TorchConfig(timeout_s=30),
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="drained", storage_path=str(tmp_path / "runs")))
    drained = []

    def drain_rank_1():
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        drained.append(trainer.worker_group.placed_on()[1])
        drain(cluster[0], drained[0])

    thread = threading.Thread(target=drain_rank_1, daemon=True)
    thread.start()
    result = trainer.fit()
    thread.join(5)
    assert drained and result.num_failures == 0
    batches = trained_batches(log)
    before = {pid for pid, _, epoch, _ in batches[:12]}  # steps 0-5 of both ranks: the stop is at step 5's report
    after = {pid for pid, _, _, _ in batches[12:]}
    assert len(before) == 2 and len(after) == 2 and len(before & after) == 1  # rank 0 stayed, rank 1 moved
    samples = [(epoch, i) for _, _, epoch, ids in batches for i in ids]
    assert sorted(samples) == sorted((epoch, i) for epoch in range(2) for i in range(48))  # none twice
    assert read_counts(result.checkpoint).tolist() == [2.0] * 48
    assert_released()


def test_a_rank_on_another_node_reads_the_metadata_set_after_the_report(cluster, tmp_path):
    """``result.checkpoint.set_metadata(...)`` after the report writes ``.metadata.json`` beside files the marker
    lists without it; a rank that reads the checkpoint from the driver's node gets it too (it got ``{}``)."""
    from raysgd.torch.storage import rank_files
    from raysgd.train import Checkpoint

    head = ray.get_runtime_context().get_node_id()
    directory = tmp_path / "runs" / "checkpoint_000001"
    directory.mkdir(parents=True)
    (directory / "weights.txt").write_text("1 2 3")
    Checkpoint(str(directory)).set_metadata({"epoch": 3})

    @ray.remote(num_cpus=1)  # the head has no CPU: a rank's node
    def read_back(names):
        fetched = rank_files.fetch(str(tmp_path / "runs"), str(directory), names, rank_files.scratch_folder(),
                                   home=head)
        try:
            return ray.get_runtime_context().get_node_id(), sorted(os.listdir(fetched)), \
                Checkpoint(fetched).get_metadata()
        finally:
            import shutil
            shutil.rmtree(fetched)

    node, files, metadata = ray.get(read_back.remote(["weights.txt"]), timeout=60)
    assert node != head and files == [".metadata.json", "weights.txt"] and metadata == {"epoch": 3}
    os.remove(directory / ".metadata.json")  # none set: nothing more to read
    assert ray.get(read_back.remote(["weights.txt"]), timeout=60)[1:] == (["weights.txt"], {})
    assert_released()
