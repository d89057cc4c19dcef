"""raysgd against a plain loop, torchrun DDP and Ray Train on the same models, measured side by side.

Every side runs in its own process(es), one after another, with the same intra-op thread count per
process; the numbers that matter are the ratios within one run on one machine. Results are printed as
tables and written to JSON (``benchmarks/results/latest.json`` by default). See benchmarks/README.md.

    python benchmarks/benchmark.py                 # full run (about 10 minutes on 2 cores)
    python benchmarks/benchmark.py --smoke-test    # everything at toy size (the test suite runs this)
    python benchmarks/benchmark.py --plot docs/images/throughput.png   # also draw the throughput (plots.py)
"""
import argparse
import compileall
import datetime
import functools
import importlib.util
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import ray
import torch
from tabulate import tabulate

import plots
import report
from workloads import make_model

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
SIDES = os.path.join(BENCH_DIR, "sides.py")
SECTIONS = ("throughput", "overhead", "recovery", "gpu")


class ChildFailed(RuntimeError):
    """A benchmark process exited with an error; the message ends with its log."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke-test", action="store_true", help="everything at toy size (under a minute)")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "latest.json"), help="JSON file")
    parser.add_argument("--markdown", default=None, help="also write the tables as GitHub markdown to this file")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="also draw the throughput of every side as a PNG there (benchmarks/plots.py)")
    parser.add_argument("--models", default=None, help="comma-separated: mlp, resnet (default: both; mlp when "
                        "--smoke-test)")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts N")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads per process on every side (default: CPUs // max N)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--child-timeout", type=float, default=None, help="seconds per benchmark process")
    parser.add_argument("--ray-train-poll-s", type=float, default=None,
                        help="Ray Train's controller polling interval, RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default: "
                        "Ray's own, 2 s; 0.2 with --smoke-test)")
    parser.add_argument("--ray-worker-niceness", type=int, default=None,
                        help="niceness of Ray's worker processes (default: $RAY_worker_niceness, else Ray's own 15; the "
                             "other sides run at 0)")
    args = parser.parse_args(argv)
    args.models = [m for m in (args.models or ("mlp" if args.smoke_test else "mlp,resnet")).split(",") if m]
    args.workers = sorted({int(n) for n in args.workers.split(",") if n})
    args.sections = [s for s in args.sections.split(",") if s]
    for name, values, allowed in (("--models", args.models, ("mlp", "resnet")),
                                  ("--sections", args.sections, SECTIONS)):
        if not values or any(v not in allowed for v in values):
            parser.error(f"{name} expects a comma-separated subset of {allowed}; got {values}")
    if not args.workers or args.workers[0] < 1:
        parser.error(f"--workers expects worker counts >= 1; got {args.workers}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    args.cpus = cpus
    args.threads = args.threads or max(1, cpus // max(args.workers))
    if args.threads < 1:
        parser.error(f"--threads expects an int >= 1; got {args.threads}")
    args.child_timeout = args.child_timeout or (300 if args.smoke_test else 900)
    if args.smoke_test and args.ray_train_poll_s is None:
        args.ray_train_poll_s = 0.2  # a smoke test need not wait for Ray Train's 2 s polls
    if args.ray_train_poll_s is not None and args.ray_train_poll_s <= 0:
        parser.error(f"--ray-train-poll-s expects seconds > 0; got {args.ray_train_poll_s}")
    return args


def worker_niceness(args):
    """The niceness Ray's workers run at: ``--ray-worker-niceness``, else the ``RAY_worker_niceness`` the runs
    inherit from this process's environment (the tests set 0), else Ray's default, 15."""
    if args.ray_worker_niceness is not None:
        return args.ray_worker_niceness
    return int(os.environ.get("RAY_worker_niceness", 15))


def compile_sources():
    """Write the bytecode of raysgd's package and of benchmarks/ before any side starts; returns the folders that
    could not be written (a read-only install), for the run's metadata.

    Every process of every side then loads bytecode, as a user's install does. Where the environment sets
    ``PYTHONDONTWRITEBYTECODE``, each raysgd worker otherwise compiled raysgd at its start, which only raysgd's side
    paid (benchmarks/README.md, "Start-up re-measured"). Up to date, this is a check of each file's time stamp.

    Example:
        >>> compile_sources()  # doctest: +SKIP
        []
    """
    spec = importlib.util.find_spec("raysgd")
    folders = [*(spec.submodule_search_locations or ()), BENCH_DIR]
    return [folder for folder in folders if not compileall.compile_dir(folder, quiet=2)]


class Runner:
    """Starts the benchmark processes with a pinned environment and collects what they wrote."""

    def __init__(self, args, work_dir):
        self.args, self.work_dir, self.count = args, work_dir, itertools.count(1)
        self.env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                        PYTHONPATH=os.pathsep.join(p for p in (BENCH_DIR, os.environ.get("PYTHONPATH")) if p),
                        RAY_DEDUP_LOGS="0")
        if args.ray_worker_niceness is not None:
            self.env["RAY_worker_niceness"] = str(args.ray_worker_niceness)
        if args.ray_train_poll_s is not None:
            self.env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(args.ray_train_poll_s)

    def _paths(self, side):
        stem = os.path.join(self.work_dir, f"{next(self.count):02d}-{side}")
        return stem + ".spec.json", stem + ".record.json", stem + ".log"

    def _spec(self, side, **extra):
        spec_path, record, log = self._paths(side)
        spec = dict(side=side, smoke=self.args.smoke_test, threads=self.args.threads, workers=self.args.workers,
                    models=self.args.models, record=record, work_dir=self.work_dir, bench_dir=BENCH_DIR)
        spec.update(extra)
        with open(spec_path, "w", encoding="utf-8") as handle:
            json.dump(spec, handle)
        return spec, spec_path, log

    def _launch(self, command, log):
        with open(log, "w", encoding="utf-8") as handle:
            t_launch = time.time()
            proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                    env=dict(self.env, BENCH_T_LAUNCH=repr(t_launch)), cwd=BENCH_DIR)
        return proc, t_launch

    def _finish(self, proc, log, spec, deadline, what):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as err:
            proc.kill()
            proc.wait(timeout=30)
            raise ChildFailed(f"{what} ran past {self.args.child_timeout:.0f} s\n{_tail(log)}") from err
        if proc.returncode != 0:
            raise ChildFailed(f"{what} exited with {proc.returncode}\n{_tail(log)}")
        with open(spec["record"], encoding="utf-8") as handle:
            return json.load(handle)

    def run(self, side, **extra):
        """``python sides.py SPEC`` (or gpu.py for ``side="gpu"``); returns what it recorded."""
        spec, spec_path, log = self._spec(side, **extra)
        script = os.path.join(BENCH_DIR, "gpu.py") if side == "gpu" else SIDES
        print(f"-- {side} {spec.get('model') or ','.join(spec['models']) if side != 'gpu' else ''} (log: {log})",
              flush=True)
        proc, _ = self._launch([sys.executable, script, spec_path], log)
        return self._finish(proc, log, spec, time.monotonic() + self.args.child_timeout, side)

    def run_torchrun(self, model, workers):
        """``torchrun --standalone --nproc_per_node=N``; this process is the driver that loads the model."""
        model_out = os.path.join(self.work_dir, f"torchrun-{model}-{workers}.pt")
        spec, spec_path, log = self._spec("torchrun", model=model, model_out=model_out, ack=model_out + ".ack")
        print(f"-- torchrun {model} N={workers} (log: {log})", flush=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
                   SIDES, spec_path]
        proc, t_launch = self._launch(command, log)
        deadline, t_model = time.monotonic() + self.args.child_timeout, None
        while proc.poll() is None and t_model is None and time.monotonic() < deadline:
            if os.path.exists(model_out):
                make_model(model).load_state_dict(torch.load(model_out))
                t_model = time.time()
                open(spec["ack"], "w").close()
            else:
                time.sleep(0.005)
        records = self._finish(proc, log, spec, deadline, f"torchrun {model} N={workers}")
        if t_model is None:
            raise ChildFailed(f"torchrun {model} N={workers} ended without writing the model\n{_tail(log)}")
        return [dict(run, t0=t_launch, t_model=t_model) for run in records]


def _tail(path, lines=40):
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError as err:
        return f"(no log: {err})"


def plan(args, runner):
    """Three lanes of ``(name, kind, job)``: each lane runs in order; lanes run one after another.

    In a smoke test the lanes run at the same time (its timings mean nothing; it checks the code runs).
    """
    lanes, throughput = ([], [], []), "throughput" in args.sections
    costs = [s for s in ("overhead", "recovery") if s in args.sections]
    if throughput:
        if 1 in args.workers:
            lanes[0].extend((f"plain {m}", "runs", functools.partial(runner.run, "plain", model=m))
                            for m in args.models)
        lanes[0].extend((f"torchrun {m} N={n}", "runs", functools.partial(runner.run_torchrun, m, n))
                        for m in args.models for n in args.workers)
    if throughput or costs:
        models = args.models if throughput else []
        lanes[1].append(("raysgd", "raysgd", functools.partial(runner.run, "raysgd", models=models, costs=costs)))
    if throughput:
        lanes[2].append(("raytrain", "runs", functools.partial(runner.run, "raytrain")))
    if "gpu" in args.sections and (torch.cuda.is_available() or args.smoke_test):
        lanes[0].append(("gpu", "gpu", functools.partial(runner.run, "gpu")))
    return [lane for lane in lanes if lane]


def measure(args, work_dir):
    """Run every requested section; returns ``(result, errors)`` (a failed part is recorded, not fatal)."""
    runner, outputs, errors = Runner(args, work_dir), [], []

    def run_lane(lane):
        for name, kind, job in lane:
            start = time.monotonic()
            try:
                outputs.append((kind, job()))
                print(f"   {name}: done in {time.monotonic() - start:.0f} s", flush=True)
            except ChildFailed as err:
                print(f"!! {name} failed: {err}", flush=True)
                errors.append({"section": name, "error": str(err)})

    lanes = plan(args, runner)
    if args.smoke_test:
        threads = [threading.Thread(target=run_lane, args=(lane,), daemon=True) for lane in lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=args.child_timeout * max(len(lane) for lane in lanes) + 60)
    else:
        for lane in lanes:
            run_lane(lane)
    result, runs = {"costs": None, "gpu": None}, []
    for kind, value in outputs:
        if kind == "runs":
            runs += value
        elif kind == "raysgd":
            runs += value["runs"]
            result["costs"] = value["costs"]
        else:
            result["gpu"] = value
    if "gpu" in args.sections and not torch.cuda.is_available() and not args.smoke_test:
        result["gpu"] = {"status": "skipped", "reason": "CUDA is not available on this machine"}
        print("-- gpu: skipped (CUDA is not available on this machine)", flush=True)
    order = {"plain": 0, "torchrun": 1, "raytrain": 2, "raysgd": 3}
    runs.sort(key=lambda r: (r["model"], r["workers"], order[r["side"]]))
    result["runs"] = [report.derive_run(run) for run in runs]
    result["ratios"] = report.ratios(result["runs"])
    result["targets"] = report.targets(result["ratios"], result.get("costs"))
    return result, errors


def metadata(args):
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=f"{platform.node()} ({platform.machine()}, {args.cpus} CPUs)",
                processor=platform.processor(), python=platform.python_version(), torch=torch.__version__,
                ray=ray.__version__, threads=args.threads, workers=args.workers, models=args.models,
                smoke=args.smoke_test, load_average=list(os.getloadavg()), command=" ".join(sys.argv),
                ray_worker_niceness=worker_niceness(args),
                ray_train_poll_s=2.0 if args.ray_train_poll_s is None else args.ray_train_poll_s)


def main(argv=None):
    args = parse_args(argv)
    started = time.monotonic()
    work_dir = tempfile.mkdtemp(prefix="raysgd-bench-")
    meta = metadata(args)
    meta["bytecode_not_written"] = compile_sources()  # [] when every side loads bytecode (see compile_sources)
    print(f"raysgd benchmark: {meta['machine']}, {args.threads} thread(s) per process, load average "
          f"{meta['load_average'][0]:.1f}{', SMOKE TEST' if args.smoke_test else ''}", flush=True)
    result, errors = measure(args, work_dir)
    if errors:
        print(f"logs kept in {work_dir}")
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    result = dict(meta=meta, **result, errors=errors)
    result["meta"]["duration_s"] = time.monotonic() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print("\n" + report.tables(result), flush=True)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as handle:
            handle.write(report.tables(result, fmt="github") + "\n")
    if args.plot and result["runs"]:
        print(f"drawn: {plots.throughput(result, args.plot)}")
    print(f"\nwritten: {args.out} ({result['meta']['duration_s']:.0f} s)")
    if errors:
        print(tabulate([[e["section"], e["error"].splitlines()[0]] for e in errors], ["failed", "error"]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
