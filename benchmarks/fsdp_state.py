"""The sharded state's costs under FSDP: call-start snapshot, commit, durable checkpoint, and resumes on other sizes.

Run from the repository root (it starts its own local Ray cluster with 4 logical CPUs)::

    PYTHONPATH=$PWD python benchmarks/fsdp_state.py                 # 1024-2048-2048-2048-1024 MLP, Adam: ~150 MB
    PYTHONPATH=$PWD python benchmarks/fsdp_state.py --smoke-test    # toy size (the tests run it)

For each worker count N (``--workers``), ``TorchTrainer(strategy="fsdp", num_workers=N, storage_path=..., 
commit_every_n_steps=1)`` trains ``benchmarks/fsdp.py``'s MLP with Adam (the state: parameters and two Adam moments,
about 3x the parameters' bytes, sharded over the N ranks). Measured:

- ``snapshot_ms``: a ``train(num_steps=2)`` call's wall time minus the slowest worker's own time in it (the driver's
  per-call overhead: each rank writes its part of the call-start snapshot into its node's object store, at once);
- ``commit_ms``: the latest commit's latency (every rank's part saved, handed to its node's holder, and its record
  stored; the slowest rank's), ``trainer.last_commit_latency_s``;
- ``checkpoint_s``: the durable checkpoint of a call's result, from the call's return until it is durable (every
  rank's part written by a task on its node, in parallel, then the head, ``.metadata`` and the marker);
- ``resume_to_M_s``: a new trainer of M workers resuming from that checkpoint (the parts resharded from N to M): its
  construction time minus that of the same trainer without a checkpoint to resume from, for every M of
  ``--workers``.

Prints the table and the JSON (``--json PATH`` also writes it).
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
from raysgd.utils import BATCH_SIZE  # noqa: E402


def trainer(workers, widths, storage, resume=True):
    return TorchTrainer(training_operator_cls=MLPOperator, num_workers=workers, strategy="fsdp", timeout_s=300,
                        config={BATCH_SIZE: GLOBAL_BATCH, "widths": widths, "samples": GLOBAL_BATCH * 16},
                        storage_path=storage, resume=resume, commit_every_n_steps=1)


def measure_run(workers, widths, storage):
    """``snapshot_ms``, ``commit_ms`` and ``checkpoint_s`` of N workers; leaves a checkpoint in ``storage``."""
    run = trainer(workers, widths, storage, resume=False)
    try:
        run.train(num_steps=1)  # warm-up: the first call's imports, the holders' and the write tasks' processes
        run.controller.durable.flush(timeout_s=600)
        overheads = []
        for _ in range(2):  # 2 steps a call: the first step's commit is stored before the second commits
            started = time.perf_counter()
            result = run.train(num_steps=2, profile=True)
            overheads.append(time.perf_counter() - started - result["profile"]["mean_train_epoch_s"])
        started = time.perf_counter()
        run.controller.durable.flush(timeout_s=600)
        return {"snapshot_ms": 1000 * min(overheads), "commit_ms": 1000 * run.last_commit_latency_s,
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="toy model, 2 and 1 workers")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--json", help="also write the results there")
    args = parser.parse_args(argv)
    widths = [16, 32, 32, 16] if args.smoke_test else [1024, 2048, 2048, 2048, 1024]
    counts = [2, 1] if args.smoke_test else [int(n) for n in args.workers.split(",")]
    load_at_start = os.getloadavg()
    folder = tempfile.mkdtemp(prefix="raysgd-fsdp-state-")
    rows = []
    try:
        cluster(max(counts))
        for workers in counts:
            storage = os.path.join(folder, f"n{workers}")
            row = {"workers": workers, **measure_run(workers, widths, storage)}
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
    return emit(f"MLP {'-'.join(map(str, widths))}, Adam, FSDP", {"meta": meta, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
