"""A 2-node cluster (1 CPU each) loses a node mid-epoch; training goes on, then grows back.

Deterministic: rank 1 stops at batch 5 until its node is removed (so the epoch cannot end before the
loss), and the restart waits until Ray reports the node dead (so it never places a worker there).
"""
import time

import pytest
import ray

from helpers import FaultyOperator
from raysgd import TorchTrainer

pytestmark = pytest.mark.slow


def test_lost_node_shrinks_then_the_pool_grows_back(two_node_cluster, tmp_path, monkeypatch):
    cluster, nodes = two_node_cluster
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "1")
    config = {"data_size": 400, "batch_size": 10, "batch_sleep": 0.05,  # rank 1 waits at batch 5 for its node's end
              "fault": {"rank": 1, "batch": 5, "kind": "sleep", "seconds": 300, "marker": str(tmp_path / "at-batch-5")}}
    trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config=config, timeout_s=15)
    try:
        node_ids = trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id())
        assert len(set(node_ids)) == 2  # SPREAD: one worker per node
        doomed = next(node for node in nodes if node.node_id == node_ids[1])
        marker = tmp_path / "at-batch-5"

        start = time.monotonic()
        import threading

        def remove_when_reached():
            while not marker.exists():
                time.sleep(0.01)
            cluster.remove_node(doomed, allow_graceful=False)

        thread = threading.Thread(target=remove_when_reached, daemon=True)
        thread.start()
        stats = trainer.train()
        elapsed = time.monotonic() - start
        thread.join(timeout=5)
        assert stats["num_samples"] == 400  # the whole epoch, retried on the surviving node
        assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == doomed.node_id)  # the restart waited
        assert trainer.worker_group.num_workers == 1 and trainer.num_failures == 1
        assert elapsed < 90, elapsed

        assert trainer.train()["num_samples"] == 400  # still 1 worker: nowhere to grow
        assert trainer.worker_group.num_workers == 1

        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        time.sleep(1.2)  # past the cooldown (counted from the shrink, seconds ago already)
        stats = trainer.train()
        assert trainer.worker_group.num_workers == 2 and stats["num_samples"] == 400
        assert len(set(trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id()))) == 2
    finally:
        trainer.shutdown()
