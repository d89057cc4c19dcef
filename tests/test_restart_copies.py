"""The restart point survives the loss of the node holding it: its copy on another node restarts the call.

A 0-CPU head and three 1-CPU nodes; 2 workers. Rank 0 serialises the call's restart point into its own node's
object store and a copy goes to rank 1's node before the call trains. Rank 0 then stops at batch 3 until its node
is killed: the primary copy is gone with it, the group restarts at 2 workers (the third node) from the copy, and
the result is bit-exact with a run that lost nothing (dropout draws from each rank's own stream).
"""
import threading
import time

import pytest
import ray
import torch

from conftest import local_cluster
from helpers import FaultyOperator
from raysgd import TorchTrainer

pytestmark = pytest.mark.slow

# "pad": a 4 MB buffer, so the state is a real object in a node's store (Ray keeps objects under 100 KB in the
# driver's own memory, where no node loss can reach them)
CONFIG = {"lr": 0.05, "data_size": 64, "batch_size": 8, "shuffle": True, "input_dropout": 0.2, "batch_sleep": 0.02,
          "pad": 1_000_000}


@pytest.fixture(scope="module")
def three_nodes():
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 3) as made:
        yield made


def weights(trainer):
    return {key: value.clone() for key, value in trainer.get_model(to_cpu=True).state_dict().items()}


def node_ids(trainer):
    return trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id())


def test_losing_the_node_of_the_restart_point_restarts_from_its_copy(three_nodes, tmp_path):
    cluster, nodes = three_nodes
    reference = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config=CONFIG,
                             commit_every_n_steps=0, timeout_s=30)
    try:
        reference.train()
        reference.train()
        expected = weights(reference)
    finally:
        reference.shutdown()

    marker = tmp_path / "rank0-at-batch-3"
    fault = {"rank": 0, "batch": 3, "kind": "sleep", "seconds": 300, "marker": str(marker)}
    trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config={**CONFIG, "fault": fault},
                           commit_every_n_steps=0, timeout_s=30)  # no commits: the call-start snapshot restarts it
    try:
        placed = node_ids(trainer)
        assert len(set(placed)) == 2
        doomed = next(node for node in nodes if node.node_id == placed[0])  # rank 0's: the first copy's node

        def kill_when_stuck():
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            cluster.remove_node(doomed, allow_graceful=False)

        killer = threading.Thread(target=kill_when_stuck, daemon=True)
        killer.start()
        stats = trainer.train()
        killer.join(timeout=30)
        assert marker.exists() and not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == doomed.node_id)
        assert trainer.num_failures == 1 and trainer.worker_group.num_workers == 2  # the same size, third node
        assert doomed.node_id not in node_ids(trainer)
        assert stats["num_samples"] == CONFIG["data_size"]  # the whole epoch once
        trainer.train()
        for key, value in weights(trainer).items():
            assert torch.equal(value, expected[key]), key
    finally:
        trainer.shutdown()


def test_losing_the_node_of_a_commits_state_resumes_from_its_buddy_copy(three_nodes, tmp_path, caplog):
    """Commits keep rank 0's state part on its own node (its holder) and a copy on a buddy node (rank 1's), never
    on the driver's: rank 0's node is killed after the commit at step 2, and the call resumes from that commit's
    copy at the same size (a third node), every sample once, bit-exact with a run that lost nothing."""
    cluster, _ = three_nodes
    worker_nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    for _ in range(3 - len(worker_nodes)):  # the test above removed one
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    reference = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config=CONFIG,
                             commit_every_n_steps=0, timeout_s=30)
    try:
        reference.train()
        expected = weights(reference)
    finally:
        reference.shutdown()

    marker = tmp_path / "rank0-at-batch-3"
    fault = {"rank": 0, "batch": 3, "kind": "sleep", "seconds": 300, "marker": str(marker)}
    trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config={**CONFIG, "fault": fault},
                           commit_every_n_steps=2, timeout_s=30)
    try:
        placed = node_ids(trainer)
        doomed = next(node for node in cluster.list_all_nodes() if node.node_id == placed[0])

        def kill_after_the_commit():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                commit = trainer.latest_commit() if marker.exists() else None
                if commit is not None and commit["cursor"]["steps"] == 2:
                    cluster.remove_node(doomed, allow_graceful=False)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_after_the_commit, daemon=True)
        killer.start()
        with caplog.at_level("INFO"):
            stats = trainer.train()
        killer.join(timeout=30)
        assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == doomed.node_id)
        assert "Resuming from the commit at step 2" in caplog.text  # the commit, not the call's start,
        assert "lost on every node" not in caplog.text  # and its state was found (not replayed from the start)
        assert trainer.num_failures == 1 and trainer.worker_group.num_workers == 2
        assert doomed.node_id not in node_ids(trainer)
        assert stats["num_samples"] == CONFIG["data_size"]  # the whole epoch once
        for key, value in weights(trainer).items():
            assert torch.equal(value, expected[key]), key
    finally:
        trainer.shutdown()
