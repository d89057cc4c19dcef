"""A node removed mid-epoch after a commit: the epoch goes on from the commit on the surviving node, exactly once."""
import threading
import time

import pytest
import ray
import torch

from helpers import CountingOperator
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

        def remove_after_commit():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                commit = trainer.latest_commit() if marker.exists() else None
                if commit is not None and commit["cursor"]["steps"] >= 6:
                    cluster.remove_node(doomed, allow_graceful=False)
                    return
                time.sleep(0.05)

        thread = threading.Thread(target=remove_after_commit, daemon=True)
        thread.start()
        stats = trainer.train()
        thread.join(timeout=5)
        assert marker.exists() and trainer.num_failures == 1
        assert trainer.worker_group.num_workers == 1  # the commit store lives by the driver: it survived
        assert stats["num_samples"] == n
        assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(n))
    finally:
        trainer.shutdown()
