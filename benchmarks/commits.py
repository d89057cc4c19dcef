"""What commits inside an epoch cost and save: steady-state overhead, work lost per failure, recovery, latency.

Run from the repository root (it starts its own local Ray cluster)::

    PYTHONPATH=$PWD python benchmarks/commits.py [--smoke-test] [--json out.json]

Tables (tabulate):
- samples/s at 2 workers on the MLP and ResNet-8 with commits off, every 100 steps, every 10 steps and the
  default (about every ``SGD_COMMIT_INTERVAL_S`` s), and each one's ratio to "off";
- steps recomputed after a SIGKILL of rank 1 mid-epoch, with commits every 10 steps against commits off (today's
  epoch restart), and the time from the kill to the first batch trained again;
- commit latency for a ~100 MB model: the host copy the loop waits for, and the time until the store holds it.
"""
import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
from tabulate import tabulate  # noqa: E402

from raysgd import TorchTrainer  # noqa: E402
from raysgd_costs import BenchOperator  # noqa: E402
from workloads import workload_spec  # noqa: E402

DEADLINE_S = 300


class LoggingOperator(BenchOperator):
    """BenchOperator that appends each executed batch to ``config["log"]`` (its time; with ``config["log_steps"]`` also
    its rank and global step) and stops at ``config["fault_step"]``."""

    def train_batch(self, batch, batch_info):
        fault, path = self.config.get("fault_step"), self.config.get("fault_path")
        if path and self.world_rank == 1 and self.global_step == fault and not os.path.exists(path):
            with open(path + ".tmp", "w") as handle:
                handle.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(DEADLINE_S)  # killed by the driver
        metrics = super().train_batch(batch, batch_info)
        if self.config.get("log"):  # with log_steps, each line also names the rank and the step
            with open(self.config["log"], "a") as handle:
                handle.write(f"{time.time()} {self.world_rank} {self.global_step}\n" if self.config.get("log_steps")
                             else f"{time.time()}\n")
        return metrics


def _trainer(every, workers=2, operator=BenchOperator, **config):
    return TorchTrainer(training_operator_cls=operator, num_workers=workers, use_gpu=False, timeout_s=60,
                        commit_every_n_steps=every, config=config)


SETTINGS = (("off", 0), ("every 100", 100), ("every 10", 10), ("default", None))


def overhead(model, smoke, repeats):
    """Steady-state samples/s for each commit setting: one trainer, the settings interleaved call by call.

    Each of ``repeats`` rounds runs one ``train(num_steps=steps)`` call per setting, in an order rotated every
    round, switching the trainer's commit setting between calls (its ``CommitPolicy.every_n``); the median per
    setting. One trainer and interleaving keep the machine's drift and the workers' placement out of the ratios.
    """
    sizes = workload_spec(model, smoke)
    steps = 20 if smoke else (200 if model == "mlp" else 60)
    trainer = _trainer(None, model=model, batch_size=sizes["batch_size"],
                       num_samples=2 * sizes["batch_size"] * steps * (len(SETTINGS) * repeats + 1))
    rates = {label: [] for label, _ in SETTINGS}
    try:
        trainer.train(num_steps=max(5, steps // 4))  # warm-up
        for round_ in range(repeats):
            for label, every in SETTINGS[round_ % len(SETTINGS):] + SETTINGS[:round_ % len(SETTINGS)]:
                trainer.controller.commits.every_n = every
                start = time.perf_counter()
                trainer.train(num_steps=steps)
                rates[label].append(2 * sizes["batch_size"] * steps / (time.perf_counter() - start))
    finally:
        trainer.shutdown()
    rows = [{"model": model, "commits": label, "samples_per_s": sorted(rates[label])[len(rates[label]) // 2]}
            for label, _ in SETTINGS]
    for row in rows:
        row["ratio_to_off"] = row["samples_per_s"] / rows[0]["samples_per_s"]
    return rows


def lost_work(smoke, work_dir):
    """SIGKILL rank 1 at step ``k`` of a 2-worker MLP epoch: batches recomputed, and kill-to-next-batch seconds."""
    sizes = workload_spec("mlp", smoke)
    steps, fault = (40, 25) if smoke else (120, 75)
    rows = []
    for label, every in (("off (epoch restart)", 0), ("every 10", 10)):
        log, path = os.path.join(work_dir, f"log-{every}"), os.path.join(work_dir, f"fault-{every}")
        trainer = _trainer(every, operator=LoggingOperator, model="mlp", batch_size=sizes["batch_size"],
                           num_samples=2 * sizes["batch_size"] * steps, log=log, fault_step=fault, fault_path=path)
        box = {}

        def kill(trainer=trainer, path=path, every=every, box=box):
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                ready = os.path.exists(path) and (every == 0 or (trainer.latest_commit() or {}).get(
                    "cursor", {}).get("steps", -1) >= (fault // every) * every)
                if ready:
                    box["t_kill"] = time.time()
                    os.kill(int(open(path).read()), signal.SIGKILL)
                    return
                time.sleep(0.01)

        watcher = threading.Thread(target=kill, daemon=True)
        watcher.start()
        try:
            stats = trainer.train()
            watcher.join(timeout=5)
            stamps = [float(line) for line in open(log).read().split()]
            after = [t for t in stamps if t > box["t_kill"]]
            rows.append({"commits": label, "epoch_steps": steps, "killed_at_step": fault,
                         "steps_recomputed": len(stamps) // 2 - steps, "kill_to_next_batch_s": min(after) - box["t_kill"],
                         "num_samples": stats["num_samples"]})
        finally:
            trainer.shutdown()
    return rows


def latency(smoke, repeats):
    """Commit timings of a single worker on the ``wide`` model (100 MB; 10 MB in a smoke test), commits every step."""
    width = 1600 if smoke else 5000
    trainer = _trainer(1, workers=1, model="wide", width=width, momentum=0.0, batch_size=2,
                       num_samples=2 * (repeats + 2))
    try:
        rows = []
        for _ in range(repeats):
            trainer.train(num_steps=1)
            stats = trainer.apply_all_workers(_commit_stats)[0]
            rows.append(stats)
        return [{"model_mb": rows[-1]["bytes"] / 2**20,
                 "in_loop_ms": 1000 * sorted(r["in_loop_s"] for r in rows)[len(rows) // 2],
                 "to_store_ms": 1000 * sorted(r["latency_s"] for r in rows)[len(rows) // 2]}]
    finally:
        trainer.shutdown()


def _commit_stats():
    from raysgd.torch.commits.commit_stats import process_stats  # noqa: PLC0415 (in the worker)

    stats = process_stats()
    stats.wait_stored(after=0, timeout_s=60)
    return stats.snapshot()


def bench_args(doc, repeats_help, cases=None, plot=None):
    """``--smoke-test``, ``--json`` and ``--repeats`` (default 3), the options of the benchmarks beside this one;
    with ``cases`` (their names) also ``--cases`` (comma-separated, default all); with ``plot`` (what the picture
    shows) also ``--plot PATH``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    if cases:
        parser.add_argument("--cases", default=",".join(cases), help=f"which of {', '.join(cases)}")
    if plot:
        parser.add_argument("--plot", metavar="PATH", help=f"also draw {plot} as a PNG there (benchmarks/plots.py)")
    return parser.parse_args()


def main():
    args = bench_args(__doc__, "timed calls per setting (median)")
    ray.init(address="local", num_cpus=4, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}})
    repeats = 1 if args.smoke_test else args.repeats
    results = {"overhead": [], "lost_work": [], "latency": []}
    try:
        for model in ("mlp", "resnet"):
            results["overhead"] += overhead(model, args.smoke_test, repeats)
        with tempfile.TemporaryDirectory() as work_dir:
            results["lost_work"] = lost_work(args.smoke_test, work_dir)
        results["latency"] = latency(args.smoke_test, repeats)
    finally:
        ray.shutdown()
    for name, rows in results.items():
        print(f"\n{name}\n" + tabulate(rows, headers="keys", floatfmt=".3f"))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
