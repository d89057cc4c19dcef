"""raysgd.train on a real two-node cluster: a local ``storage_path`` of the driver's machine, with the ranks elsewhere.

The head node (the driver's) has no CPU, so both ranks run on the other node. Reported files go to the driver's
folder through a task on the driver's node (the folder may not exist on the ranks' node), and a restart reads the
checkpoint back the same way; a worker killed after a report resumes from that report's checkpoint.
"""
import json
import os

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
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 2}]) as (made, nodes):
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
    ranks_nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"] and node["NodeID"] != head}
    assert len(ranks_nodes) == 1
    starts = [line.split() for line in open(resumed).read().splitlines()]
    assert len(starts) == 2 and all(not path.startswith(str(tmp_path / "runs")) for _, path in starts)  # read back
    assert_released()
