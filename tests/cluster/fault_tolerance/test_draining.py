"""Nodes that Ray drains (a preemption notice, as ``ray start --block`` gives on SIGTERM) on a real multi-node cluster.

The drain is Ray's own: the GCS's ``drain_node`` with reason PREEMPTION and a deadline, as Ray's SIGTERM handler,
the autoscaler and ``ray drain-node`` send it. A draining node stays alive, but Ray places nothing new on it.
"""
import os
import threading
import time

import pytest
import ray
import torch

from conftest import local_cluster
from helpers import CountingOperator
from raysgd import TorchTrainer
from raysgd.torch.execution import cluster_state, placement

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A 0-CPU head and three 1-CPU nodes; tests add nodes as their drains use them up (a drained idle node ends)."""
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 3) as (made, nodes):
        yield made, list(nodes)


def drain(cluster, node_id, deadline_s=120):
    """Ray's preemption notice for ``node_id``: it will be taken back in ``deadline_s`` seconds."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=cluster.address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "test: spot node preempted", int((time.time() + deadline_s) * 1000))
    assert accepted, why
    assert node_id in cluster_state.draining_nodes()


def free_nodes():
    """Ids of the live nodes with CPUs that Ray is not draining."""
    draining = cluster_state.draining_nodes()
    return {node["NodeID"] for node in ray.nodes()
            if node["Alive"] and node["Resources"].get("CPU", 0) > 0 and node["NodeID"] not in draining}


def add_node(cluster, nodes, num_cpus=1):
    """A new node, once Ray lists it alive (``Cluster.wait_for_nodes`` also counts the drained nodes that ended)."""
    node = cluster.add_node(num_cpus=num_cpus)
    nodes.append(node)
    deadline = time.monotonic() + 60
    while node.node_id not in free_nodes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert node.node_id in free_nodes()
    return node


def exactly(cluster, nodes, k):
    """Add or remove 1-CPU nodes until exactly ``k`` usable ones are live, and Ray's view shows it."""
    for node in [node for node in nodes if node.node_id in free_nodes()][k:]:
        cluster.remove_node(node, allow_graceful=False)
    while len(free_nodes()) < k:
        add_node(cluster, nodes)
    deadline = time.monotonic() + 60
    while len(free_nodes()) != k and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(free_nodes()) == k


def node_id():
    return ray.get_runtime_context().get_node_id()


def test_workers_leave_a_draining_node_at_a_commit_point_and_the_epoch_goes_on(cluster, tmp_path, monkeypatch):
    """Rank 1's node is drained mid-epoch: every rank stops at the next commit point, and the same epoch goes on from
    it on a node that is not draining; every sample trained once, nothing recomputed, no failure counted."""
    made, nodes = cluster
    exactly(made, nodes, 3)
    monkeypatch.setenv("SGD_DRAIN_CHECK_S", "0.2")
    n, gate, log = 96, tmp_path / "gate", tmp_path / "batches.log"
    # rank 0 holds step 6 until the request to stop arrives, so the epoch cannot end before the drain is seen
    config = {"n": n, "batch_size": 4, "log": str(log),
              "fault": {"step": 6, "rank": 0, "marker": str(gate), "until_resize": True}}
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=2, config=config, timeout_s=30,
                           commit_every_n_steps=2)
    try:
        before, pids = trainer.apply_all_workers(node_id), trainer.apply_all_workers(os.getpid)
        assert len(set(before)) == 2  # SPREAD: one worker per node, the third node free

        def drain_at_the_gate():
            deadline = time.monotonic() + 120
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            drain(made, before[1])

        thread = threading.Thread(target=drain_at_the_gate, daemon=True)
        thread.start()
        stats = trainer.train(reduce_results=False)
        thread.join(timeout=5)
        after = trainer.apply_all_workers(node_id)
        assert before[1] not in after and len(set(after)) == 2  # moved within the call, off the draining node
        assert trainer.apply_all_workers(os.getpid)[0] == pids[0]  # rank 0 stayed in its process
        assert trainer.num_failures == 0  # a move is no failure
        assert sum(s["num_samples"] for s in stats) == n  # the whole epoch, each batch counted once
        assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(n))  # every sample exactly once
        assert len(log.read_text().splitlines()) == n // 4  # nothing recomputed: each batch of 4 ran once
    finally:
        trainer.shutdown()


def test_a_bundle_on_a_draining_node_takes_no_replacement(cluster):
    """Re-forming after a death: a bundle on a draining node counts as lost (Ray would never place the replacement
    there), so the group restarts elsewhere when a worker fits there, else goes on without it."""
    made, nodes = cluster
    exactly(made, nodes, 2)
    pg = ray.util.placement_group([{"CPU": 1}, {"CPU": 1}], strategy="SPREAD")
    ray.get(pg.ready(), timeout=60)
    try:
        placed = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        assert placement.reform_plan(pg, {0: "survivor"}, 1, lambda n: 0) == [(0, "survivor"), (1, None)]  # not draining
        drain(made, placed[1])
        assert placement.reform_plan(pg, {0: "survivor"}, 1, lambda n: 0) == [(0, "survivor")]  # nothing fits elsewhere
        assert placement.reform_plan(pg, {0: "survivor"}, 1, lambda n: 1) is None  # one fits elsewhere: restart there
    finally:
        ray.util.remove_placement_group(pg)


def test_a_draining_node_is_no_room_to_grow_into(cluster, monkeypatch):
    """A draining node's free CPUs are not counted as room: a group below its maximum does not restart to grow
    onto it (Ray would not place the bundle there; before, each call tore the group down and waited for it)."""
    made, nodes = cluster
    exactly(made, nodes, 2)
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=(2, 3), config={"n": 48}, timeout_s=30)
    placeholder = None
    try:
        assert trainer.worker_group.num_workers == 2
        spare = add_node(made, nodes, num_cpus=2)  # one CPU stays free while the node drains: a busy node lives on

        @ray.remote(num_cpus=1)
        class Busy:
            def where(self):
                return node_id()

        placeholder = Busy.options(scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            spare.node_id, soft=False)).remote()
        assert ray.get(placeholder.where.remote(), timeout=60) == spare.node_id
        deadline = time.monotonic() + 30
        while trainer.worker_group.how_many_fit(1) != 1 and time.monotonic() < deadline:  # Ray's view catches up
            time.sleep(0.1)
        assert trainer.worker_group.how_many_fit(1) == 1  # the spare node's free CPU, before the drain
        drain(made, spare.node_id)
        assert trainer.worker_group.how_many_fit(1) == 0
        pids = trainer.apply_all_workers(os.getpid)
        trainer.train()
        assert trainer.apply_all_workers(os.getpid) == pids  # no restart to grow onto the draining node
        assert trainer.worker_group.num_workers == 2
    finally:
        if placeholder is not None:
            ray.kill(placeholder)  # the drained node, idle now, ends
        trainer.shutdown()


def test_workers_leave_a_draining_node_before_the_next_call(cluster):
    """A worker on a draining node moves before the next call, from the state the last call left: no failure,
    every sample trained once per epoch; rank 0, on a healthy node, keeps its process."""
    made, nodes = cluster
    exactly(made, nodes, 2)
    n = 48
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=2, config={"n": n}, timeout_s=30)
    try:
        trainer.train()
        before, pids = trainer.apply_all_workers(node_id), trainer.apply_all_workers(os.getpid)
        drain(made, before[1])
        fresh = add_node(made, nodes)
        trainer.train()
        after = trainer.apply_all_workers(node_id)
        assert sorted(after) == sorted([before[0], fresh.node_id])  # rank 1 left its draining node before the call
        assert trainer.apply_all_workers(os.getpid)[0] == pids[0]  # rank 0 stayed in its process
        assert trainer.num_failures == 0
        assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.full((n,), 2.0))  # 2 epochs, each once
    finally:
        trainer.shutdown()
