"""raysgd's own lines reach the console with logging unconfigured, once each; the quiet settings hide them.

Real scripts run as subprocesses with logging left as a new user leaves it (unconfigured), and their stderr is read:
``examples/fault_tolerance.py`` (a worker killed mid-epoch, recovered) and a small script with one warning logged on
the driver (a deprecated option) and one on rank 0's actor (a sampler without a data cursor), which Ray forwards to
the driver's stderr under the actor's name.

The small script's four runs go two at a time in the background (``script_runs``, tests/background.py): what they
check does not depend on timing. The fault example's two runs stay one at a time, each in its own test: whether a
commit came before the kill changes its lines.
"""
import functools
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import background
from raysgd import logs

REPO = pathlib.Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the actor's name
LINE = re.compile(r"^(?:\(\S+ pid=\d+(?:, ip=[\d.]+)?\) )?\d\d:\d\d:\d\d raysgd (DEBUG|INFO|WARNING|ERROR|CRITICAL): (.*)$")

# One warning on the driver (a deprecated option), one on rank 0's actor (its sampler draws another order each time:
# no data cursor), two workers training one epoch. argv[1]: "plain", "configured" (logging.basicConfig first) or a
# level for raysgd.set_log_level.
SCRIPT = textwrap.dedent('''
    import logging, random, sys
    import ray, torch
    from torch.utils.data import DataLoader, Sampler, TensorDataset
    import raysgd
    from raysgd import TorchTrainer, TrainingOperator

    mode = sys.argv[1]
    if mode == "configured":
        logging.basicConfig(format="ROOT|%(levelname)s|%(name)s|%(message)s")
    elif mode != "plain":
        raysgd.set_log_level(mode)

    class Reshuffling(Sampler):
        """Shuffles with a random.Random of its own: raysgd cannot seed it (a warning on rank 0)."""
        def __init__(self, n):
            self.n, self.rng = n, random.Random()
        def __iter__(self):
            order = list(range(self.n))
            self.rng.shuffle(order)
            return iter(order)
        def __len__(self):
            return self.n

    class Operator(TrainingOperator):
        def setup(self, config):
            model = torch.nn.Linear(1, 1)
            self.register(models=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
                          criterion=torch.nn.MSELoss())
            data = TensorDataset(torch.randn(32, 1), torch.randn(32, 1))
            self.register_data(train_loader=DataLoader(data, batch_size=8, sampler=Reshuffling(32)))

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    trainer = TorchTrainer(training_operator_cls=Operator, num_workers=2, serialize_data_creation=True)
    print("samples", trainer.train()["num_samples"])
    trainer.shutdown()
    ray.shutdown()
''')

DRIVER_WARNING = "serialize_data_creation is deprecated and ignored"
WORKER_WARNING = "The DataLoader's sampler Reshuffling draws another order each time"


def run(args, env=None, timeout=240):
    """Run ``python args...`` in the repository with logging unconfigured; returns the finished process."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RAYSGD_") and k != "RAY_ADDRESS"}
    environment.update({"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                        "RAY_DEDUP_LOGS": "0", **(env or {})})
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"
    return done


#: The small script's runs: ``{name: (arguments, environment)}``.
SCRIPT_RUNS = {"plain": (["-c", SCRIPT, "plain"], {}),
               "quiet-env": (["-c", SCRIPT, "plain"], {"RAYSGD_LOG_LEVEL": "ERROR"}),
               "quiet-function": (["-c", SCRIPT, "OFF"], {}),
               "configured": (["-c", SCRIPT, "configured"], {})}


@pytest.fixture(scope="module")
def script_runs():
    """``{name: future of run(...)}`` of every ``SCRIPT_RUNS`` run, started two at a time when a test first asks."""
    with background.started({name: functools.partial(run, args, env)
                             for name, (args, env) in SCRIPT_RUNS.items()}) as runs:
        yield runs


def raysgd_lines(stderr):
    """``[(level, message)]`` of the lines raysgd's console handler wrote (the driver's, and the workers' Ray forwarded)."""
    return [match.groups() for match in map(LINE.match, ANSI.sub("", stderr).splitlines()) if match]


def count(lines, level, text):
    return sum(1 for found_level, message in lines if found_level == level and text in message)


@pytest.mark.slow
def test_the_fault_tolerance_example_says_what_happened_with_logging_unconfigured():
    """The killed worker is one WARNING naming it; where the call goes on and the workers now are one INFO line each."""
    done = run(["examples/fault_tolerance.py", "--smoke-test"])
    lines = raysgd_lines(done.stderr)
    assert count(lines, "WARNING", "train_epoch failed (rank 1: worker process died") == 1, done.stderr
    assert count(lines, "WARNING", "restarting workers, retry 1 of 3") == 1, done.stderr
    assert count(lines, "INFO", "No commit in this call yet: it goes on from its start") == 1, done.stderr
    assert count(lines, "INFO", "Workers now 2") == 1, done.stderr
    assert all("\n" not in message and len(message) < 400 for _, message in lines), lines  # one short line each
    assert not [line for line in lines if line[0] == "DEBUG"], lines


@pytest.mark.slow
def test_the_fault_tolerance_example_at_warning_shows_the_failure_only():
    done = run(["examples/fault_tolerance.py", "--smoke-test"], env={"RAYSGD_LOG_LEVEL": "WARNING"})
    lines = raysgd_lines(done.stderr)
    assert count(lines, "WARNING", "train_epoch failed (rank 1: worker process died") == 1, done.stderr
    assert not [line for line in lines if line[0] == "INFO"], lines


def test_a_script_sees_the_drivers_and_the_workers_warnings_once(script_runs):
    done = script_runs["plain"].result()
    assert "samples 32" in done.stdout
    lines = raysgd_lines(done.stderr)
    assert count(lines, "WARNING", DRIVER_WARNING) == 1, done.stderr
    assert count(lines, "WARNING", WORKER_WARNING) == 1, done.stderr  # rank 0 logs it; Ray forwards it
    forwarded = [line for line in ANSI.sub("", done.stderr).splitlines() if WORKER_WARNING in line][0]
    assert re.match(r"^\(\S+ pid=\d+", forwarded), forwarded  # under the actor's name
    assert not [line for line in lines if line[0] in ("DEBUG", "INFO") and "pid=" in line[1]], lines


@pytest.mark.parametrize("how", ["env", "function"])
def test_the_quiet_setting_hides_the_drivers_and_the_workers_lines(how, script_runs):
    done = script_runs[f"quiet-{how}"].result()  # RAYSGD_LOG_LEVEL=ERROR, or raysgd.set_log_level("OFF")
    assert "samples 32" in done.stdout
    assert raysgd_lines(done.stderr) == [], done.stderr
    assert DRIVER_WARNING not in done.stderr and WORKER_WARNING not in done.stderr, done.stderr


def test_a_program_that_configures_logging_sees_each_line_once_through_its_own_handler(script_runs):
    done = script_runs["configured"].result()
    assert done.stderr.count(DRIVER_WARNING) == 1, done.stderr
    assert f"ROOT|WARNING|raysgd.torch.options|{DRIVER_WARNING}" in done.stderr, done.stderr
    assert not [line for line in raysgd_lines(done.stderr) if DRIVER_WARNING in line[1]], done.stderr
    assert done.stderr.count(WORKER_WARNING) == 1, done.stderr  # the worker's process did not configure logging


# ----------------------------------------------------------------- in this process: the handler's rules
def test_levels_are_checked_and_named():
    assert logs.parse_level("debug") == logging.DEBUG and logs.parse_level(" Off ") > logging.CRITICAL
    with pytest.raises(ValueError, match=r"set_log_level\(level\) expects a level name \(DEBUG, INFO, WARNING, ERROR, "
                                         r"CRITICAL, OFF\) or a number; got 'LOUD'"):
        logs.set_log_level("LOUD")
    with pytest.raises(ValueError, match=r"set_log_level\(workers=...\) expects .*; got True"):
        logs.set_log_level("INFO", workers=True)


def test_the_console_writes_only_where_no_other_handler_would(capsys):
    console = logs.install()
    lonely = logging.getLogger("raysgd.test_console.lonely")  # cut off from the root (pytest's capture) and raysgd
    lonely.propagate = False
    lonely.addHandler(console)
    try:
        lonely.warning("only the console takes this")
        assert "raysgd WARNING: only the console takes this" in capsys.readouterr().err
        other = logging.StreamHandler(sys.stdout)
        lonely.addHandler(other)
        lonely.warning("the program's handler takes this")
        captured = capsys.readouterr()
        assert "the program's handler takes this" in captured.out and captured.err == ""
    finally:
        lonely.handlers.clear()
    record = logging.LogRecord("raysgd.x", logging.WARNING, __file__, 1, "m", None, None)
    assert console.others_handle(record) == bool(logging.getLogger().handlers)  # pytest's capture, if any


def test_set_log_level_reaches_the_workers_only_where_it_is_not_the_default(monkeypatch):
    for name in logs.FORWARDED_ENV:
        monkeypatch.delenv(name, raising=False)
    try:
        assert logs.forwarded_env() == {}
        logs.set_log_level("WARNING")
        assert logs.forwarded_env() == {"RAYSGD_LOG_LEVEL": "WARNING"}
        assert logging.getLogger("raysgd").level == logging.WARNING
        logs.set_log_level("INFO", workers="DEBUG")
        assert logs.forwarded_env() == {"RAYSGD_WORKER_LOG_LEVEL": "DEBUG"}
    finally:
        logs.set_log_level("INFO")
    level = logging.getLogger("raysgd").level
    try:  # a worker started by a driver at DEBUG logs DEBUG too; at INFO, WARNING; the environment is the fallback
        logs.as_worker({"RAYSGD_LOG_LEVEL": "DEBUG"})
        assert logging.getLogger("raysgd").level == logging.DEBUG
        logs.as_worker({})
        assert logging.getLogger("raysgd").level == logging.WARNING
        monkeypatch.setenv("RAYSGD_WORKER_LOG_LEVEL", "ERROR")
        logs.as_worker({"RAYSGD_LOG_LEVEL": "DEBUG"})
        assert logging.getLogger("raysgd").level == logging.ERROR
    finally:
        logging.getLogger("raysgd").setLevel(level)
