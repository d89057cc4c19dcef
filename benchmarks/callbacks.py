"""The driver's cost of callbacks and Ray metrics per train()/validate() call (goal: under 1 ms per call).

Times what ``TorchTrainer`` adds to each call's result on the driver: the :class:`~raysgd.callbacks.CallbackList`
dispatch with N no-op callbacks (a hook each overrides; base-class no-ops are skipped without a call), the
:class:`~raysgd.torch.integrations.ray_metrics.RayMetrics` callback (on by default), the CSV result log
(``logdir``), and MLflow logging to a local sqlite store for comparison (a database write per call). Prints a
table: microseconds per call (median of repeats) and whether it is under 1 ms.

MLflow separately (:func:`mlflow_costs`): what a call waits for with :class:`~raysgd.loggers.MLflowLogger`, one
result every ``--mlflow-gap-s`` seconds (a training call longer than a write): ``on_train_result`` (the
dispatch) and ``state_dict()`` (what a ``storage_path`` checkpoint's marker takes after every result), the first
result (it starts the run) apart, and how long the writes take to be in the store (``flush``).

    python benchmarks/callbacks.py               # the full measurement
    python benchmarks/callbacks.py --smoke-test  # a quick check that it runs
"""
import argparse
import os
import statistics
import tempfile
import time
import types

import ray
from tabulate import tabulate

from raysgd import optional
from raysgd.callbacks import Callback, CallbackList
from raysgd.torch.integrations.ray_metrics import RayMetrics
from raysgd.torch.integrations.results import ResultLogCallback, ResultLogger

RESULT = {"epoch": 3, "batch_count": 50, "num_samples": 3200, "train_loss": 0.25, "last_train_loss": 0.2,
          "profile": {"mean_fwd_s": 0.001, "mean_bwd_s": 0.002}}


class NoOp(Callback):
    """Overrides every result hook with nothing: the dispatch's own cost."""

    def on_train_result(self, trainer, result):
        pass


def per_call_us(callbacks, calls, repeats):
    """Median over ``repeats`` of the microseconds one ``on_train_result`` dispatch takes."""
    trainer = types.SimpleNamespace(last_call_s=1.5, worker_group=types.SimpleNamespace(num_workers=2))
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            callbacks.call("on_train_result", trainer, RESULT)
        timings.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(timings)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="few calls: check that it runs")
    parser.add_argument("--mlflow-gap-s", type=float, default=0.25,
                        help="seconds between two MLflow results (a training call)")
    args = parser.parse_args(argv)
    calls, repeats = (50, 3) if args.smoke_test else (2000, 7)
    ray.init(address="local", num_cpus=1, include_dashboard=False)  # RayMetrics needs a connected driver
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        cases = [(f"{n} no-op callbacks", CallbackList([NoOp() for _ in range(n)])) for n in (0, 1, 10, 100)]
        cases.append(("10 base-class Callback() (skipped)", CallbackList([Callback() for _ in range(10)])))
        cases.append(("RayMetrics (the default)", CallbackList([RayMetrics(run="bench")])))
        cases.append(("RayMetrics + 10 no-op callbacks", CallbackList([RayMetrics(run="bench2")]
                                                                      + [NoOp() for _ in range(10)])))
        log = ResultLogger(os.path.join(folder, "logs"), tensorboard=False)
        cases.append(("CSV result log (logdir, no TensorBoard)", CallbackList([ResultLogCallback(log)])))
        mlflow_calls = calls // 20 or 1  # a database write per call: fewer calls
        for name, callbacks in cases:
            us = per_call_us(callbacks, calls, repeats)
            rows.append((name, calls, f"{us:.1f}", "yes" if us < 1000 else "no"))
        log.close()
        mlflow_rows = []
        if optional.available("mlflow"):
            from raysgd.loggers import MLflowLogger  # noqa: PLC0415 (mlflow is optional)

            mlflow_rows = mlflow_costs(MLflowLogger, os.path.join(folder, "mlflow"), mlflow_calls, args.mlflow_gap_s)
    print(tabulate(rows, headers=["on_train_result dispatch", "calls", "µs per call", "< 1 ms"]))
    if mlflow_rows:
        print()
        print(tabulate(mlflow_rows, headers=[f"MLflowLogger, local sqlite, a result every {args.mlflow_gap_s} s",
                                             "calls", "µs (median)", "µs (max)"]))
    ray.shutdown()


def mlflow_costs(logger_cls, tracking_uri, calls, gap_s):
    """Rows ``(what, calls, median µs, max µs)`` of what an ``MLflowLogger`` (``logger_cls``) makes a call wait for,
    one result every ``gap_s`` seconds (see the module docstring)."""
    logger = logger_cls(tracking_uri=tracking_uri, experiment_name="bench")
    callbacks = CallbackList([logger])
    trainer = types.SimpleNamespace(config={"lr": 0.1, "batch_size": 64}, last_call_s=1.5,
                                    worker_group=types.SimpleNamespace(num_workers=2))
    first = time.perf_counter()
    callbacks.call("on_train_result", trainer, dict(RESULT, epoch=1))
    callbacks.state_dict()
    first = (time.perf_counter() - first) * 1e6
    dispatch, marker = [], []
    for epoch in range(2, calls + 2):
        time.sleep(gap_s)  # the training call
        start = time.perf_counter()
        callbacks.call("on_train_result", trainer, dict(RESULT, epoch=epoch))
        middle = time.perf_counter()
        callbacks.state_dict()
        dispatch.append((middle - start) * 1e6)
        marker.append((time.perf_counter() - middle) * 1e6)
    start = time.perf_counter()
    flush = getattr(logger, "flush", None)  # a synchronous logger has nothing to flush
    if flush is not None:
        flush(timeout_s=120)
    drained = (time.perf_counter() - start) * 1e6
    callbacks.call("on_shutdown", trainer)
    return [("first result + state_dict (starts the run)", 1, f"{first:.0f}", f"{first:.0f}"),
            ("on_train_result", calls, f"{statistics.median(dispatch):.0f}", f"{max(dispatch):.0f}"),
            ("state_dict() (storage_path's marker)", calls, f"{statistics.median(marker):.0f}", f"{max(marker):.0f}"),
            ("flush after the last result", 1, f"{drained:.0f}", f"{drained:.0f}")]


if __name__ == "__main__":
    main()
