"""Durable runs (``storage_path``): checkpoint write time, training slowdown during an upload, resume time.

    python benchmarks/durable.py                 # ~100 MB model, local folder and moto S3
    python benchmarks/durable.py --smoke-test    # toy sizes (the numbers mean nothing)

Three tables:

1. **Checkpoint write**: ``CheckpointStorage.write`` of a ~100 MB state to a local folder and to a
   ``python -m moto.server`` S3 on 127.0.0.1 (median of ``--repeats``), and reading it back
   (``latest()``: read, CRC-32, safe load), plus ``torch.save`` to bytes for reference.
2. **Training slowdown**: median epoch time of the same 2-worker training with and without
   ``storage_path`` (each epoch's checkpoint uploads while the next epoch trains). Target: <= 5 %.
3. **Resume**: seconds from starting a driver process to its first trained batch, fresh and resumed
   from a ~100 MB checkpoint.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # s3_server (moto) lives with the tests

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from raysgd import TorchTrainer, TrainingOperator  # noqa: E402
from raysgd.torch.storage import filesystem as storage  # noqa: E402
from raysgd.torch.state.checkpoint import state_to_bytes  # noqa: E402


class WideOperator(TrainingOperator):
    """An MLP whose ``width x width`` hidden layer makes the state ~``4 * width**2`` bytes (plus momentum)."""

    def setup(self, config):
        torch.manual_seed(0)
        width = config["width"]
        model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 2))
        self.model, self.optimizer, self.criterion = self.register(
            models=model, optimizers=torch.optim.SGD(model.parameters(), lr=1e-3), criterion=nn.CrossEntropyLoss())
        x = torch.randn(config["samples"], 32, generator=torch.Generator().manual_seed(1))
        self.register_data(train_loader=DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32))

    def train_batch(self, batch, batch_info):
        metrics = super().train_batch(batch, batch_info)
        stamp = self.config.get("first_batch_file")
        if stamp and self.world_rank == 0 and not os.path.exists(stamp):
            with open(stamp, "w") as handle:
                handle.write(repr(time.time()))
        return metrics


def sizes(smoke):
    # width 5000: a 5000 x 5000 layer, 25 M float32 parameters, a ~100 MB state (SGD without momentum)
    return {"width": 512, "samples": 256, "epochs": 3, "repeats": 2} if smoke else \
        {"width": 5000, "samples": 512, "epochs": 4, "repeats": 3}


def state_of_size(width):
    model = nn.Linear(width, width)
    return {"epoch": 1, "global_step": 1, "operator": {}, "models": [model.state_dict()], "optimizers": [{}]}


def time_writes(uri, stream, repeats):
    store = storage.CheckpointStorage(uri, num_to_keep=2)
    writes, reads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        store.write(stream, {"epoch": 1})
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert store.latest() is not None
        reads.append(time.perf_counter() - start)
    return statistics.median(writes), statistics.median(reads)


def table_writes(size, scratch):
    from s3_server import moto_s3

    stream_start = time.perf_counter()
    stream = state_to_bytes(state_of_size(size["width"]))
    serialize_s = time.perf_counter() - stream_start
    rows = [["torch.save to bytes", len(stream) / 1e6, serialize_s, None]]
    local_w, local_r = time_writes(os.path.join(scratch, "local"), stream, size["repeats"])
    rows.append(["local folder", len(stream) / 1e6, local_w, local_r])
    with moto_s3() as (bucket, query):
        s3_w, s3_r = time_writes(f"{bucket}/bench{query}", stream, size["repeats"])
    rows.append(["S3 (moto.server, 127.0.0.1)", len(stream) / 1e6, s3_w, s3_r])
    for row in rows:
        if row[2]:
            row.append(row[1] / row[2])
    return tabulate(rows, headers=["checkpoint write", "MB", "write s", "read+check s", "write MB/s"],
                    floatfmt=".3f")


def epoch_times(size, storage_path):
    trainer = TorchTrainer(training_operator_cls=WideOperator, num_workers=2, storage_path=storage_path,
                           config={"width": size["width"], "samples": size["samples"]}, timeout_s=300)
    times = []
    try:
        for _ in range(size["epochs"]):
            start = time.perf_counter()
            trainer.train()
            times.append(time.perf_counter() - start)
        if storage_path:
            trainer.controller.durable.flush(timeout_s=600)
    finally:
        trainer.shutdown()
    return times[1:]  # the first epoch warms up


def table_slowdown(size, scratch):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        rows = []
        for _ in range(2):  # alternate, to spread the machine's drift over both sides
            rows.append(("without storage_path", epoch_times(size, None)))
            rows.append(("storage_path (local)", epoch_times(size, os.path.join(scratch, f"slow{len(rows)}"))))
    finally:
        ray.shutdown()
    base = statistics.median([t for name, times in rows if name.startswith("without") for t in times])
    with_storage = statistics.median([t for name, times in rows if name.startswith("storage") for t in times])
    table = [["without storage_path", base, None], ["storage_path (local folder)", with_storage,
                                                    100 * (with_storage / base - 1)]]
    return tabulate(table, headers=["2 workers, ~100 MB model", "median epoch s", "slowdown %"], floatfmt=".3f")


def child_main(args):
    """The driver timed by table_resume: start Ray, build (and maybe resume) the trainer, train."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}})
    trainer = TorchTrainer(training_operator_cls=WideOperator, num_workers=2, storage_path=args.child,
                           config={"width": args.width, "samples": 64, "first_batch_file": args.stamp}, timeout_s=300)
    trainer.train()
    trainer.shutdown()
    ray.shutdown()


def table_resume(size, scratch):
    path = os.path.join(scratch, "resume")
    rows = []
    for label in ("fresh start", "resumed (checkpoint in storage_path)"):
        stamp = os.path.join(scratch, f"stamp-{len(rows)}")
        start = time.time()
        subprocess.run([sys.executable, __file__, "--child", path, "--stamp", stamp, "--width", str(size["width"])],
                       check=True, timeout=900, cwd=os.path.join(HERE, ".."), capture_output=True)
        with open(stamp) as handle:
            rows.append([label, float(handle.read()) - start])
    return tabulate(rows, headers=["driver start to first trained batch", "s"], floatfmt=".2f")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true")
    parser.add_argument("--sections", default="writes,slowdown,resume")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stamp", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    size = sizes(args.smoke_test)
    scratch = tempfile.mkdtemp(prefix="raysgd-durable-bench-")
    try:
        for section, fn in (("writes", table_writes), ("slowdown", table_slowdown), ("resume", table_resume)):
            if section in args.sections.split(","):
                print(fn(size, scratch), flush=True)
                print(flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
