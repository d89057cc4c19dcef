"""The restart point survives the loss of the node holding it: its copy on another node restarts the call.

A 0-CPU head and three 1-CPU nodes; 2 workers. Rank 0 serialises the call's restart point into its own node's
object store and a copy goes to rank 1's node before the call trains. Rank 0 then stops at batch 3 until its node
is killed: the primary copy is gone with it, the group restarts at 2 workers (the third node) from the copy, and
the result is bit-exact with a run that lost nothing (dropout draws from each rank's own stream).
"""
import io
import os
import signal
import threading
import time

import pytest
import ray
import torch
from ray.experimental import get_object_locations
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from conftest import local_cluster
from helpers import CountingOperator, FaultyOperator, holders_started, remove_node_after_commit
from raysgd import TorchTrainer
from raysgd.torch.commits import commit_store, part_holders
from raysgd.torch.restart_points import restart_point

pytestmark = pytest.mark.slow

# "pad": a 4 MB buffer, so the state is a real object in a node's store (Ray keeps objects under 100 KB in the
# driver's own memory, where no node loss can reach them)
CONFIG = {"lr": 0.05, "data_size": 64, "batch_size": 8, "shuffle": True, "input_dropout": 0.2, "batch_sleep": 0.02,
          "pad": 1_000_000}


@pytest.fixture(scope="module")
def three_nodes():
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 3) as made:
        yield made


@pytest.fixture(scope="module")
def expected(three_nodes):
    """``{epoch: weights}`` of a run that lost nothing, after epochs 1 and 2 (one reference for every test)."""
    reference = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config=CONFIG,
                             commit_every_n_steps=0, timeout_s=30)
    try:
        return {epoch: (reference.train(), weights(reference))[1] for epoch in (1, 2)}
    finally:
        reference.shutdown()


def back_to_three_worker_nodes(three_nodes):
    """The cluster of ``three_nodes`` with three live 1-CPU worker nodes again (a test before may have removed one)."""
    cluster, _ = three_nodes
    worker_nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
    for _ in range(3 - len(worker_nodes)):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


def rank0_sleeps_at_batch_3(tmp_path):
    """``(marker, fault)``: rank 0 writes ``marker`` and sleeps at batch 3 (until its node is killed)."""
    marker = tmp_path / "rank0-at-batch-3"
    return marker, {"rank": 0, "batch": 3, "kind": "sleep", "seconds": 300, "marker": str(marker)}


def weights(trainer):
    return {key: value.clone() for key, value in trainer.get_model(to_cpu=True).state_dict().items()}


def node_ids(trainer):
    return trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id())


def locations(ref):
    return sorted(get_object_locations([ref], timeout_ms=10_000)[ref]["node_ids"])


@ray.remote(num_cpus=0, max_restarts=0)
class Committer:
    """A committing rank's stand-in: sends one commit through a sink (as ``CommitSink.put`` does), then is killed."""

    def pid(self):
        return os.getpid()

    def commit(self, sink, key, record, size):
        answer = part_holders.keep_part(sink.holders, sink.buddy_of, bytes(size), 60, sink.store, key, 0)
        assert ray.get(sink.store.put.remote(key, 0, 1, record, answer["size"]), timeout=60)
        return answer  # all this process learnt of the copies: no copy's ref may be among it


def test_every_kept_copy_is_stored_on_its_own_node_only_and_outlives_the_committing_process(three_nodes):
    """A pull leaves a secondary copy of the pulled object on the puller's node, which Ray lists as a location of it
    until it declares that node dead; a restart right after the node's loss could have its load sent there and wait
    Ray's pull timeout (10 s). So a commit's part copies (the holders') and a restart point's copy are each made from
    a temporary, and every kept object has one location: its own node. The control, a direct pull, shows the
    location that would otherwise be left (and that Ray reports it before the kept objects are checked).

    The holders give their copies to the store themselves: the committing process, SIGKILLed as soon as its commit is
    stored (a preemption's end), was never a link between a copy's owner and the store, so both copies stay."""
    back_to_three_worker_nodes(three_nodes)
    node_a, node_b = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)[:2]
    on_a, on_b = (NodeAffinitySchedulingStrategy(node, soft=False) for node in (node_a, node_b))
    size = 2_000_000  # in the nodes' object stores (Ray keeps objects under 100 KB in the owner's memory)
    holders, store = part_holders.Holders(), commit_store.CommitStore()
    try:
        handles, buddy_of = holders.for_nodes([node_a, node_b]), part_holders.buddies([node_a, node_b])
        ray.get(store.begin(1), timeout=30)
        record = io.BytesIO()
        torch.save({"cursor": "c"}, record)
        committer = Committer.options(scheduling_strategy=on_a).remote()
        pid = ray.get(committer.pid.remote(), timeout=60)
        kept = ray.get(committer.commit.remote(store.sink(handles, buddy_of), (1, 0, 5), record.getvalue(), size),
                       timeout=60)
        os.kill(pid, signal.SIGKILL)
        assert kept["nodes"] == [node_a, node_b] and not any(isinstance(v, ray.ObjectRef) for v in refs_in(kept))
        key, records, parts = store.latest_parts(1)
        assert key == (1, 0, 5) and records == {0: {"cursor": "c"}} and parts[0]["size"] == size
        copies = {node: refs[0] for node, refs in parts[0]["copies"]}
        assert list(copies) == [node_a, node_b]  # its own node's first

        state = ray.remote(num_cpus=0)(lambda: b"s" * size)
        primary = state.options(scheduling_strategy=on_a).remote()  # as rank 0's snapshot: returned on its node
        point = restart_point.RestartPoint([primary], nbytes=size, nodes=[node_a])
        assert restart_point.copy_to(point, node_b, timeout_s=60) and point.nodes == [node_a, node_b]

        control = state.options(scheduling_strategy=on_a).remote()
        pulled = ray.remote(num_cpus=0)(lambda value: len(value)).options(scheduling_strategy=on_b).remote(control)
        assert ray.get(pulled, timeout=60) == size
        deadline = time.monotonic() + 30
        while locations(control) != sorted([node_a, node_b]):
            assert time.monotonic() < deadline, f"the direct pull's location on node b never showed: {locations(control)}"
            time.sleep(0.05)

        assert locations(copies[node_a]) == [node_a] and locations(copies[node_b]) == [node_b]
        assert locations(point.refs[0]) == [node_a] and locations(point.refs[1]) == [node_b]
        assert bytes(restart_point.first_available(point.refs[1:], timeout_s=60)) == b"s" * size
        for ref in copies.values():  # whole after the committer's death (fetched here last: a pull adds a location)
            assert bytes(restart_point.first_available([ref], timeout_s=60)) == bytes(size)
    finally:
        holders.close()
        store.close()


def refs_in(value):
    """Every object inside ``value`` (the items of its lists, tuples and dicts, recursively)."""
    if isinstance(value, dict):
        return [found for item in value.values() for found in refs_in(item)]
    if isinstance(value, (list, tuple)):
        return [found for item in value for found in refs_in(item)]
    return [value]


def test_losing_the_node_of_the_restart_point_restarts_from_its_copy(three_nodes, expected, tmp_path):
    cluster, nodes = three_nodes
    marker, fault = rank0_sleeps_at_batch_3(tmp_path)
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
            assert torch.equal(value, expected[2][key]), key
    finally:
        trainer.shutdown()


def test_losing_the_node_of_a_commits_state_resumes_from_its_buddy_copy(three_nodes, expected, tmp_path, caplog):
    """Commits keep rank 0's state part on its own node (its holder) and a copy on a buddy node (rank 1's), never
    on the driver's: rank 0's node is killed after the commit at step 2, and the call resumes from that commit's
    copy at the same size (a third node), every sample once, bit-exact with a run that lost nothing."""
    cluster = back_to_three_worker_nodes(three_nodes)
    marker, fault = rank0_sleeps_at_batch_3(tmp_path)
    trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config={**CONFIG, "fault": fault},
                           commit_every_n_steps=2, timeout_s=30)
    try:
        placed = node_ids(trainer)
        doomed = next(node for node in cluster.list_all_nodes() if node.node_id == placed[0])

        killer = remove_node_after_commit(trainer, cluster, doomed, marker, min_steps=2)
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
            assert torch.equal(value, expected[1][key]), key
    finally:
        trainer.shutdown()


def test_a_sharded_run_loses_a_node_at_3_workers_then_grows_back_at_a_commit_point(three_nodes, tmp_path,
                                                                                   monkeypatch):
    """FSDP on (2, 3) workers, one per node. Epoch 1: rank 2 stops at step 5 and its node is killed once the commit
    of step 4 is stored: the epoch goes on from that commit on 2 workers (3 shards resharded to 2). Epoch 2: rank 0
    holds step 12 until the driver asks to grow; a node added meanwhile joins at the next commit point (2 shards
    resharded to 3). Each epoch trains every sample exactly once."""
    from raysgd.torch.operator import fsdp

    try:
        fsdp.check_strategy("fsdp")
    except ValueError as err:
        pytest.skip(f"this torch cannot run FSDP2 on CPU: {err}")
    cluster, _ = three_nodes
    for _ in range(3 - len([n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0])):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    monkeypatch.setenv("SGD_GROW_CHECK_S", "0.2")
    n, lost, gate = 96, tmp_path / "lost", tmp_path / "gate"
    config = {"n": n, "batch_size": 4, "fault": [{"step": 5, "rank": 2, "marker": str(lost)},
                                                 {"step": 12, "rank": 0, "marker": str(gate), "until_resize": True,
                                                  "wait_s": 120}]}
    # timeout_s: rank 1 waits in a collective while rank 0 holds the gate and a node starts (seconds; more on a
    # loaded machine)
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=(2, 3), strategy="fsdp",
                           config=config, commit_every_n_steps=2, timeout_s=150)
    try:
        placed = node_ids(trainer)
        assert len(set(placed)) == 3
        doomed = next(node for node in cluster.list_all_nodes() if node.node_id == placed[2])

        killer = remove_node_after_commit(trainer, cluster, doomed, lost, min_steps=4)
        first = trainer.train()
        killer.join(timeout=30)
        assert trainer.num_failures == 1 and trainer.worker_group.num_workers == 2
        assert first["num_samples"] == n
        counts = trainer.state_dict()["models"][0]["p"]
        assert torch.equal(counts, torch.ones(n)), counts  # every sample once across 3 -> 2 shards

        result = {}
        training = threading.Thread(target=lambda: result.update(stats=trainer.train()),
                                    daemon=True)  # train in a thread: a node can only be added from the main one
        training.start()
        deadline = time.monotonic() + 120
        while not gate.exists() and training.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gate.exists(), "rank 0 never reached the gate"
        cluster.add_node(num_cpus=1)
        training.join(timeout=240)
        assert not training.is_alive() and "stats" in result
        assert trainer.worker_group.num_workers == 3 and trainer.num_failures == 1
        assert result["stats"]["num_samples"] == n
        counts = trainer.state_dict()["models"][0]["p"]
        assert torch.equal(counts, 2 * torch.ones(n)), counts  # every sample once across 2 -> 3 shards
    finally:
        trainer.shutdown()


def test_a_lost_nodes_rank_is_taken_by_a_warm_spare_on_another_node(three_nodes, expected, tmp_path):
    """Two workers and one warm spare, one per node: rank 0's node is lost with its processes after the commit at
    step 2 (rank 0's process SIGKILLed as the node is removed, as a machine's shutdown ends them: rank 1's collective
    sees the connection close at once, and Ray reports rank 0 dead only at its verdict on the node, which the recovery
    does not wait for). The spare (on the third node) takes rank 0 and resumes from the commit's buddy copy; rank 1
    keeps its process; the group keeps its size; every sample once, bit-exact with a run that lost nothing."""
    cluster = back_to_three_worker_nodes(three_nodes)
    marker, fault = rank0_sleeps_at_batch_3(tmp_path)
    trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=2, config={**CONFIG, "fault": fault},
                           commit_every_n_steps=2, timeout_s=30, num_spares=1)
    try:
        assert trainer.worker_group.spares.wait_ready(1, timeout_s=120) == 1
        spare_pid, = trainer.worker_group.spares.pids()
        placed, pids = node_ids(trainer), trainer.apply_all_workers(os.getpid)
        assert len(set(placed)) == 2
        doomed = next(node for node in cluster.list_all_nodes() if node.node_id == placed[0])

        assert len(set(trainer.worker_group.spare_nodes()) | set(placed)) == 3
        seen = {}
        killer = remove_node_after_commit(trainer, cluster, doomed, marker, min_steps=2,
                                          before=lambda: (seen.update(holders=holders_started()),
                                                          os.kill(pids[0], signal.SIGKILL)))
        stats = trainer.train()
        killer.join(timeout=30)
        assert seen["holders"] == 3  # the spare's node's commit holder started before the spare took a rank
        assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == doomed.node_id)
        assert trainer.num_failures == 1 and trainer.worker_group.num_workers == 2
        assert trainer.apply_all_workers(os.getpid) == [spare_pid, pids[1]]  # the spare took rank 0; rank 1 kept
        assert doomed.node_id not in node_ids(trainer)
        assert stats["num_samples"] == CONFIG["data_size"]  # the whole epoch once
        for key, value in weights(trainer).items():
            assert torch.equal(value, expected[1][key]), key
    finally:
        trainer.shutdown()
