"""The sharded state's costs under FSDP: call-start snapshot, commit, durable checkpoint, and resumes on other sizes.

Run from the repository root (it starts its own local Ray cluster with 4 logical CPUs)::

    PYTHONPATH=$PWD python benchmarks/fsdp_state.py                 # 1024-2048-2048-2048-1024 MLP, Adam: ~150 MB
    PYTHONPATH=$PWD python benchmarks/fsdp_state.py --smoke-test    # toy size (the tests run it)

For each worker count N (``--workers``), ``TorchTrainer(strategy="fsdp", num_workers=N, storage_path=..., 
commit_every_n_steps=1)`` trains ``benchmarks/fsdp.py``'s MLP with Adam (the state: parameters and two Adam moments,
about 3x the parameters' bytes, sharded over the N ranks). Measured:

- ``snapshot_ms``: a ``train(num_steps=2)`` call's wall time minus the slowest worker's own time in it, in a run
  without ``storage_path`` and commits (the call-start snapshot's per-call overhead: every rank captures its shards at
  the call's start and writes its part beside the call; a wait of its first step for the parts counts in the
  worker's own time, as for DDP's in ``state_scaling.py``);
- ``with_checkpoint_ms``: the same with ``storage_path`` and ``commit_every_n_steps=1``, where every result is
  checkpointed: the checkpoint's snapshot of every rank's part is taken when the call returns, before the next;
- ``commit_ms``: the latest commit's latency (every rank's part saved, handed to its node's holder, and its record
  stored; the slowest rank's), ``trainer.last_commit_latency_s``;
- ``checkpoint_s``: the durable checkpoint of a call's result, from the call's return until it is durable (every
  rank's part written by a task on its node, in parallel, then the head, ``.metadata`` and the marker);
- ``resume_to_M_s``: a new trainer of M workers resuming from that checkpoint (the parts resharded from N to M): its
  construction time minus that of the same trainer without a checkpoint to resume from, for every M of
  ``--workers``.

The second table (``--reads``, default ``4:2,2:4``; the smoke test ``2:1``) is what each rank reads when a state of
N ranks loads on M: for each path the bytes rank r pulled (``r<r>`` column: MB and the ratio to what it loads, its
new shard and the replicated values, ``sharded.process_load_stats()``) and the driver's peak RSS growth while it ran:

- ``objects``: a restart point of the N trainer (each part in its node's object store) loaded by the M workers, as a
  restart after a failure or a resize loads it;
- ``load(path)``: ``save(path)`` of the N trainer, ``load(path)`` on the M trainer (the workers read the files);
- ``resume``: the N trainer's durable checkpoint (``storage_path``) resumed by the M trainer at its construction.

Prints the tables and the JSON (``--json PATH`` also writes it).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fsdp import GLOBAL_BATCH, MLPOperator, cluster, emit  # noqa: E402

from raysgd import TorchTrainer  # noqa: E402
from raysgd.torch.state import sharded  # noqa: E402
from raysgd.utils import BATCH_SIZE  # noqa: E402


def trainer(workers, widths, storage, resume=True, commit_every_n_steps=1):
    return TorchTrainer(training_operator_cls=MLPOperator, num_workers=workers, strategy="fsdp", timeout_s=300,
                        config={BATCH_SIZE: GLOBAL_BATCH, "widths": widths, "samples": GLOBAL_BATCH * 16},
                        storage_path=storage, resume=resume, commit_every_n_steps=commit_every_n_steps)


def _overheads(run, calls=3):
    """Per ``train(num_steps=2)`` call: its wall time minus the slowest worker's own time in it (seconds)."""
    overheads = []
    for _ in range(calls):
        started = time.perf_counter()
        result = run.train(num_steps=2, profile=True)
        overheads.append(time.perf_counter() - started - result["profile"]["mean_train_epoch_s"])
    return overheads


def measure_snapshot(workers, widths):
    """``snapshot_ms``: the per-call overhead of the call-start snapshot alone (no ``storage_path``, no commits), the
    lowest of 3 calls after a warm-up (as DDP's is measured in ``state_scaling.py``)."""
    run = trainer(workers, widths, None, resume=False, commit_every_n_steps=0)
    try:
        run.train(num_steps=1)  # warm-up: imports, and the first call's point (taken before it: none to fall back to)
        return {"snapshot_ms": 1000 * min(_overheads(run))}
    finally:
        run.shutdown()


def measure_run(workers, widths, storage):
    """``with_checkpoint_ms`` (the per-call overhead with a durable checkpoint of every result: its snapshot is
    taken when the call returns), ``commit_ms`` and ``checkpoint_s`` of N workers; leaves a checkpoint in
    ``storage``."""
    run = trainer(workers, widths, storage, resume=False)
    try:
        run.train(num_steps=1)  # warm-up: the first call's imports, the holders' and the write tasks' processes
        run.controller.durable.flush(timeout_s=600)
        overheads = _overheads(run, calls=2)  # 2 steps a call: the first step's commit is stored before the second's
        started = time.perf_counter()
        run.controller.durable.flush(timeout_s=600)
        return {"with_checkpoint_ms": 1000 * min(overheads), "commit_ms": 1000 * run.last_commit_latency_s,
                "checkpoint_s": time.perf_counter() - started}
    finally:
        run.shutdown()


def measure_resume(workers, widths, storage):
    """Seconds a trainer of ``workers`` takes to resume from ``storage`` beyond one that starts fresh."""
    times = {}
    for resume in (False, True):
        started = time.perf_counter()
        trainer(workers, widths, storage, resume=resume).shutdown()
        times[resume] = time.perf_counter() - started
    return times[True] - times[False]


def _driver_rss_mb():
    with open("/proc/self/status", encoding="utf-8") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024


def _reads(trainer):
    """``{"r<rank>": "MB pulled (ratio to needed)"}`` of every worker's latest sharded load, and the worst ratio."""
    stats = trainer.apply_all_workers(lambda: sharded.process_load_stats().latest())
    columns = {f"r{rank}": f"{read['pulled'] / 1e6:.2f} ({read['pulled'] / max(read['needed'], 1):.3f}x)"
               for rank, read in enumerate(stats)}
    return columns, max(read["pulled"] / max(read["needed"], 1) for read in stats)


def measure_reads(source, target, widths, folder):
    """Rows of what each of ``target`` ranks reads to load the state of ``source`` ranks, per path (see the module
    docstring)."""
    storage, path = os.path.join(folder, f"reads{source}"), os.path.join(folder, f"saved{source}")
    first = trainer(source, widths, storage, resume=False)
    try:
        first.train(num_steps=1)
        first.save(path)
        first.controller.durable.flush(timeout_s=600)
        point = first.controller.take_snapshot()  # its parts stay in the object store (the driver holds the refs)
        whole_mb = point.nbytes / 1e6
    finally:
        first.shutdown()
    rows = []
    before = _driver_rss_mb()
    second = trainer(target, widths, storage, resume=True)  # the durable resume
    try:
        resumed = _reads(second)
        for name, load in (("objects", lambda: second.controller.run("load_restart_point", *point.load_args())),
                           ("load(path)", lambda: second.load(path, blocking=True))):
            load()
            rows.append({"path": name, **_row(source, target, whole_mb, *_reads(second))})
        rows.append({"path": "resume", **_row(source, target, whole_mb, *resumed)})
    finally:
        second.shutdown()
    for row in rows:
        row["driver_rss_growth_mb"] = round(_driver_rss_mb() - before, 1)
    return rows


def _row(source, target, whole_mb, columns, worst):
    return {"from": source, "to": target, "state_mb": round(whole_mb, 1), "worst_ratio": round(worst, 3), **columns}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="toy model, 2 and 1 workers")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--reads", default="4:2,2:4", help="N:M pairs whose loads' reads are measured")
    parser.add_argument("--skip-costs", action="store_true", help="only the reads table")
    parser.add_argument("--json", help="also write the results there")
    args = parser.parse_args(argv)
    pairs = [(2, 1)] if args.smoke_test else [tuple(int(n) for n in pair.split(":")) for pair in args.reads.split(",")]
    widths = [16, 32, 32, 16] if args.smoke_test else [1024, 2048, 2048, 2048, 1024]
    counts = [2, 1] if args.smoke_test else [int(n) for n in args.workers.split(",")]
    load_at_start = os.getloadavg()
    folder = tempfile.mkdtemp(prefix="raysgd-fsdp-state-")
    rows, reads = [], []
    try:
        cluster(max(counts + [n for pair in pairs for n in pair]))
        for source, target in pairs:
            reads.extend(measure_reads(source, target, widths, folder))
        for workers in [] if args.skip_costs else counts:
            storage = os.path.join(folder, f"n{workers}")
            row = {"workers": workers, **measure_snapshot(workers, widths), **measure_run(workers, widths, storage)}
            for other in counts[1:] if args.smoke_test else counts:  # the smoke test: 2 workers resumed on 1
                row[f"resume_to_{other}_s"] = measure_resume(other, widths, storage)
            rows.append(row)
            if args.smoke_test:
                break
    finally:
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    meta = {"widths": widths, "global_batch": GLOBAL_BATCH, "smoke": args.smoke_test, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"), "load_average_start": load_at_start,
            "load_average_end": os.getloadavg()}
    return emit(f"MLP {'-'.join(map(str, widths))}, Adam, FSDP", {"meta": meta, "rows": rows, "reads": reads},
                args.json)


if __name__ == "__main__":
    main()
