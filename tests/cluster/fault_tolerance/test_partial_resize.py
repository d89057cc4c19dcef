"""Partial moves and grows (README "Partial moves and grows") on a real multi-node cluster: a drain move or a grow at
a commit point keeps the ranks on healthy nodes in their processes; only the moved or added ranks are new processes
(or warm spares)."""
import os
import threading
import time

import pytest
import torch

from conftest import assert_released, local_cluster
from helpers import CountingOperator, seeding_hook
from raysgd import TorchTrainer
from test_draining import add_node, drain, exactly, node_id
from test_spares import ready_spare_pids

pytestmark = pytest.mark.slow

COMMON = dict(training_operator_cls=CountingOperator, initialization_hook=seeding_hook, commit_every_n_steps=2,
              timeout_s=30)


@pytest.fixture(scope="module")
def cluster():
    """A 0-CPU head and three 1-CPU nodes (tests add nodes as drains use them up)."""
    with local_cluster({"num_cpus": 0}, [{"num_cpus": 1}] * 3) as (made, nodes):
        yield made, list(nodes)


def config(n, tmp_path, gate=True):
    """``n`` samples in batches of 4 per rank, each batch logged; with ``gate``, rank 0 holds step 6 until the
    driver's request to stop arrives (so the epoch cannot end before the drain or the grow is seen)."""
    made = {"n": n, "batch_size": 4, "log": str(tmp_path / "batches.log")}
    if gate:
        made["fault"] = {"step": 6, "rank": 0, "marker": str(tmp_path / "gate"), "until_resize": True}
    return made


def wait_for(path, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s} s"
        time.sleep(0.02)


def lines(tmp_path):
    """``[(rank, global step)]`` of every batch run, in order."""
    return [tuple(map(int, line.split())) for line in (tmp_path / "batches.log").read_text().splitlines()]


def assert_same_state(got, expected):
    for key, value in expected["models"][0].items():
        assert torch.equal(got["models"][0][key], value), key
    for index, state in expected["optimizers"][0]["state"].items():
        for name, value in state.items():
            assert torch.equal(got["optimizers"][0]["state"][index][name], value), (index, name)


def uninterrupted(n, tmp_path):
    """The state after one epoch of ``n`` samples at 2 workers with nothing drained (in ``tmp_path / "clean"``)."""
    (tmp_path / "clean").mkdir()
    clean = TorchTrainer(num_workers=2, config=config(n, tmp_path / "clean", gate=False), **COMMON)
    try:
        clean.train()
        return clean.state_dict()
    finally:
        clean.shutdown()


def test_a_drain_move_keeps_the_healthy_rank_and_a_spare_takes_the_moved_one(cluster, tmp_path, monkeypatch):
    """Rank 1's node drains mid-epoch (no free node, a warm spare on the third): every rank stops at the next commit
    point, rank 0 keeps its process, the spare takes rank 1; every sample trained once, nothing recomputed, no
    failure, and the state is bit-identical to an uninterrupted run. A node added later takes the spare's refill."""
    made, nodes = cluster
    exactly(made, nodes, 3)
    monkeypatch.setenv("SGD_DRAIN_CHECK_S", "0.2")
    n = 96
    expected = uninterrupted(n, tmp_path)

    trainer = TorchTrainer(num_workers=2, num_spares=1, config=config(n, tmp_path), **COMMON)
    try:
        spare_pid, = ready_spare_pids(trainer)
        pids, nodes_before = trainer.apply_all_workers(os.getpid), trainer.apply_all_workers(node_id)
        assert len(set(nodes_before)) == 2

        def drain_at_the_gate():
            wait_for(tmp_path / "gate")
            drain(made, nodes_before[1])

        thread = threading.Thread(target=drain_at_the_gate, daemon=True)
        thread.start()
        stats = trainer.train(reduce_results=False)
        thread.join(timeout=5)
        assert trainer.apply_all_workers(os.getpid) == [pids[0], spare_pid]  # rank 0 kept; rank 1 is the spare
        assert nodes_before[1] not in trainer.apply_all_workers(node_id)
        assert trainer.num_failures == 0  # a move is no failure
        assert sum(s["num_samples"] for s in stats) == n
        got = trainer.state_dict()
        assert torch.equal(got["models"][0]["p"], torch.ones(n))  # every sample exactly once
        assert len(lines(tmp_path)) == n // 4  # nothing recomputed: each batch of 4 ran once
        assert_same_state(got, expected)
        add_node(made, nodes)  # room for the refill's placement group (nothing is placed on the draining node)
        ready_spare_pids(trainer, other_than=[pids[0], spare_pid])
    finally:
        trainer.shutdown()
    assert_released()


def test_a_drain_move_without_a_spare_keeps_the_healthy_rank(cluster, tmp_path, monkeypatch):
    """Rank 1's node drains mid-epoch, a free node elsewhere: rank 0 keeps its process and only rank 1 starts anew,
    in a placement group of its own on the free node; exactly once, nothing recomputed, bit-identical."""
    made, nodes = cluster
    exactly(made, nodes, 3)
    monkeypatch.setenv("SGD_DRAIN_CHECK_S", "0.2")
    n = 96
    expected = uninterrupted(n, tmp_path)

    trainer = TorchTrainer(num_workers=2, config=config(n, tmp_path), **COMMON)
    try:
        pids, nodes_before = trainer.apply_all_workers(os.getpid), trainer.apply_all_workers(node_id)

        def drain_at_the_gate():
            wait_for(tmp_path / "gate")
            drain(made, nodes_before[1])

        thread = threading.Thread(target=drain_at_the_gate, daemon=True)
        thread.start()
        stats = trainer.train(reduce_results=False)
        thread.join(timeout=5)
        after = trainer.apply_all_workers(os.getpid)
        assert after[0] == pids[0] and after[1] != pids[1]  # rank 0 kept its process
        assert nodes_before[1] not in trainer.apply_all_workers(node_id)
        assert trainer.num_failures == 0 and sum(s["num_samples"] for s in stats) == n
        got = trainer.state_dict()
        assert torch.equal(got["models"][0]["p"], torch.ones(n))
        assert len(lines(tmp_path)) == n // 4
        assert_same_state(got, expected)
    finally:
        trainer.shutdown()
    assert_released()


def test_a_grow_at_a_commit_point_keeps_both_survivors(cluster, tmp_path, monkeypatch):
    """(2, 3) workers on two nodes; a node added mid-epoch: every rank stops at the next commit point, both ranks keep
    their processes and only rank 2 starts (a second placement group); the same epoch finishes on 3 workers, every
    sample exactly once, nothing recomputed, no failure."""
    made, nodes = cluster
    exactly(made, nodes, 2)
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    monkeypatch.setenv("SGD_GROW_CHECK_S", "0.2")
    n = 92
    trainer = TorchTrainer(num_workers=(2, 3), config=config(n, tmp_path), **COMMON)
    try:
        assert trainer.worker_group.num_workers == 2
        pids = trainer.apply_all_workers(os.getpid)
        result = {}
        thread = threading.Thread(target=lambda: result.update(stats=trainer.train(reduce_results=False)),
                                  daemon=True)  # train in a thread: a node can only be added from the main one
        thread.start()
        wait_for(tmp_path / "gate")
        add_node(made, nodes)
        thread.join(timeout=180)
        assert not thread.is_alive() and "stats" in result
        after = trainer.apply_all_workers(os.getpid)
        assert len(after) == 3 and after[:2] == pids and after[2] not in pids  # both survivors kept
        assert trainer.num_failures == 0
        assert sum(s["num_samples"] for s in result["stats"]) == n
        assert torch.equal(trainer.state_dict()["models"][0]["p"], torch.ones(n))  # every sample exactly once
        ran = lines(tmp_path)
        assert len(ran) == len(set(ran))  # nothing recomputed: no rank ran a step twice
        first = min(step for rank, step in ran if rank == 2)  # the commit point the group grew at
        assert sorted(rank for rank, step in ran if step < first) == [0] * first + [1] * first
    finally:
        trainer.shutdown()
    assert_released()
