"""How the cost of the training state grows with the model: the driver's memory, per-call overhead, commits, recovery.

Run from the repository root (it starts its own local Ray cluster)::

    PYTHONPATH=$PWD python benchmarks/state_scaling.py                        # 10 MB and 100 MB models
    PYTHONPATH=$PWD python benchmarks/state_scaling.py --sizes 10,100,1000    # with the 1 GB row
    PYTHONPATH=$PWD python benchmarks/state_scaling.py --smoke-test           # toy size (the tests run it)

For each size N: a model of N MB of float32 parameters (one square ``nn.Linear``, plain SGD: no optimizer state),
2 workers, ``commit_every_n_steps=1`` (every call commits), ``--calls`` calls of ``train(num_steps=1)``. Measured:

- ``driver_peak_rss_mb``: the driver process's peak RSS over the calls (``VmHWM`` of ``/proc/self/status``, reset
  with ``/proc/self/clear_refs`` before the calls), and ``driver_growth_mb`` above its RSS before them;
- ``overhead_ms``: per-call driver overhead, the call's wall time minus the slowest worker's own time in it
  (``profile=True``'s ``mean_train_epoch_s``; it includes waiting until the worker's commit is stored), median;
  ``call_ms`` the call's wall time, median (a snapshot serialised beside the call, longer than the call's first
  forward and backward, is waited for inside the worker's time: it leaves the overhead but not the call);
- ``commit_ms``: commit latency on rank 0 (the rank that sends the state), from the host copy's start until the
  store holds it (``raysgd.torch.commits.commit_stats.process_stats()``), median; ``in_loop_ms`` the part of it the training loop
  waits for;
- ``worker_peak_rss_mb``: rank 0's peak RSS in a call with a commit (``VmHWM``, reset at the call's start, read
  once its commit is stored), ``worker_start_anon_mb`` and ``worker_start_shm_mb`` its private and shared
  (``RssAnon``, ``RssShmem``) RSS at the call's start; ``commit_rise_mb`` that peak minus the RSS at the call's
  start, ``base_rise_mb`` the same for calls without commits, and ``commit_extra_x`` = (commit_rise - base_rise) / state: the commit's own
  peak host memory on the sending rank, in multiples of the state (the live state itself not counted). RSS that
  stays mapped between calls (Ray's object store pages, memory the allocator keeps) is not a rise, so
  ``anon_extra_x`` and ``shm_extra_x`` also give the commit's peaks of private memory (``RssAnon``) and of shared
  memory (``RssShmem``: the object store pages it wrote), sampled every millisecond in a thread, above the call's
  start, minus the same for calls without commits, in multiples of the state;
- ``recover_s``: a call of 4 steps in which the driver SIGKILLs rank 1 (by its pid) at the call's first batch,
  from the kill to the call's return, against ``call_s``, the same call without a kill.

Prints a table and the JSON (``--json PATH`` also writes it).
"""
import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ray  # noqa: E402
from tabulate import tabulate  # noqa: E402

from raysgd import TorchTrainer  # noqa: E402
from raysgd_costs import BenchOperator  # noqa: E402

DEADLINE_S = 300
RECOVER_STEPS = 4


def read_status():
    """``{"VmRSS", "VmHWM", "RssAnon", "RssShmem"}`` of this process in MB, from ``/proc/self/status``."""
    values = {}
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
                values[key] = int(rest.split()[0]) / 1024
    return values


class Sampler:
    """The peaks of ``RssAnon`` (private memory) and ``RssShmem`` (shared memory: Ray's object store pages this
    process wrote) above their values at the start, sampled every millisecond in a thread until :meth:`stop`."""

    def __init__(self):
        self.start = read_status()
        self.peak = dict(self.start)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(0.001):
            for key, value in read_status().items():
                self.peak[key] = max(self.peak[key], value)

    def stop(self):
        """``{"anon_mb", "shm_mb"}``: the rises of the two peaks."""
        self._done.set()
        self._thread.join(timeout=5)
        return {"anon_mb": self.peak["RssAnon"] - self.start["RssAnon"],
                "shm_mb": self.peak["RssShmem"] - self.start["RssShmem"]}


def reset_peak():
    """Reset this process's ``VmHWM`` to its current RSS (Linux: write 5 to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


class ScalingOperator(BenchOperator):
    """BenchOperator that records rank-local memory and commit timings per call, and lets the driver kill rank 1.

    config (besides BenchOperator's): ``arm_path`` (when that file exists, rank 1 writes its pid to
    ``pid_path`` at its next batch, once, and waits to be killed).
    """

    def setup(self, config):
        super().setup(config)
        self.calls = []

    def train_batch(self, batch, batch_info):
        arm, path = self.config.get("arm_path"), self.config.get("pid_path")
        if arm and self.world_rank == 1 and os.path.exists(arm) and not os.path.exists(path):
            with open(path + ".tmp", "w", encoding="ascii") as handle:
                handle.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(DEADLINE_S)  # the driver kills this process
        return super().train_batch(batch, batch_info)

    def train_epoch(self, iterator, info=None):
        from raysgd.torch.commits.commit_stats import process_stats  # noqa: PLC0415 (in the worker)

        commits = process_stats()
        count = commits.count
        reset_peak()
        sampler = Sampler()
        before = sampler.start["VmRSS"]
        stats = super().train_epoch(iterator, info)
        committing = bool((info or {}).get("commits"))
        if committing:
            commits.wait_stored(after=count, timeout_s=DEADLINE_S)
        self.calls.append({"rss_before_mb": before, "peak_mb": read_status()["VmHWM"], **sampler.stop(),
                           "start_anon_mb": sampler.start["RssAnon"], "start_shm_mb": sampler.start["RssShmem"],
                           "commits": committing,
                           "commit_s": commits.latency_s if committing else None,
                           "in_loop_s": commits.in_loop_s if committing else None,
                           "bytes": commits.bytes})
        return stats


def width_for(size_mb):
    """The width of a square ``nn.Linear`` holding about ``size_mb`` MB of float32 weights."""
    return max(8, int((size_mb * 2**20 / 4) ** 0.5))


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _kill_when_ready(path, box):
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if os.path.exists(path):
            box["t_kill"] = time.perf_counter()
            os.kill(int(open(path, encoding="ascii").read()), signal.SIGKILL)
            return
        time.sleep(0.005)


def measure(size_mb, calls, work_dir):
    """One row: the measures above for a model of ``size_mb`` MB."""
    width = width_for(size_mb)
    arm, path = os.path.join(work_dir, f"arm-{size_mb}"), os.path.join(work_dir, f"pid-{size_mb}")
    steps = calls + 2 * RECOVER_STEPS + 4
    trainer = TorchTrainer(training_operator_cls=ScalingOperator, num_workers=2, use_gpu=False, timeout_s=120,
                           commit_every_n_steps=1,
                           config=dict(model="wide", width=width, momentum=0.0, batch_size=2,
                                       num_samples=2 * 2 * steps, arm_path=arm, pid_path=path))
    try:
        trainer.train(num_steps=1, info={"commits": True})  # warm-up: lazy initialisation, the first commit
        reset_peak()
        driver_before = read_status()["VmRSS"]
        overheads, walls = [], []
        for _ in range(calls):
            start = time.perf_counter()
            stats = trainer.train(num_steps=1, profile=True, reduce_results=False, info={"commits": True})
            walls.append(time.perf_counter() - start)
            overheads.append(walls[-1] - max(s["profile"]["mean_train_epoch_s"] for s in stats))
        driver_peak = read_status()["VmHWM"]
        trainer.controller.commits.every_n = 0  # calls without commits: the worker's base rise
        for _ in range(2):
            trainer.train(num_steps=1, info={"commits": False})
        trainer.controller.commits.every_n = 1
        records = trainer.apply_all_operators(lambda op: op.calls)[0]
        state_mb = records[-3]["bytes"] / 2**20
        committed = [r for r in records[1:] if r["commits"]]
        base_rise = _median([r["peak_mb"] - r["rss_before_mb"] for r in records if not r["commits"]])
        commit_rise = _median([r["peak_mb"] - r["rss_before_mb"] for r in committed])
        rises = {kind: (_median([r[kind] for r in committed]) - _median([r[kind] for r in records if not r["commits"]]))
                 / state_mb for kind in ("anon_mb", "shm_mb")}

        start = time.perf_counter()
        trainer.train(num_steps=RECOVER_STEPS)
        call_s = time.perf_counter() - start
        box = {}
        killer = threading.Thread(target=_kill_when_ready, args=(path, box), daemon=True)
        killer.start()
        with open(arm, "w", encoding="ascii"):
            pass
        trainer.train(num_steps=RECOVER_STEPS)
        done = time.perf_counter()
        killer.join(timeout=5)
        return {"size_mb": size_mb, "state_mb": round(state_mb, 1), "calls": calls,
                "driver_peak_rss_mb": driver_peak, "driver_growth_mb": driver_peak - driver_before,
                "overhead_ms": 1000 * _median(overheads), "call_ms": 1000 * _median(walls),
                "commit_ms": 1000 * _median([r["commit_s"] for r in committed]),
                "in_loop_ms": 1000 * _median([r["in_loop_s"] for r in committed]),
                "worker_peak_rss_mb": _median([r["peak_mb"] for r in committed]),
                "worker_start_anon_mb": _median([r["start_anon_mb"] for r in committed]),
                "worker_start_shm_mb": _median([r["start_shm_mb"] for r in committed]),
                "commit_rise_mb": commit_rise, "base_rise_mb": base_rise,
                "commit_extra_x": (commit_rise - base_rise) / state_mb,
                "anon_extra_x": rises["anon_mb"], "shm_extra_x": rises["shm_mb"],
                "recover_s": done - box["t_kill"] if "t_kill" in box else None, "call_s": call_s,
                "failures": trainer.controller.num_failures}
    finally:
        trainer.shutdown()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100", help="model sizes in MB, comma-separated (1000: the 1 GB row)")
    parser.add_argument("--calls", type=int, default=5, help="timed train() calls per size")
    parser.add_argument("--smoke-test", action="store_true", help="one 1 MB model, 2 calls")
    parser.add_argument("--json", help="also write the rows there")
    args = parser.parse_args()
    sizes = [1] if args.smoke_test else [int(s) for s in args.sizes.split(",")]
    calls = 2 if args.smoke_test else args.calls
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}})
    try:
        with tempfile.TemporaryDirectory() as work_dir:
            rows = [measure(size, calls, work_dir) for size in sizes]
    finally:
        ray.shutdown()
    result = {"meta": {"smoke": args.smoke_test, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                       "memory": "VmHWM of /proc/self/status, reset by /proc/self/clear_refs",
                       "overhead": "wall - max(worker mean_train_epoch_s)"}, "rows": rows}
    print(tabulate(rows, headers="keys", floatfmt=".1f"))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="ascii") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
