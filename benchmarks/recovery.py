"""Time from a failure to training resumed: a killed worker process and a lost node, survivors kept or not.

Run from the repository root (it starts its own multi-node cluster on this machine)::

    PYTHONPATH=$PWD python benchmarks/recovery.py [--smoke-test] [--repeats N] [--json out.json] [--cases ...]
    PYTHONPATH=$PWD python benchmarks/recovery.py --cases process,spare --plot docs/images/recovery_timeline.png

A ``ray.cluster_utils.Cluster`` with a 0-CPU head and two 1-CPU worker nodes; 2 workers (one per node) train
the MLP of ``workloads.py`` with commits every 10 steps. Rank 1 stops at step 25 of the epoch; once the commit at
step 20 is stored, the benchmark either SIGKILLs rank 1's process (its node lives on: its bundle takes a
replacement) or removes rank 1's node (the group goes on without it). Each is run with survivors kept (the
default) and with ``SGD_KEEP_SURVIVORS=0`` (every worker restarts, as before). A third case drains rank 1's node
instead (Ray's preemption notice, as ``ray start --block`` sends it on SIGTERM) once the step-20 commit is stored,
with a spare node to move to; rank 1 does not stop. The case "spare" kills rank 1's process as the first case does,
with ``TorchTrainer(num_spares=1)``: a third 1-CPU node holds the spare's bundle (removed after the case); it also
gives the spare's refill time (from the refill's start to its spare ready) and the cost of an idle spare (its
resident memory, and its CPU use while the group trains, beside a rank's). The case "node-spare" removes rank 1's
node as "node" does, with ``num_spares=1``: a third node holds the spare (which takes rank 1, so the group keeps
its size) and a fourth is free, so that Ray places the lost rank's bundle there again and the spare is refilled
(its refill time as in "spare"; the nodes added are removed after the case). "node-killed-spare" is "node-spare"
with rank 1's process SIGKILLed as its node is removed: ``remove_node`` ends the node's Ray processes, but a
worker process on it goes on training until it notices its raylet is gone (~1.5 s), where a lost machine's
processes end with it (a preempted VM's shutdown ends them; the peers' connections are closed at once). The table
gives the seconds from the event to training resumed (the end of the longest pause in the batch log after it; median of ``--repeats``), the
batches computed twice, and the workers and failures after recovery.

Two cases keep the healthy ranks in their processes at a planned resize (docs: "Partial moves and grows"):
"drain-spare" drains rank 1's node with ``num_spares=1`` (a third node holds the spare, a fourth is free for its
refill): rank 0 stays, the spare takes rank 1; "grow" starts ``num_workers=(2, 3)`` on the two nodes and adds a
third node's CPU (held by a placement group of the benchmark's until then) once the step-20 commit is stored: both
ranks stay, rank 2 starts in a placement group of its own. Both, and the three cases with a spare, say whether
the kept ranks kept their process ids; the batches computed twice are counted from each rank's steps.

The log (stderr) gives each run's three longest pauses after the event (their length and start), when
``remove_node`` returned, and when the refill's process started (from ``/proc``), so that a pause can be set
against them. Each row of ``--json`` also holds its median run's batches around the event (``timeline``: seconds
from the event and rank), which ``--plot PATH`` draws as a timeline (``benchmarks/plots.py``).
"""
import datetime
import json
import logging
import os
import platform
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from tabulate import tabulate  # noqa: E402

import plots  # noqa: E402
from commits import LoggingOperator, bench_args  # noqa: E402
from raysgd import TorchTrainer  # noqa: E402
from workloads import workload_spec  # noqa: E402

FAST_HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
DEADLINE_S = 300
EVENTS = {"process": "rank 1's process killed", "node": "rank 1's node lost",
          "drain": "rank 1's node drained (notice)", "spare": "rank 1's process killed, with a spare",
          "drain-spare": "rank 1's node drained (notice), with a spare", "grow": "a node added: grow 2 -> 3",
          "node-spare": "rank 1's node lost, with a spare",
          "node-killed-spare": "rank 1's node lost with its processes, with a spare"}
SURVIVORS = {"drain": "all moved at a commit", "drain-spare": "rank 0 kept, the spare took rank 1",
             "grow": "both kept, rank 2 new", "spare": "rank 0 kept, the spare took rank 1",
             "node-spare": "rank 0 kept, the spare took rank 1",
             "node-killed-spare": "rank 0 kept, the spare took rank 1"}
CASES = (("process", True), ("process", False), ("spare", True), ("node", True), ("node-spare", True),
         ("node-killed-spare", True), ("node", False), ("drain", True), ("drain-spare", True), ("grow", True))
CASE_NAMES = ("process", "process-restart", "spare", "node", "node-spare", "node-killed-spare", "node-restart",
              "drain", "drain-spare", "grow")
SPARE_CASES = ("spare", "node-spare", "node-killed-spare", "drain-spare")
TIMELINE_S = (-3.0, 10.0)  # the batches kept for the picture: seconds from the event
REFILLED_ELSEWHERE = ("drain-spare", "node-spare", "node-killed-spare")  # a fourth node for the spare's refill


def _live_worker_nodes():
    return sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0)


def _add_node(cluster):
    """One more 1-CPU node, once Ray lists it (``wait_for_nodes`` also counts drained nodes that ended); returns it."""
    want, deadline = _live_worker_nodes() + 1, time.monotonic() + DEADLINE_S
    node = cluster.add_node(num_cpus=1)
    while _live_worker_nodes() < want and time.monotonic() < deadline:
        time.sleep(0.1)
    return node


def _back_to_two(cluster):
    """After a drain case: wait (bounded) for the drained node to end, remove it if it did not (the trainer shut
    down: nothing of the run is left on it; Ray places nothing on a draining node, so it must not count as one of
    the two), then remove added nodes until two worker nodes are left."""
    from raysgd.torch.execution import cluster_state  # noqa: PLC0415

    deadline = time.monotonic() + 60
    while cluster_state.draining_nodes() and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    for node in list(cluster.worker_nodes):
        if node.node_id in alive and node.node_id in cluster_state.draining_nodes():
            _remove_free_node(cluster, node)
    for node in reversed(list(cluster.worker_nodes)):
        if _live_worker_nodes() <= 2:
            break
        if node.node_id in alive and node.node_id not in cluster_state.draining_nodes():
            _remove_free_node(cluster, node)


def _remove_free_node(cluster, node):
    """Remove worker ``node`` (no actor is left on it once the trainer shut down) and wait until it is gone."""
    want, deadline = _live_worker_nodes() - 1, time.monotonic() + DEADLINE_S
    cluster.remove_node(node)
    while _live_worker_nodes() > want and time.monotonic() < deadline:
        time.sleep(0.1)


def _drain(cluster, node_id):
    from ray.core.generated import autoscaler_pb2  # noqa: PLC0415

    accepted, why = ray._raylet.GcsClient(address=cluster.address).drain_node(
        node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "benchmark: preempted",
        int((time.time() + 120) * 1000))
    if not accepted:
        raise RuntimeError(f"the drain was refused: {why}")


def _proc(pid):
    """``(resident MiB, CPU seconds)`` of process ``pid`` on this machine (Linux's /proc)."""
    with open(f"/proc/{pid}/status") as handle:
        rss_kib = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return rss_kib / 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _started_at(pid):
    """When process ``pid`` of this machine started (seconds since the epoch, to a clock tick: Linux's /proc)."""
    with open(f"/proc/{pid}/stat") as handle:
        ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as handle:  # to 0.01 s (/proc/stat's boot time is whole seconds)
        uptime = float(handle.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def _spare_cost(trainer, seconds):
    """The idle spare's and rank 0's resident MiB and CPU share (CPU seconds per second) over ``seconds`` of
    training."""
    spare, rank0 = trainer.worker_group.spares.pids()[0], trainer.apply_all_workers(os.getpid)[0]
    before = {pid: _proc(pid) for pid in (spare, rank0)}
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        trainer.train(num_steps=20)
    wall = time.monotonic() - start
    after, cost = {pid: _proc(pid) for pid in (spare, rank0)}, {}
    for name, pid in (("spare", spare), ("rank0", rank0)):
        cost[f"{name}_rss_mib"] = after[pid][0]
        cost[f"{name}_cpu_share"] = (after[pid][1] - before[pid][1]) / wall
    return cost


def _resumed_s(stamps, t_event):
    """Seconds from ``t_event`` to the first batch after the longest pause in the batch log that follows it."""
    after = [t for t in stamps if t > t_event]
    before = max([t for t in stamps if t <= t_event], default=t_event)
    gaps = [(b - a, b) for a, b in zip([before, *after], after)]
    return max(gaps)[1] - t_event


def _one(cluster, fault, keep, smoke, work_dir, run):
    sizes = workload_spec("mlp", smoke)
    steps, step = (40, 25) if smoke else (120, 25)
    log, path = os.path.join(work_dir, f"log-{run}"), os.path.join(work_dir, f"fault-{run}")
    os.environ["SGD_KEEP_SURVIVORS"] = "1" if keep else "0"
    # somewhere to move to (the drained node ends once the workers left it), or the spare's node
    added = _add_node(cluster) if fault in ("drain", *SPARE_CASES) else None
    hog = None
    if fault in REFILLED_ELSEWHERE:
        _add_node(cluster)  # the spare's refill goes somewhere (Ray places the lost or drained rank's bundle there)
    elif fault == "grow":  # a third node, held by a placement group of its own until the event removes it
        os.environ["SGD_RESIZE_COOLDOWN_S"] = "0"
        _add_node(cluster)
        hog = ray.util.placement_group([{"CPU": 1}])
        ray.get(hog.ready(), timeout=DEADLINE_S)
    with_spare, planned = fault in SPARE_CASES, fault in ("drain", "drain-spare", "grow")
    trainer = TorchTrainer(training_operator_cls=LoggingOperator, num_workers=(2, 3) if fault == "grow" else 2,
                           timeout_s=60, commit_every_n_steps=10, num_spares=1 if with_spare else 0,
                           config=dict(model="mlp", batch_size=sizes["batch_size"], log=log, fault_step=step,
                                       fault_path=None if planned else path, log_steps=True,
                                       num_samples=2 * sizes["batch_size"] * steps))
    try:
        node_of_rank1 = trainer.apply_all_workers(lambda: ray.get_runtime_context().get_node_id())[1]
        pids = trainer.apply_all_workers(os.getpid)
        extra = {}
        if with_spare:
            if trainer.worker_group.spares.wait_ready(1, DEADLINE_S) != 1:
                raise RuntimeError("the spare did not become ready")
            spare_pid = trainer.worker_group.spares.pids()[0]
        result = {}
        thread = threading.Thread(target=lambda: result.update(stats=trainer.train()), daemon=True)
        thread.start()
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and thread.is_alive():  # the stop at step 25, after the step-20 commit
            if (planned or os.path.exists(path)) and \
                    (trainer.latest_commit() or {}).get("cursor", {}).get("steps", -1) >= 20:
                break
            time.sleep(0.01)
        t_kill = time.time()
        if fault in ("process", "spare"):
            os.kill(int(open(path).read()), signal.SIGKILL)
            logging.getLogger("raysgd.benchmark").info("SIGKILL sent to rank 1")
        elif fault in ("drain", "drain-spare"):
            _drain(cluster, node_of_rank1)
        elif fault == "grow":
            ray.util.remove_placement_group(hog)  # the third node's CPU is free: the grow check sees it
            hog = None
        else:
            if fault == "node-killed-spare":  # the node's processes end with it, as a machine's shutdown ends them
                os.kill(pids[1], signal.SIGKILL)
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == node_of_rank1),
                                allow_graceful=False)
            logging.getLogger("raysgd.benchmark").info("rank 1's node removed (remove_node returned %.2f s after "
                                                        "the event)", time.time() - t_kill)
        thread.join(timeout=DEADLINE_S)
        if "stats" not in result:
            raise RuntimeError(f"train() did not finish ({fault}, keep={keep})")
        logged = [line.split() for line in open(log).read().splitlines()]
        stamps = [float(fields[0]) for fields in logged]
        after = [t for t in stamps if t > t_kill]
        gaps = sorted(((b - a, a - t_kill, i) for i, (a, b) in enumerate(zip(after, after[1:]))), reverse=True)[:3]
        logging.getLogger("raysgd.benchmark").info("longest pauses after the first batch (s, at s after the kill, "
                                                    "batch): %s", [tuple(round(x, 2) for x in g) for g in gaps])
        after_pids = trainer.apply_all_workers(os.getpid)
        if planned or with_spare:
            kept = pids[:2] if fault == "grow" else pids[:1]
            extra["kept_pids"] = after_pids[:len(kept)] == kept
        if with_spare:
            extra["rank1_is_the_spare"] = after_pids[1] == spare_pid
            if trainer.worker_group.spares.wait_ready(1, DEADLINE_S if fault == "spare" else 60) != 1:
                if fault == "spare":
                    raise RuntimeError("the spare was not refilled")
                extra["refill_s"] = None  # its bundle is on the draining node, or was not placed again in time
            else:
                extra["refill_s"] = trainer.worker_group.spares.last_refill_s
                logging.getLogger("raysgd.benchmark").info(
                    "the refill's process started %.2f s after the event; %.2f s from its start to ready",
                    _started_at(trainer.worker_group.spares.pids()[0]) - t_kill, extra["refill_s"])
            if fault == "spare":
                extra.update(_spare_cost(trainer, 3 if smoke else 10))
        ran = [(fields[1], fields[2]) for fields in logged]
        timeline = [[round(float(fields[0]) - t_kill, 4), int(fields[1])] for fields in logged
                    if TIMELINE_S[0] <= float(fields[0]) - t_kill <= TIMELINE_S[1]]
        return {"resumed_s": _resumed_s(stamps, t_kill), "timeline": timeline,
                "next_batch_s": min(t for t in stamps if t > t_kill) - t_kill,
                "recomputed": len(ran) - len(set(ran)) if planned else len(stamps) - 2 * steps,
                "workers_after": trainer.worker_group.num_workers, "failures": trainer.num_failures,
                "num_samples": result["stats"]["num_samples"], **extra}
    finally:
        trainer.shutdown()
        os.environ.pop("SGD_RESIZE_COOLDOWN_S", None)
        if hog is not None:
            ray.util.remove_placement_group(hog)
        if fault == "node":
            _add_node(cluster)  # back to two worker nodes for the next run
        elif fault == "spare":
            _remove_free_node(cluster, added)  # back to two worker nodes for the next case
        elif fault in ("grow", *REFILLED_ELSEWHERE):
            _back_to_two(cluster)


def main():
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("raysgd").setLevel(logging.INFO)  # the recovery's steps, timed, on stderr
    args = bench_args(__doc__, "runs per setting (median)", cases=CASE_NAMES,
                      plot="a timeline of each case's batches around the event")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)",
            "load_average": list(os.getloadavg()), "smoke": args.smoke_test}
    chosen = set(args.cases.split(","))
    repeats = 1 if args.smoke_test else args.repeats
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": FAST_HEALTH_CHECK})
    rows = []
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}})
        with tempfile.TemporaryDirectory() as work_dir:
            for (fault, keep), name in zip(CASES, CASE_NAMES):
                if name not in chosen:
                    continue
                runs = [_one(cluster, fault, keep, args.smoke_test, work_dir, f"{fault}-{keep}-{i}")
                        for i in range(repeats)]
                times = sorted(r["resumed_s"] for r in runs)
                median_run = sorted(runs, key=lambda r: r["resumed_s"])[len(runs) // 2]
                rows.append({"case": name, "event": EVENTS[fault],
                             "survivors": SURVIVORS.get(fault) or ("kept" if keep else
                                                                   "restarted (SGD_KEEP_SURVIVORS=0)"),
                             "event_to_resumed_s": times[len(times) // 2],
                             "event_to_next_batch_s": sorted(r["next_batch_s"] for r in runs)[len(runs) // 2],
                             "recomputed_batches": max(r["recomputed"] for r in runs),
                             "workers_after": runs[-1]["workers_after"], "failures": runs[-1]["failures"],
                             "repeats": repeats, "all_s": times, "timeline": median_run["timeline"], "meta": meta})
                if "kept_pids" in runs[-1]:
                    rows[-1]["kept_pids"] = all(r["kept_pids"] for r in runs)
                if fault in REFILLED_ELSEWHERE:
                    refills = sorted(r["refill_s"] for r in runs if r["refill_s"] is not None)
                    rows[-1].update(refill_s=refills[len(refills) // 2] if refills else None,
                                    refilled=f"{len(refills)}/{len(runs)}",
                                    rank1_is_the_spare=all(r["rank1_is_the_spare"] for r in runs))
                if fault == "spare":
                    rows[-1].update(refill_s=sorted(r["refill_s"] for r in runs)[len(runs) // 2],
                                    rank1_is_the_spare=all(r["rank1_is_the_spare"] for r in runs),
                                    **{k: runs[-1][k] for k in runs[-1] if k.endswith(("_rss_mib", "_cpu_share"))})
    finally:
        os.environ.pop("SGD_KEEP_SURVIVORS", None)
        ray.shutdown()
        cluster.shutdown()
    print(tabulate([{k: v for k, v in row.items() if k not in ("timeline", "meta")} for row in rows], headers="keys",
                   floatfmt=".2f"))
    if args.plot:
        print("drawn:", plots.recovery(rows, args.plot))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
