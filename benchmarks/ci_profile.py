"""Where the test suite's time goes: its modules, its tests, its lanes, and the machine's CPU by process kind (Linux).

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/ci_profile.py                       # README's test command, profiled
    PYTHONPATH=$PWD python benchmarks/ci_profile.py -- tests/api -n 2     # pytest's arguments after --
    PYTHONPATH=$PWD python benchmarks/ci_profile.py --smoke-test          # two modules (the tests run it)

pytest runs (with the arguments of README's test command, read from README.md as CI reads it, unless arguments
follow ``--``) with this module as a plugin (``-p ci_profile``), which notes when each test starts and ends on
each lane. Beside it a thread reads ``/proc`` every ``--interval`` s: the machine's busy share, and each process's
CPU time under a kind named from its command line (``ray::TorchWorker``, ``gcs_server``, ``python dcgan.py``,
``pytest lane``, ...). It reads every process on the machine: profile on a machine doing nothing else. A process's
CPU is counted up to its last sample: a short one's is a lower bound, and the first line says how much of the
machine's busy time the kinds hold.

Each process is also put on a lane: a lane's own pytest process by its pid (the plugin notes it), any other by the
environment it started with (the lane's ``PYTEST_XDIST_WORKER``, which its Ray clusters, their workers and the
scripts a test starts inherit), or else by its parent's lane (a script a test starts with an environment of its
own); what has none of these is outside the lanes. The CPU a process spends between two samples goes to the module
whose test was running on its lane then, so a module's CPU is what its lane spent while it ran: its own processes,
and its share of a cluster it shares with the modules before and after.

Tables: the modules by their tests' time (setup and teardown included; with their CPU and the processes they
started), the costliest tests by their CPU (measured the same way, by test), the lanes (a lane that ends long
before the other is time the suite's order could win back), and the CPU by kind: seconds, share of the accounted
CPU, processes, seconds each. On a machine the suite keeps busy (two cores: 94% of the whole suite's run, see
docs/development.md), only less CPU makes it faster; the kinds say where it goes, and the modules' and tests' CPU
which of them spend it. ``--json PATH`` writes the tables. The script exits with pytest's status.
"""
import argparse
import bisect
import collections
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_ARGS = ["-q", "-n", "2", "--dist", "loadfile", "tests/unit/core/test_utils.py",
              "tests/cluster/integrations/test_results.py"]  # a unit module, and one with a Ray cluster and a trainer
MAIN_LANE = "main"  # the lane's name where pytest runs without xdist
MARK = "RAYSGD_CI_PROFILE_RUN"  # in the environment of every process this run starts: its value is the run's id
LANE_START = "(a lane's start, before its first test)"
OUTSIDE = "(outside the lanes)"
RELAY = "(xdist's relay: the pytest process that starts the lanes)"


# -- the plugin, in the pytest process and in each xdist lane ------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--ci-profile-events", default=None, help="ci_profile: the file each test's start and end go to")


_EVENTS = None  # this process's events file; None where nothing is noted (not asked for, or xdist's relay)


def pytest_sessionstart(session):
    global _EVENTS
    # With xdist, the pytest process only relays its lanes' tests (its "dsession" plugin): they note their own.
    relay = session.config.pluginmanager.hasplugin("dsession")
    _EVENTS = None if relay else session.config.getoption("--ci-profile-events")


def _note(event, nodeid):
    if _EVENTS:
        line = json.dumps({"t": time.time(), "lane": os.environ.get("PYTEST_XDIST_WORKER", MAIN_LANE),
                           "pid": os.getpid(), "event": event, "test": nodeid})
        with open(_EVENTS, "a", encoding="utf-8") as handle:  # one short line per write: lanes append side by side
            handle.write(line + "\n")


def pytest_runtest_logstart(nodeid, location):
    _note("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _note("end", nodeid)


# -- the sampler ------------------------------------------------------------------------------------------------------

def kind(argv, comm):
    """The kind a process's CPU is counted under, from its command line (``argv``, a list) or, where that is empty
    (a kernel thread, a process exiting), its ``comm``.

    Example:
        >>> kind(["ray::TorchWorker.train_epoch"], "ray::TorchWork")
        'ray::TorchWorker'
        >>> kind(["/venv/bin/python", "-u", "examples/dcgan.py", "--smoke-test"], "python")
        'python dcgan.py'
    """
    if not argv:
        return comm if comm.startswith("ray::") else f"kernel or exited: {comm}"
    if argv[0].startswith("ray::"):
        return argv[0].split(".")[0]
    exe = os.path.basename(argv[0])
    if not exe.startswith("python"):
        return exe
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "-m":
            return f"python -m {next(rest, '?')}"
        if arg == "-c":
            code = next(rest, "")
            return "pytest lane" if "sys.stdin.readline" in code else "python -c"
        if arg in ("-X", "-W"):
            next(rest, None)
        elif not arg.startswith("-"):
            name = os.path.basename(arg)
            return "ray worker, not yet named" if name == "default_worker.py" else f"python {name}"
    return "python"


def _machine_ticks():
    with open("/proc/stat", encoding="ascii") as handle:
        values = [int(v) for v in handle.readline().split()[1:9]]  # guest time is in user time already
    return sum(values), values[3] + values[4]  # all, idle + iowait


def lane_mark(environ, run_id):
    """The lane a process started in, from its environment at its start (``environ``: ``/proc/<pid>/environ``'s
    bytes), or None when it does not carry ``run_id`` under :data:`MARK` (not this run's).

    Example:
        >>> lane_mark(b"RAYSGD_CI_PROFILE_RUN=r1\\0PYTEST_XDIST_WORKER=gw1\\0", "r1")
        'gw1'
        >>> lane_mark(b"RAYSGD_CI_PROFILE_RUN=r1\\0", "r1"), lane_mark(b"HOME=/root\\0", "r1")
        ('main', None)
    """
    values = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
    if values.get(MARK.encode()) != run_id.encode():
        return None
    return values.get(b"PYTEST_XDIST_WORKER", MAIN_LANE.encode()).decode(errors="replace")


class Sampler(threading.Thread):
    """Reads every process's CPU time from /proc each ``interval`` s until ``stop()``; ``cpu_by_kind()`` sums them,
    ``spent()`` lists them by sample.

    A process seen first with CPU time already spent (it started before the sampler) counts only what it spends
    after. A Ray worker renames itself (``ray::IDLE``, then its actor's class), so the last name seen wins. Each
    process's lane is read once from its environment (:func:`lane_mark`, with ``run_id``).
    """

    def __init__(self, interval, run_id=""):
        super().__init__(daemon=True, name="ci-profile-sampler")
        self.interval, self._done, self._lock = interval, threading.Event(), threading.Lock()
        self._tick, self._run_id = os.sysconf("SC_CLK_TCK"), run_id
        with open("/proc/uptime", encoding="ascii") as handle:
            self._begun_tick = float(handle.read().split()[0]) * self._tick  # ticks since boot
        # (pid, start tick) -> [kind, ticks at first sight or 0, ticks now, lane mark, time of first sight, parent]
        self._procs = {}
        self._spent = []  # (time of the sample, (pid, start tick), CPU ticks since the process's previous sample)
        self._now = time.time()
        self.machine_start = _machine_ticks()

    def run(self):
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)
        self.sample()

    def stop(self):
        self._done.set()
        self.join(timeout=30)
        self.machine_end = _machine_ticks()

    def sample(self):
        self._now = time.time()
        for pid in os.listdir("/proc"):
            if pid.isdigit() and pid != str(os.getpid()):
                self._read(pid)

    def _read(self, pid):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = [a.decode(errors="replace") for a in handle.read().split(b"\0") if a]
        except OSError:  # it ended between the listing and the read
            return
        comm, fields = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        ticks, start = int(fields[11]) + int(fields[12]), int(fields[19])
        with self._lock:
            entry = self._procs.get((pid, start))
            if entry is None:
                first = ticks if start < self._begun_tick else 0
                entry = self._procs[(pid, start)] = [kind(argv, comm), first, first, self._lane(pid), self._now,
                                                     fields[1]]
            elif argv:
                entry[0] = kind(argv, comm)
            if ticks > entry[2]:
                self._spent.append((self._now, (pid, start), ticks - entry[2]))
            entry[2] = ticks

    def _lane(self, pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                return lane_mark(handle.read(), self._run_id)
        except OSError:  # ended, or not ours to read
            return None

    def cpu_by_kind(self):
        """``{kind: (cpu seconds, processes)}``."""
        seconds, count = collections.Counter(), collections.Counter()
        with self._lock:
            for name, first, last, *_ in self._procs.values():
                seconds[name] += (last - first) / self._tick
                count[name] += 1
        return {name: (seconds[name], count[name]) for name in seconds}

    def spent(self):
        """``(processes, spent)``: ``{(pid, start tick): (kind, lane mark, time of first sight, parent pid)}`` and
        ``[(time, (pid, start tick), CPU seconds)]``, the CPU each process spent since its previous sample."""
        with self._lock:
            processes = {key: (entry[0], entry[3], entry[4], entry[5]) for key, entry in self._procs.items()}
            return processes, [(t, key, ticks / self._tick) for t, key, ticks in self._spent]

    def machine(self):
        """``(busy CPU seconds, busy share)`` between the sampler's start and its stop."""
        total = self.machine_end[0] - self.machine_start[0]
        idle = self.machine_end[1] - self.machine_start[1]
        return (total - idle) / self._tick, (total - idle) / total if total else 0.0


def readme_pytest_args():
    """The arguments of pytest in README's test command (what CI runs), read by .ci/readme_command.py."""
    path = os.path.join(ROOT, ".ci", "readme_command.py")
    spec = importlib.util.spec_from_file_location("readme_command", path)
    readme_command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(readme_command)
    test_command, runner = readme_command.command("tests"), "python -m pytest"
    if runner not in test_command:
        raise SystemExit(f"README's test command should run {runner!r}; got {test_command!r}")
    return shlex.split(test_command.split(runner, 1)[1])


# -- the report ------------------------------------------------------------------------------------------------------

def tests_from(events_path):
    """``([(lane, test id, start, end)], {pid: lane})`` from the plugin's file: the finished tests, and each lane's
    own process."""
    started, tests, lane_pids = {}, [], {}
    with open(events_path, encoding="utf-8") as handle:
        for line in handle:
            event = json.loads(line)
            key = (event["lane"], event["test"])
            if "pid" in event:
                lane_pids[str(event["pid"])] = event["lane"]
            if event["event"] == "start":
                started[key] = event["t"]
            elif key in started:
                tests.append((event["lane"], event["test"], started.pop(key), event["t"]))
    return tests, lane_pids


def module_of(test):
    """The module of a test id (``tests/x/test_y.py::test_z[a]`` -> ``tests/x/test_y.py``)."""
    return test.split("::")[0]


def by_module(tests, lane_pids, processes, spent, group=module_of):
    """``{module: [CPU seconds, processes started]}``, or by ``group(test id)`` (``group=str``: by test; the
    pseudo-rows below stay): each sample's CPU goes to the module of the test running on the process's lane at that
    time (the last one started there), a process to the module running when it was first seen. A lane's own process
    is found by its pid (``lane_pids``), any other by its lane mark (see :class:`Sampler`'s ``spent``), or else by
    its parent's lane. What comes before a lane's first test is :data:`LANE_START`, what has no lane
    :data:`OUTSIDE`, and the processes of a main lane that ran no test (xdist's relay, and what it started before
    the lanes) :data:`RELAY`."""
    starts = collections.defaultdict(list)
    for lane, test, start, _ in sorted(tests, key=lambda row: row[2]):
        starts[lane].append((start, group(test)))
    times = {lane: [start for start, _ in rows] for lane, rows in starts.items()}
    by_pid = {key[0]: key for key in sorted(processes, key=lambda key: processes[key][2])}  # a reused pid: the last

    def lane_of(key):
        seen = set()
        while key not in seen:  # up the parents, to the first process whose lane is known
            seen.add(key)
            (pid, _), (_, mark, _, parent) = key, processes[key]
            if pid in lane_pids or mark is not None:
                return lane_pids.get(pid, mark)
            if parent not in by_pid:
                return None
            key = by_pid[parent]
        return None

    def module_at(key, t):
        lane = lane_of(key)
        if lane is None:
            return OUTSIDE
        if lane == MAIN_LANE and lane not in times:
            return RELAY
        at = bisect.bisect_right(times.get(lane, []), t)
        return starts[lane][at - 1][1] if at else LANE_START

    result = collections.defaultdict(lambda: [0.0, 0])
    for t, key, seconds in spent:
        result[module_at(key, t)][0] += seconds
    for key, (_, _, first_seen, _) in processes.items():
        if key[0] not in lane_pids:
            result[module_at(key, first_seen)][1] += 1
    return dict(result)


def summarise(tests, cpu, machine, wall_s, top, modules_cpu=None, tests_cpu=None):
    """The tables (see the module's docstring) as one JSON-able dict; ``modules_cpu``: :func:`by_module`'s;
    ``tests_cpu``: its answer by test (``group=str``), which adds the table of the costliest tests by CPU."""
    modules = collections.defaultdict(lambda: {"tests": 0, "seconds": 0.0, "lanes": set()})
    lanes = collections.defaultdict(lambda: {"tests": 0, "busy_s": 0.0, "first": None, "last": None})
    origin = min((start for _, _, start, _ in tests), default=0.0)
    for lane, test, start, end in tests:
        module = modules[module_of(test)]
        module["tests"] += 1
        module["seconds"] += end - start
        module["lanes"].add(lane)
        row = lanes[lane]
        row["tests"] += 1
        row["busy_s"] += end - start
        row["first"] = start if row["first"] is None else min(row["first"], start)
        row["last"] = end if row["last"] is None else max(row["last"], end)
    accounted = sum(seconds for seconds, _ in cpu.values())
    busy_s, busy_share = machine
    modules_cpu = modules_cpu or {}
    took = {test: end - start for _, test, start, end in tests}
    costliest = sorted((item for item in (tests_cpu or {}).items() if item[0] in took), key=lambda item: -item[1][0])
    result = {
        "wall_s": round(wall_s, 1), "cpus": os.cpu_count(), "machine_busy_share": round(busy_share, 3),
        "machine_busy_cpu_s": round(busy_s, 1), "accounted_cpu_s": round(accounted, 1),
        "modules": [{"module": name, "tests": m["tests"], "seconds": round(m["seconds"], 2),
                     "lanes": ",".join(sorted(m["lanes"])), "cpu_s": round(modules_cpu.get(name, (0.0, 0))[0], 1),
                     "processes": modules_cpu.get(name, (0.0, 0))[1]}
                    for name, m in sorted(modules.items(), key=lambda item: -item[1]["seconds"])[:top]],
        "between_modules": {name: {"cpu_s": round(modules_cpu[name][0], 1), "processes": modules_cpu[name][1]}
                            for name in (LANE_START, RELAY, OUTSIDE) if name in modules_cpu},
        "lanes": [{"lane": lane, "tests": row["tests"], "busy_s": round(row["busy_s"], 2),
                   "starts_s": round(row["first"] - origin, 2), "ends_s": round(row["last"] - origin, 2)}
                  for lane, row in sorted(lanes.items())],
        "cpu": [{"kind": name, "cpu_s": round(spent, 1), "share": round(spent / accounted, 3) if accounted else 0,
                 "processes": count, "s_each": round(spent / count, 2)}
                for name, (spent, count) in sorted(cpu.items(), key=lambda item: -item[1][0])[:top] if spent > 0],
    }
    if tests_cpu is not None:
        result["tests"] = [{"test": test, "seconds": round(took[test], 2), "cpu_s": round(spent, 1),
                            "processes": count} for test, (spent, count) in costliest[:top]]
    return result


def print_tables(result):
    from tabulate import tabulate

    print(f"wall {result['wall_s']} s on {result['cpus']} CPUs; the machine was busy "
          f"{100 * result['machine_busy_share']:.0f}% ({result['machine_busy_cpu_s']} CPU-s), of which the process "
          f"kinds below account for {result['accounted_cpu_s']} CPU-s")
    for name, row in result.get("between_modules", {}).items():
        print(f"{name}: {row['cpu_s']} CPU-s, {row['processes']} processes")
    for title, key in (("Modules, by their tests' time", "modules"), ("Tests, by their CPU", "tests"),
                       ("Lanes", "lanes"), ("CPU by process kind", "cpu")):
        if key in result:
            print(f"\n{title}\n" + tabulate(result[key], headers="keys", tablefmt="github"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke-test", action="store_true",
                        help="profile a unit module and a trainer's module (the tests run this)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between two reads of /proc (0.5)")
    parser.add_argument("--top", type=int, default=30, help="rows per table (30)")
    parser.add_argument("--json", help="also write the tables to this file")
    args = parser.parse_args(ours)
    if args.interval <= 0 or args.top <= 0:
        parser.error(f"--interval and --top take numbers > 0, got {args.interval} and {args.top}")
    if not os.path.exists("/proc/stat"):
        parser.error("ci_profile reads /proc: it runs on Linux only")
    pytest_args = pytest_args or (SMOKE_ARGS if args.smoke_test else readme_pytest_args())
    with tempfile.TemporaryDirectory(prefix="ci-profile-") as folder:
        events = os.path.join(folder, "events.jsonl")
        open(events, "w").close()
        here, run_id = os.path.dirname(os.path.abspath(__file__)), os.path.basename(folder)
        # A run from inside a test lane (the tests' smoke run) must not look like that lane to its own pytest.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, ROOT, os.environ.get("PYTHONPATH")) if p)
        env[MARK] = run_id
        sampler, started = Sampler(args.interval, run_id), time.monotonic()
        sampler.start()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "ci_profile", "--ci-profile-events", events,
                                   *pytest_args], cwd=ROOT, env=env)
        finally:
            sampler.stop()
        tests, lane_pids = tests_from(events)
        processes, spent = sampler.spent()
        result = summarise(tests, sampler.cpu_by_kind(), sampler.machine(), time.monotonic() - started, args.top,
                           by_module(tests, lane_pids, processes, spent),
                           by_module(tests, lane_pids, processes, spent, group=str))
    result.update(pytest_args=pytest_args, pytest_exit_status=proc.returncode)
    print_tables(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
