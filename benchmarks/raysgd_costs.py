"""What raysgd costs beyond the training itself: driver overhead per train(), state snapshots, recovery time.

Runs inside the raysgd process of ``sides.py`` (a Ray cluster is already up), through the public
``TorchTrainer`` API plus two read-only looks inside: ``worker_group.first_answer("state_stream")`` (what
``train()`` calls for its snapshot) and the log records the trainer writes when a worker fails and when
the group is back.

Example (inside a running cluster)::

    costs = measure_costs({"smoke": True, "workers": [1, 2], "threads": 1})
"""
import logging
import os
import signal
import statistics
import threading
import time

import torch.nn as nn

from raysgd import TorchTrainer, TrainingOperator
from workloads import make_dataset, make_loader, make_model, make_optimizer, workload_spec

DEADLINE_S = 120


class BenchOperator(TrainingOperator):
    """raysgd's default training loop on a benchmark workload, recording when each batch ends.

    config: ``model``, ``batch_size``, ``num_samples`` (the global data set); optional ``momentum``,
    ``width`` (of the ``wide`` model), ``signal_batch`` and ``signal_path`` (rank 1 writes its pid there
    when it reaches that batch, once, then waits for the driver to kill it).
    """

    def setup(self, config):
        model = make_model(config["model"], width=config.get("width"))
        optimizer = make_optimizer(model, momentum=config.get("momentum", 0.9))
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.CrossEntropyLoss())
        dataset = make_dataset(config["model"], config["num_samples"], width=config.get("width"))
        self.register_data(train_loader=make_loader(dataset, config["batch_size"]))
        self.stamps = []
        self.setup_time = time.time()

    def train_batch(self, batch, batch_info):
        metrics = super().train_batch(batch, batch_info)
        self.stamps.append(time.time())
        path = self.config.get("signal_path")
        if (path and self.world_rank == 1 and batch_info["batch_idx"] == self.config["signal_batch"]
                and not os.path.exists(path)):
            with open(path + ".tmp", "w", encoding="utf-8") as handle:
                handle.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
            time.sleep(60)  # until the driver's kill lands (milliseconds): the epoch cannot end before it
        return metrics


def _median(values):
    return statistics.median(values) if values else None


def _trainer(spec, workers, **config):
    return TorchTrainer(training_operator_cls=BenchOperator, num_workers=workers,
                        num_cpus_per_worker=spec["threads"], use_gpu=False, config=config, timeout_s=60)


# ----------------------------------------------------------------------------------------- driver overhead
def driver_overhead(spec, repeats):
    """Wall time of ``train()`` minus the slowest worker's own epoch time, at 10 and 1,000 batches per call.

    Measured on the ``tiny`` model (so the snapshot is small) with the default ``max_retries=3``, which
    takes the state snapshot, and with ``max_retries=0``, which does not. The batch count is set with
    ``num_steps`` on a data set of 1,000 batches per worker (100 in a smoke test): the driver does the
    same for an epoch and for ``num_steps``. Returns the rows and the ``tiny`` model's snapshot row
    (measured on the first trainer, saving a start-up).
    """
    counts = (10, 100) if spec["smoke"] else (10, 1000)
    rows, tiny_snapshot = [], None
    for workers in spec["workers"]:
        trainer = _trainer(spec, workers, model="tiny", batch_size=4, num_samples=workers * 4 * counts[-1])
        try:
            trainer.train()  # warm-up: the first epoch, lazy initialisation
            for batches in counts:
                for retries in (3, 0):
                    overheads, walls = [], []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        stats = trainer.train(num_steps=batches, profile=True, reduce_results=False,
                                              max_retries=retries)
                        wall = time.perf_counter() - start
                        if any(s["batch_count"] != batches for s in stats):
                            raise RuntimeError(f"expected {batches} batches per worker, got "
                                               f"{[s['batch_count'] for s in stats]}")
                        overheads.append(wall - max(s["profile"]["mean_train_epoch_s"] for s in stats))
                        walls.append(wall)
                    rows.append(dict(workers=workers, batches=batches, max_retries=retries,
                                     overhead_ms=1000 * _median(overheads), train_ms=1000 * _median(walls),
                                     repeats=repeats))
            if tiny_snapshot is None:
                tiny_snapshot = snapshot_row(trainer, "tiny", repeats)
        finally:
            trainer.shutdown()
    return rows, tiny_snapshot


# ----------------------------------------------------------------------------------------- snapshots
def snapshot_row(trainer, name, repeats):
    """Rank 0's state bytes to the driver (what ``train()`` does first), timed directly and inside train()."""
    stream_s, size = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        stream = trainer.worker_group.first_answer("state_stream", deadline_s=DEADLINE_S)
        stream_s.append(time.perf_counter() - start)
        size = len(stream)
        del stream
    in_train = {}
    for retries in (3, 0):  # train() with and without its snapshot, one small step each
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            trainer.train(num_steps=1, max_retries=retries)
            walls.append(time.perf_counter() - start)
        in_train[retries] = _median(walls)
    return dict(model=name, state_mb=size / 2**20, snapshot_ms=1000 * _median(stream_s),
                in_train_ms=1000 * (in_train[3] - in_train[0]), repeats=repeats)


def snapshot_cost(spec, repeats):
    """:func:`snapshot_row` for the MLP (7 MB; not in a smoke test) and a 100 MB model (10 MB in a smoke test)."""
    wide = 1600 if spec["smoke"] else 5000  # 10 MB or 100 MB of float32 weights
    models = (("wide", wide),) if spec["smoke"] else (("mlp", None), ("wide", wide))
    rows = []
    for name, width in models:
        trainer = _trainer(spec, 1, model=name, width=width, momentum=0.0, batch_size=2, num_samples=4)
        try:
            rows.append(snapshot_row(trainer, name, repeats))
        finally:
            trainer.shutdown()
    return rows


# ----------------------------------------------------------------------------------------- recovery
class _LogTimes(logging.Handler):
    """Remembers when the trainer logged the failure and the restart."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.failed, self.restarted = [], []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Ending the attempt"):
            self.failed.append(record.created)
        elif message.startswith("Worker group restarted"):
            self.restarted.append(record.created)


def _kill_when_signalled(path, pids, box):
    def watch():
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if os.path.exists(path):
                pid = int(open(path, encoding="utf-8").read())
                box["t_kill"] = time.time()
                os.kill(pid, signal.SIGKILL)
                box["killed"] = pid if pid in pids else None
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def recovery_time(spec, repeats, keep_survivors=True):
    """SIGKILL rank 1 mid-epoch; seconds from the kill to the first batch trained by the restarted group.

    ``keep_survivors``: rank 0 keeps its process and only rank 1 is replaced (the default); False sets
    ``SGD_KEEP_SURVIVORS=0``, so both processes restart (as before survivors were kept).
    """
    previous_keep = os.environ.get("SGD_KEEP_SURVIVORS")
    os.environ["SGD_KEEP_SURVIVORS"] = "1" if keep_survivors else "0"
    sizes = workload_spec("mlp", spec["smoke"])
    batches = 40 if spec["smoke"] else 120
    handler = _LogTimes()
    raysgd_logger = logging.getLogger("raysgd")
    previous_level = raysgd_logger.level
    raysgd_logger.setLevel(logging.DEBUG)  # the failure's and the restart's lines are DEBUG (the controller's WARNING sums them up)
    raysgd_logger.addHandler(handler)
    trainer = _trainer(spec, 2, model="mlp", batch_size=sizes["batch_size"],
                       num_samples=2 * sizes["batch_size"] * batches)
    rows = []
    try:
        trainer.train(num_steps=5)
        for attempt in range(repeats):
            path = os.path.join(spec["work_dir"], f"recovery-{'kept' if keep_survivors else 'all'}-{attempt}.pid")
            trainer.apply_all_operators(lambda op, p=path: op.config.update(signal_path=p, signal_batch=batches // 4))
            pids = trainer.apply_all_workers(os.getpid)
            box = {}
            watcher = _kill_when_signalled(path, pids, box)
            failures = trainer.num_failures
            stats = trainer.train()
            watcher.join(timeout=1)
            if "t_kill" not in box or trainer.num_failures != failures + 1:
                raise RuntimeError(f"the kill did not land mid-epoch (killed: {box}, failures "
                                   f"{failures} -> {trainer.num_failures})")
            setup, first, pid = trainer.apply_all_operators(lambda op: (op.setup_time, op.stamps[0], os.getpid()))[0]
            if (pid == pids[0]) != keep_survivors:
                raise RuntimeError(f"rank 0 {'was' if pid != pids[0] else 'was not'} restarted after the kill "
                                   f"(SGD_KEEP_SURVIVORS={os.environ['SGD_KEEP_SURVIVORS']})")
            t_kill = box["t_kill"]
            failed = min(t for t in handler.failed if t >= t_kill)
            restarted = min(t for t in handler.restarted if t >= failed)
            rows.append(dict(recovery_s=first - t_kill, detect_s=failed - t_kill, restart_s=restarted - failed,
                             first_batch_s=first - restarted, setup_done_s=setup - t_kill,
                             samples=stats["num_samples"]))
    finally:
        trainer.shutdown()
        raysgd_logger.removeHandler(handler)
        raysgd_logger.setLevel(previous_level)
        if previous_keep is None:
            os.environ.pop("SGD_KEEP_SURVIVORS", None)
        else:
            os.environ["SGD_KEEP_SURVIVORS"] = previous_keep
    keys = ("recovery_s", "detect_s", "restart_s", "first_batch_s", "setup_done_s")
    summary = {key: _median([row[key] for row in rows]) for key in keys}
    return dict(summary, repeats=repeats, attempts=rows, workers=2, model="mlp",
                mode="rank 0 kept, rank 1 replaced" if keep_survivors else "both restarted (SGD_KEEP_SURVIVORS=0)")


def measure_costs(spec):
    """Every raysgd-only measurement the spec asks for (``costs``: a list of section names)."""
    repeats = 1 if spec["smoke"] else 5  # a smoke test checks that each row is measured, not its spread
    wanted = set(spec["costs"])
    out, elapsed = {}, {}
    if "overhead" in wanted:
        start = time.monotonic()
        out["driver_overhead"], tiny = driver_overhead(spec, repeats)
        elapsed["driver_overhead"], start = time.monotonic() - start, time.monotonic()
        out["snapshot"] = [tiny, *snapshot_cost(spec, repeats)]
        elapsed["snapshot"] = time.monotonic() - start
    if "recovery" in wanted:
        start = time.monotonic()
        out["recovery"] = recovery_time(spec, 1 if spec["smoke"] else 3)
        if not spec["smoke"]:  # the comparison: every process restarted, as before survivors were kept
            out["recovery_restart_all"] = recovery_time(spec, 3, keep_survivors=False)
        elapsed["recovery"] = time.monotonic() - start
    out["elapsed_s"] = elapsed
    return out

