"""The benchmarks never rot: ``benchmark.py --smoke-test`` runs every side and section; the arithmetic is right.

Speeds are never asserted (the machine is shared); the rows, their shape and the ratio logic are.

The smaller scripts' smoke runs (``SMOKE_RUNS``) go two at a time in the background (``smoke_runs``,
tests/background.py), each test waiting for its own: one alone left 22-38% of the machine idle (its Ray cluster's
start, its workers' start-ups), and nothing they check depends on timing; measured here, the first four took 76 s
one after another and 59 s two at a time. ``benchmark.py``'s own smoke run keeps the machine busy by itself (96%:
three lanes at once) and runs alone, before them.
"""
import functools
import itertools
import json
import os
import subprocess
import sys

import pytest

import background
from conftest import REPO_DIR

ROOT = REPO_DIR
BENCH_DIR = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import ci_profile  # noqa: E402 (benchmarks/ is not a package)
import report  # noqa: E402
import workloads  # noqa: E402


#: The smoke runs of the smaller scripts, by the test that checks each: ``(script, options, timeout_s)``; ``{dir}``
#: in an option is that run's folder. They start in this order, the longest first (35, 22, 16, 11 and 3 s alone).
SMOKE_RUNS = {
    "test_fsdp_state_benchmark_smoke_test_measures_every_column": ("fsdp_state.py", (), 500),
    "test_fsdp_benchmark_smoke_test_measures_both_strategies": (
        "fsdp.py", ("--workers", "1,2", "--plot", "{dir}/fsdp.png"), 500),
    "test_state_scaling_smoke_test_measures_every_column": ("state_scaling.py", (), 300),
    "test_ci_profile_smoke_test_times_modules_and_lanes_and_the_cpu_by_process_kind": ("ci_profile.py", (), 300),
    "test_serialise_stall_smoke_test_measures_both_ways": ("serialise_stall.py", (), 120),
}


def run_smoke(script, folder, options=(), timeout=300):
    """Run ``benchmarks/<script> --smoke-test --json <folder>/out.json`` (plus ``options``, ``{dir}`` in them being
    ``folder``) with the repository importable; returns the finished process."""
    options = [option.replace("{dir}", str(folder)) for option in options]
    command = [sys.executable, os.path.join(BENCH_DIR, script), "--smoke-test", *options, "--json",
               str(folder / "out.json")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """``{test name: (future of the finished subprocess, its folder)}`` for each of ``SMOKE_RUNS`` whose test the
    session selected, started two at a time in ``SMOKE_RUNS``' order."""
    chosen = {item.originalname for item in request.session.items if item.module is request.module}
    selected = [name for name in SMOKE_RUNS if name in chosen]
    folders = {name: tmp_path_factory.mktemp(SMOKE_RUNS[name][0].removesuffix(".py")) for name in selected}
    jobs = {name: functools.partial(run_smoke, SMOKE_RUNS[name][0], folders[name], *SMOKE_RUNS[name][1:])
            for name in selected}
    with background.started(jobs) as runs:  # those running at the end stop by their own timeout
        yield {name: (runs[name], folders[name]) for name in runs}


def smoke_result(smoke_runs, request):
    """The JSON, standard output and folder of this test's smoke run (see ``smoke_runs``), after checking that it
    exited cleanly."""
    run, folder = smoke_runs[request.node.originalname]
    proc = run.result()  # the subprocess's own timeout bounds the wait
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return json.loads((folder / "out.json").read_text()), proc.stdout, folder


@pytest.mark.slow
def test_smoke_test_runs_every_side_and_section(tmp_path):
    out, markdown, picture = tmp_path / "smoke.json", tmp_path / "smoke.md", tmp_path / "throughput.png"
    command = [sys.executable, os.path.join(BENCH_DIR, "benchmark.py"), "--smoke-test", "--out", str(out),
               "--markdown", str(markdown), "--plot", str(picture)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=560, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["smoke"] and result["errors"] == []
    # the niceness its Ray workers inherit from here (conftest sets 0), recorded as it is
    assert result["meta"]["ray_worker_niceness"] == int(os.environ.get("RAY_worker_niceness", 15))
    assert result["meta"]["bytecode_not_written"] == []  # every side loads bytecode, as a user's install does
    threads = result["meta"]["threads"]
    assert {(r["side"], r["workers"]) for r in result["runs"]} == {
        ("plain", 1), ("torchrun", 1), ("torchrun", 2), ("raytrain", 1), ("raytrain", 2), ("raysgd", 1),
        ("raysgd", 2)}
    for run in result["runs"]:
        assert run["model"] == "mlp" and run["threads"] == threads, run  # pinned equally on every side
        assert run["samples_per_s"] > 0 and 0 < run["startup_s"] <= run["e2e_s"], run
    ratios = {(r["measure"], r["versus"], r["workers"]) for r in result["ratios"]}
    assert ratios >= {("samples_per_s", "torchrun", 2), ("samples_per_s", "plain", 1),
                      ("samples_per_s", "raytrain", 2), ("e2e_s", "raytrain", 1), ("e2e_s", "raytrain", 2),
                      ("startup_s", "torchrun", 2)}
    costs = result["costs"]
    assert {(r["workers"], r["batches"], r["max_retries"]) for r in costs["driver_overhead"]} == set(
        itertools.product((1, 2), (10, 100), (3, 0)))
    snapshot = {r["model"]: r for r in costs["snapshot"]}
    assert set(snapshot) == {"tiny", "wide"} and 9 < snapshot["wide"]["state_mb"] < 11
    recovery = costs["recovery"]
    assert 0 < recovery["detect_s"] < recovery["recovery_s"] and len(recovery["attempts"]) == 1
    assert result["gpu"]["status"] in ("cpu-check", "smoke") and len(result["gpu"]["rows"]) == 6
    assert {r["side"] for r in result["gpu"]["rows"]} == {"plain", "raysgd", "raysgd-sync"}
    checked = {"smoke": {"resnet50"}, "cpu-check": {"cpu-check-resnet8"}}[result["gpu"]["status"]]  # gpu.CPU_CHECK
    assert {r["workload"] for r in result["gpu"]["rows"]} == checked and \
        {r["precision"] for r in result["gpu"]["rows"]} == {"fp32", "bf16"}
    assert {t["target"].split(":")[0] for t in result["targets"]} >= {"mlp", "recovery"}
    assert "Targets" in proc.stdout and "| raysgd" in markdown.read_text()
    assert picture.read_bytes().startswith(b"\x89PNG")  # --plot: the docs' throughput picture, drawn by the run


def test_models_have_the_sizes_the_readme_states():
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(workloads.make_model("mlp")) == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    assert 70_000 < count(workloads.make_model("resnet")) < 90_000
    assert 25_000_000 < count(workloads.make_model("resnet50")) < 26_000_000
    assert count(workloads.make_model("wide")) * 4 / 1e6 == pytest.approx(100, rel=0.01)
    x, y = workloads.make_dataset("resnet", 4).tensors
    assert workloads.make_model("resnet")(x).shape == (4, 10) and y.shape == (4,)
    with pytest.raises(ValueError, match="model expects one of"):
        workloads.make_model("vgg")


def test_steady_rate_uses_only_the_timed_window():
    stamps = [0.0, 10.0, 11.0, 12.0, 100.0]  # slow warm-up step, then 2 timed steps of 1 s, then a straggler
    assert workloads.steady_rate(stamps, warmup=2, steps=2, global_batch=8) == 8.0
    with pytest.raises(ValueError, match="at least warmup"):
        workloads.steady_rate(stamps, warmup=4, steps=2, global_batch=8)


def _run(side, workers, rate, e2e):
    steps = 4
    return dict(side=side, model="mlp", workers=workers, threads=1, batch_size=10, warmup=1, steps=steps, t0=0.0,
                t_first_batch=1.0, t_model=e2e, tp_stamps=[0.0] + [i * 10 * workers / rate for i in range(1, 5)])


def test_ratios_and_targets():
    raw = (_run("plain", 1, 100, 5), _run("raysgd", 1, 98, 5), _run("torchrun", 2, 200, 6), _run("raysgd", 2, 199, 7),
           _run("raytrain", 2, 150, 10))
    runs = [report.derive_run(r) for r in raw]
    ratios = report.ratios(runs)
    by_key = {(r["measure"], r["versus"], r["workers"]): r["ratio"] for r in ratios}
    assert by_key[("samples_per_s", "plain", 1)] == pytest.approx(0.98)
    assert by_key[("samples_per_s", "torchrun", 2)] == pytest.approx(0.995)
    assert by_key[("e2e_s", "raytrain", 2)] == pytest.approx(0.7)
    targets = {t["target"]: t["met"] for t in report.targets(ratios, {"recovery": {"recovery_s": 5.5}})}
    assert targets == {"mlp: raysgd 2 / torchrun 2, steady state": True,
                       "mlp: raysgd 1 / plain loop, steady state": False,
                       "mlp: 3-epoch job, raysgd 2 / Ray Train 2": True,
                       "recovery: worker death to next batch trained (s)": False}


@pytest.mark.slow
def test_state_scaling_smoke_test_measures_every_column(smoke_runs, request):
    result, stdout, _ = smoke_result(smoke_runs, request)
    assert result["meta"]["smoke"] and len(result["meta"]["loadavg"]) == 3
    (row,) = result["rows"]
    assert row["size_mb"] == 1 and row["calls"] == 2 and 0.9 < row["state_mb"] < 1.1
    for key in ("driver_peak_rss_mb", "worker_peak_rss_mb", "commit_ms", "call_s"):
        assert row[key] > 0, (key, row)
    assert row["driver_peak_rss_mb"] >= row["driver_growth_mb"] >= 0
    assert row["commit_rise_mb"] >= 0 and row["base_rise_mb"] >= 0 and "commit_extra_x" in row
    assert {"anon_extra_x", "shm_extra_x", "overhead_ms"} <= set(row)  # toy-size memory is allocator noise
    assert row["recover_s"] > 0 and row["failures"] == 1  # the killed worker was replaced inside the call
    assert "driver_peak_rss_mb" in stdout  # the table


@pytest.mark.slow
def test_fsdp_benchmark_smoke_test_measures_both_strategies(smoke_runs, request):
    result, stdout, folder = smoke_result(smoke_runs, request)
    assert (folder / "fsdp.png").read_bytes().startswith(b"\x89PNG")  # --plot: the memory per rank, drawn
    assert result["meta"]["smoke"]
    rows = {(r["strategy"], r["workers"]): r for r in result["rows"]}
    assert set(rows) == {("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)}
    assert [rows["fsdp", n]["sharded"] for n in (1, 2)] == [False, True]  # one worker: nothing to shard over
    assert rows["fsdp", 2]["state_mb"] < rows["ddp", 2]["state_mb"] == rows["fsdp", 1]["state_mb"]
    assert all(r["steps_per_s"] > 0 and r["peak_rise_mb"] >= 0 for r in rows.values())
    assert [r["workers"] for r in result["ratios"]] == [1, 2] and "fsdp/ddp steps_per_s" in stdout


@pytest.mark.slow
def test_fsdp_state_benchmark_smoke_test_measures_every_column(smoke_runs, request):
    result, stdout, _ = smoke_result(smoke_runs, request)
    (row,) = result["rows"]
    assert row["workers"] == 2 and row["commit_ms"] > 0 and row["checkpoint_s"] > 0, row
    assert row["snapshot_ms"] is not None and "with_checkpoint_ms" in row and "resume_to_1_s" in row
    assert "checkpoint_s" in stdout
    assert [(read["path"], read["from"], read["to"]) for read in result["reads"]] == [
        ("objects", 2, 1), ("load(path)", 2, 1), ("resume", 2, 1)]
    assert all(read["worst_ratio"] <= 1.1 and "r0" in read for read in result["reads"]), result["reads"]


def test_serialise_stall_smoke_test_measures_both_ways(smoke_runs, request):
    result, stdout, _ = smoke_result(smoke_runs, request)
    rows = result["rows"]
    assert [(row["size_mb"], row["how"]) for row in rows] == [(1, "io.BytesIO"), (1, "serialise")]
    for row in rows:
        assert row["serialise_ms"] > 0 and row["worst_stall_ms"] >= 0 and row["loop_share"] > 0, row
    assert "worst_stall_ms" in stdout  # the table


def test_ci_profile_smoke_test_times_modules_and_lanes_and_the_cpu_by_process_kind(smoke_runs, request):
    """The profiler runs a unit module and a trainer's module on two lanes (its own pytest, inside this one)."""
    result, stdout, _ = smoke_result(smoke_runs, request)
    assert result["pytest_exit_status"] == 0
    modules = {row["module"]: row for row in result["modules"]}
    assert set(modules) == {"tests/unit/core/test_utils.py", "tests/cluster/integrations/test_results.py"}
    assert modules["tests/cluster/integrations/test_results.py"]["seconds"] > 1  # a cluster's start and a trainer
    lanes = {row["lane"]: row for row in result["lanes"]}
    assert set(lanes) == {"gw0", "gw1"}  # loadfile: a module per lane, and xdist's relay of them not counted again
    assert sum(row["tests"] for row in lanes.values()) == sum(row["tests"] for row in modules.values()) > 2
    assert {row["lanes"] for row in modules.values()} == {"gw0", "gw1"}
    # the trainer's module started a cluster and its workers on its lane; the unit module started nothing
    trainers, units = modules["tests/cluster/integrations/test_results.py"], modules["tests/unit/core/test_utils.py"]
    assert trainers["processes"] >= 4 and trainers["cpu_s"] > 2 * max(units["cpu_s"], 0.5)  # GCS, raylet, 2 workers
    assert units["processes"] <= 1  # none (a short-lived helper process at most)
    costliest = {}  # the costliest test of each module (the table is ordered by CPU)
    for row in result["tests"]:
        costliest.setdefault(row["test"].split("::")[0], row)
    assert set(costliest) <= set(modules) and "tests/cluster/integrations/test_results.py" in costliest
    assert 0 < costliest["tests/cluster/integrations/test_results.py"]["cpu_s"] <= trainers["cpu_s"] + 0.1
    assert sum(row["processes"] for row in result["tests"]) <= sum(row["processes"] for row in modules.values())
    kinds = {row["kind"]: row for row in result["cpu"]}
    assert kinds["pytest lane"]["processes"] >= 2 and kinds["pytest lane"]["cpu_s"] > 0
    assert kinds["ray::TorchWorker"]["processes"] >= 1 and kinds["ray::TorchWorker"]["cpu_s"] > 0.5  # torch's import
    assert {"gcs_server", "raylet"} <= set(kinds)
    assert 0 < result["machine_busy_share"] <= 1
    assert 0 < result["accounted_cpu_s"] <= result["machine_busy_cpu_s"] * 1.05 + 1  # a lower bound of the busy time
    assert "CPU by process kind" in stdout


def test_ci_profile_sums_tests_by_module_and_lane_and_names_process_kinds(tmp_path):
    events = tmp_path / "events.jsonl"
    lines = [("gw0", "start", "a.py::t1", 0.0), ("gw1", "start", "b.py::t", 0.5), ("gw0", "end", "a.py::t1", 2.0),
             ("gw0", "start", "a.py::t2", 2.0), ("gw0", "end", "a.py::t2", 3.0), ("gw1", "end", "b.py::t", 4.0),
             ("gw1", "start", "b.py::cut", 4.0)]  # a test still running at the end is left out
    events.write_text("".join(json.dumps({"lane": lane, "pid": 100 + int(lane[-1]), "event": event, "test": test,
                                          "t": t}) + "\n" for lane, event, test, t in lines))
    tests, lane_pids = ci_profile.tests_from(events)
    assert sorted(tests) == [("gw0", "a.py::t1", 0.0, 2.0), ("gw0", "a.py::t2", 2.0, 3.0), ("gw1", "b.py::t", 0.5, 4.0)]
    assert lane_pids == {"100": "gw0", "101": "gw1"}
    # each process: (kind, lane mark, first seen, parent); the lanes' own processes (100, 101) carry the main lane's
    # mark; 12 (a script started with an environment of its own) has no mark, 13 (its cluster's) neither: their
    # lane is the one of the lane process above them
    processes = {("100", 1): ("pytest lane", "main", -1.0, "11"), ("101", 1): ("pytest lane", "main", -1.0, "11"),
                 ("7", 1): ("raylet", "gw0", -0.5, "100"), ("8", 1): ("ray::TorchWorker", "gw0", 2.5, "7"),
                 ("9", 1): ("ray::TorchWorker", "gw1", 1.0, "101"), ("10", 1): ("kdamond", None, -1.0, "2"),
                 ("11", 1): ("pytest", "main", -1.0, "1"), ("12", 1): ("python dcgan.py", None, 3.0, "101"),
                 ("13", 1): ("gcs_server", None, 3.5, "12")}
    spent = [(-0.5, ("100", 1), 1.0), (-0.5, ("7", 1), 0.25), (0.5, ("7", 1), 0.5), (1.0, ("100", 1), 0.5),
             (1.5, ("9", 1), 2.0), (2.5, ("8", 1), 1.5), (2.5, ("7", 1), 0.25), (3.5, ("101", 1), 0.5),
             (3.0, ("10", 1), 4.0), (0.0, ("11", 1), 0.75), (3.0, ("12", 1), 0.5), (3.5, ("13", 1), 0.25)]
    modules_cpu = ci_profile.by_module(tests, lane_pids, processes, spent)
    assert modules_cpu == {ci_profile.LANE_START: [1.25, 1], "a.py": [2.75, 1], "b.py": [3.25, 3],
                           ci_profile.OUTSIDE: [4.0, 1], ci_profile.RELAY: [0.75, 1]}
    tests_cpu = ci_profile.by_module(tests, lane_pids, processes, spent, group=str)  # by test: the same split
    assert tests_cpu == {ci_profile.LANE_START: [1.25, 1], "a.py::t1": [1.0, 0], "a.py::t2": [1.75, 1],
                         "b.py::t": [3.25, 3], ci_profile.OUTSIDE: [4.0, 1], ci_profile.RELAY: [0.75, 1]}
    cpu = {"ray::TorchWorker": (5.0, 2), "raylet": (1.0, 1), "never ran": (0.0, 3)}
    result = ci_profile.summarise(tests, cpu, (7.0, 0.875), wall_s=4.2, top=5, modules_cpu=modules_cpu,
                                  tests_cpu=tests_cpu)
    assert result["tests"] == [  # the costliest first; the pseudo-rows are not tests
        {"test": "b.py::t", "seconds": 3.5, "cpu_s": 3.2, "processes": 3},
        {"test": "a.py::t2", "seconds": 1.0, "cpu_s": 1.8, "processes": 1},
        {"test": "a.py::t1", "seconds": 2.0, "cpu_s": 1.0, "processes": 0}]
    assert "tests" not in ci_profile.summarise(tests, cpu, (7.0, 0.875), wall_s=4.2, top=5)
    assert result["modules"] == [
        {"module": "b.py", "tests": 1, "seconds": 3.5, "lanes": "gw1", "cpu_s": 3.2, "processes": 3},
        {"module": "a.py", "tests": 2, "seconds": 3.0, "lanes": "gw0", "cpu_s": 2.8, "processes": 1}]
    assert result["between_modules"] == {ci_profile.LANE_START: {"cpu_s": 1.2, "processes": 1},
                                         ci_profile.RELAY: {"cpu_s": 0.8, "processes": 1},
                                         ci_profile.OUTSIDE: {"cpu_s": 4.0, "processes": 1}}
    assert result["lanes"] == [{"lane": "gw0", "tests": 2, "busy_s": 3.0, "starts_s": 0.0, "ends_s": 3.0},
                               {"lane": "gw1", "tests": 1, "busy_s": 3.5, "starts_s": 0.5, "ends_s": 4.0}]
    assert result["cpu"] == [{"kind": "ray::TorchWorker", "cpu_s": 5.0, "share": 0.833, "processes": 2, "s_each": 2.5},
                             {"kind": "raylet", "cpu_s": 1.0, "share": 0.167, "processes": 1, "s_each": 1.0}]
    assert (result["accounted_cpu_s"], result["machine_busy_cpu_s"], result["machine_busy_share"]) == (6.0, 7.0, 0.875)
    assert ci_profile.summarise(tests, cpu, (7.0, 0.875), wall_s=4.2, top=1, modules_cpu=modules_cpu)["modules"] == \
        result["modules"][:1]
    named = {
        ("ray::TorchWorker.train_epoch",): "ray::TorchWorker",
        ("/venv/bin/python3", "-u", "/venv/lib/ray/_private/workers/default_worker.py", "--node-ip-address=x"):
            "ray worker, not yet named",
        ("/venv/bin/python", "-X", "importtime", "examples/dcgan.py", "--smoke-test"): "python dcgan.py",
        ("/venv/bin/python", "-m", "raysgd.legacy", "--train", "x.py"): "python -m raysgd.legacy",
        ("/venv/bin/python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"): "pytest lane",
        ("/venv/lib/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"): "gcs_server",
    }
    for argv, expected in named.items():
        assert ci_profile.kind(list(argv), "python") == expected, argv
    assert ci_profile.lane_mark(b"A=1\0RAYSGD_CI_PROFILE_RUN=r1\0PYTEST_XDIST_WORKER=gw1\0", "r1") == "gw1"
    assert ci_profile.lane_mark(b"RAYSGD_CI_PROFILE_RUN=r1\0", "r1") == ci_profile.MAIN_LANE
    assert ci_profile.lane_mark(b"RAYSGD_CI_PROFILE_RUN=r2\0PYTEST_XDIST_WORKER=gw1\0", "r1") is None  # another run
    assert ci_profile.kind([], "kdamond.0") == "kernel or exited: kdamond.0"
    assert ci_profile.kind([], "ray::IDLE") == "ray::IDLE"
    with open(os.path.join(REPO_DIR, "README.md"), encoding="utf-8") as handle:
        readme = handle.read()
    assert "python -m pytest " + " ".join(ci_profile.readme_pytest_args()) + "\n" in readme  # what CI runs
