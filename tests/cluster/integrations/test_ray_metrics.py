"""Ray metrics read back from the node's Prometheus export: a real run's speed, size and failures.

Ray exports ``ray.util.metrics`` from the node's metrics agent, which runs with Ray's default install
(``raysgd[metrics]``; the ``test`` extra brings it too, so CI runs these tests); the test waits (with a deadline)
for the periodic export to show the run's values. Without the agent the tests fail (they never skip): a minimal Ray
writes -1 as the node's ``MetricsExportPort`` and exports nothing.
"""
import re
import time
import urllib.request

import pytest
import ray

from conftest import start_ray
from helpers import FaultyOperator
from raysgd.torch.integrations.ray_metrics import RayMetrics

EXPORT_DEADLINE_S = 90  # the deadline of a wait for the export (Ray's every few seconds: 1 s in these tests)


@pytest.fixture(scope="module", autouse=True)
def ray_exporting_every_second():
    """A 2-CPU local cluster whose processes report their metrics to the node's agent every second (10 s by
    default): the tests wait for the export that much less."""
    ray = start_ray(2, _system_config={"metrics_report_interval_ms": 1000})
    yield ray
    ray.shutdown()


def export_url():
    node = ray.nodes()[0]
    port = node.get("MetricsExportPort", -1)
    assert port and port > 0, ('no metrics agent on this node (a minimal Ray install, MetricsExportPort '
                               f'{port!r}): pip install -e ".[test]" brings ray[default]')
    return f"http://{node['NodeManagerAddress']}:{port}/metrics"


def samples(text, run):
    """``{metric: value}`` of the run's raysgd samples in a Prometheus text export."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"ray_(raysgd_\w+)\{(.*)\} (\S+)$", line)
        if match and f'run="{run}"' in match.group(2):
            found[match.group(1)] = float(match.group(3))
    return found


def wait_for_export(url, run, wanted):
    """Poll the export until ``wanted(values)`` holds; fail past the deadline showing what was there."""
    deadline, values = time.monotonic() + EXPORT_DEADLINE_S, {}
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                values = samples(answer.read().decode(), run)
        except OSError:
            pass
        if wanted(values):
            return values
        time.sleep(0.5)
    raise AssertionError(f"not exported within {EXPORT_DEADLINE_S} s; the run's values: {values}")


def test_speed_size_and_failures_are_exported(trainer_factory, tmp_path):
    url = export_url()
    fault = {"rank": 1, "batch": 1, "kind": "exit", "marker": str(tmp_path / "fault")}
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=2,
                              config={"lr": 0.01, "data_size": 40, "batch_size": 10, "fault": fault},
                              storage_path=str(tmp_path / "storage"))
    (metrics,) = [c for c in trainer.callbacks.callbacks if isinstance(c, RayMetrics)]
    stats = trainer.train()
    assert trainer.num_failures == 1
    trainer.controller.durable.flush(timeout_s=60)  # the epoch's checkpoint is written
    expected_rate = stats["num_samples"] / trainer.last_call_s
    values = wait_for_export(url, metrics.run, lambda v: v.get("raysgd_failures_total") == 1
                             and v.get("raysgd_checkpoints_total") == 1 and "raysgd_samples_per_s" in v)
    assert values["raysgd_workers"] == 2
    assert values["raysgd_samples_per_s"] == pytest.approx(expected_rate)
    assert values["raysgd_steps_per_s"] == pytest.approx(stats["batch_count"] / trainer.last_call_s)


def test_commit_latency_and_checkpoint_upload_time_are_exported(trainer_factory, tmp_path):
    """Every step commits (3 steps a worker): the commits of steps 1 and 2 are stored before the call ends (the
    next commit waits for the one in flight), so the call reports the latency the workers measured."""
    url = export_url()
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=2, commit_every_n_steps=1,
                              config={"lr": 0.01, "data_size": 60, "batch_size": 10},
                              storage_path=str(tmp_path / "storage"))
    (metrics,) = [c for c in trainer.callbacks.callbacks if isinstance(c, RayMetrics)]
    assert trainer.last_commit_latency_s is None and trainer.last_checkpoint_s is None
    stats = trainer.train()
    assert "__commit_latency_s__" not in stats  # the workers' latencies are taken out of the result
    trainer.controller.durable.flush(timeout_s=60)
    latency, upload = trainer.last_commit_latency_s, trainer.last_checkpoint_s
    assert 0 < latency < 60 and 0 < upload < 60
    values = wait_for_export(url, metrics.run, lambda v: "raysgd_commit_latency_s" in v
                             and "raysgd_checkpoint_upload_s" in v)
    assert values["raysgd_commit_latency_s"] == pytest.approx(latency)
    assert values["raysgd_checkpoint_upload_s"] == pytest.approx(upload)


def test_ray_metrics_can_be_turned_off(trainer_factory):
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=1, ray_metrics=False,
                              config={"data_size": 20, "batch_size": 10})
    assert not any(isinstance(c, RayMetrics) for c in trainer.callbacks.callbacks)
    with pytest.raises(TypeError, match="ray_metrics"):
        trainer_factory(training_operator_cls=FaultyOperator, ray_metrics="yes")
