"""A node removed mid-epoch after a commit: the epoch goes on from the commit on the surviving node, exactly once."""
import threading
import time

import pytest
import ray
import torch

from helpers import CountingOperator, remove_node_after_commit
from raysgd import TorchTrainer

pytestmark = pytest.mark.slow


def test_lost_node_continues_the_epoch_from_the_commit_on_one_worker(two_node_cluster, tmp_path):
    cluster, nodes = two_node_cluster
    n, marker = 96, tmp_path / "fault"
    config = {"n": n, "batch_size": 4, "fault": {"step": 8, "rank": 1, "marker": str(marker)}}
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=2, config=config, timeout_s=15,
                           commit_every_n_steps=3)
    try:
        node_ids = trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id())
        assert len(set(node_ids)) == 2  # SPREAD: one worker per node
        doomed = next(node for node in nodes if node.node_id == node_ids[1])

        thread = remove_node_after_commit(trainer, cluster, doomed, marker, min_steps=6)
        stats = trainer.train()
        thread.join(timeout=5)
        assert marker.exists() and trainer.num_failures == 1
        assert trainer.worker_group.num_workers == 1  # rank 0 sent the state: its node holds it
        assert stats["num_samples"] == n
        assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(n))
    finally:
        trainer.shutdown()


def _worker_nodes():
    return [node for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0]


def test_a_node_added_mid_epoch_grows_the_group_at_a_commit_point(two_node_cluster, tmp_path, monkeypatch):
    """(1, 2) workers start on the one worker node; a node added mid-epoch joins at the next commit point, and
    the same epoch finishes on 2 workers, every sample trained exactly once, with nothing recomputed."""
    cluster, nodes = two_node_cluster
    alive = {node["NodeID"] for node in _worker_nodes()}
    for node in [node for node in nodes if node.node_id in alive][1:]:  # one worker node to start with (the
        cluster.remove_node(node, allow_graceful=False)  # test above may have removed one already)
    deadline = time.monotonic() + 60
    while ray.cluster_resources().get("CPU", 0) != 1 and time.monotonic() < deadline:  # the removal is seen
        time.sleep(0.1)
    assert ray.cluster_resources().get("CPU", 0) == 1
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    monkeypatch.setenv("SGD_GROW_CHECK_S", "0.2")
    n, marker, log = 96, tmp_path / "gate", tmp_path / "batches.log"
    # rank 0 holds step 6 until the driver's request to grow arrives, so the epoch cannot end first
    config = {"n": n, "batch_size": 4, "log": str(log),
              "fault": {"step": 6, "rank": 0, "marker": str(marker), "until_resize": True}}
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=(1, 2), config=config, timeout_s=30,
                           commit_every_n_steps=2)
    try:
        assert trainer.worker_group.num_workers == 1

        result = {}
        thread = threading.Thread(target=lambda: result.update(stats=trainer.train(reduce_results=False)),
                                  daemon=True)  # train in a thread: a node can only be added from the main one
        thread.start()
        deadline = time.monotonic() + 120
        while not marker.exists() and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.add_node(num_cpus=1)
        thread.join(timeout=180)
        assert not thread.is_alive() and "stats" in result
        stats = result["stats"]
        assert marker.exists()
        assert trainer.num_failures == 0  # growing is not a failure
        assert trainer.worker_group.num_workers == 2 and len(stats) == 2
        assert sum(s["num_samples"] for s in stats) == n  # the whole epoch, each batch counted once
        assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(n))  # every sample exactly once
        ranks = [line.split()[0] for line in log.read_text().splitlines()]
        assert ranks[:7] == ["0"] * 7  # steps 0-6 on one worker; stopped at the commit after step 6
        assert ranks.count("1") > 0  # the rest of the same epoch ran on two workers
        assert len(ranks) == 7 + 2 * -(-(n - 7 * 4) // 8)  # nothing recomputed: 7 batches, then 9 on each rank
    finally:
        trainer.shutdown()
