"""report() and get_all_reported_checkpoints() in one process: a session built here, its checkpoints written to a
temporary run folder and pruned as the driver prunes them (no Ray)."""
import os

import torch

from raysgd.torch.storage.filesystem import REPORT_MARKER, CheckpointStorage
from raysgd.train import retention
from raysgd.train.checkpoint import Checkpoint
from raysgd.train.commits import ReportCommits
from raysgd.train.config import CheckpointConfig
from raysgd.train.reported import get_all_reported_checkpoints
from raysgd.train.session import Session, TrainContext, report, running


class _RankZero:
    """The worker group as ReportCommits.poll reads it: rank 0's reports, taken from its reporter."""

    def __init__(self, reporter):
        self.reporter = reporter

    def poll_first(self, method, pending):
        assert method == "take_reports"
        return self.reporter.take(), None


def run_reports(tmp_path, config, metrics_list, heard=None):
    """Report a checkpoint with each of ``metrics_list`` (the driver polling and pruning after each, as
    TorchTrainer's does; ``heard`` gets the metrics of each report it hears of); returns what
    get_all_reported_checkpoints() lists after the last, and the folder's checkpoints."""
    def keep(complete):
        entries = [(index, marker.get("metrics", {})) for index, marker in complete]
        return {index for index, _ in complete} - set(retention.checkpoints_to_delete(entries, config))

    root = str(tmp_path / "run")
    storage = CheckpointStorage(root, num_to_keep=config.num_to_keep, marker=REPORT_MARKER, keep=keep)
    commits = ReportCommits(storage, home=None, checkpoint_config=config,
                            score_attribute=config.checkpoint_score_attribute,
                            on_report=lambda record: (heard if heard is not None else []).append(record["metrics"][0]))
    commits.begin_call()
    context = TrainContext(world_size=1, world_rank=0, local_rank=0, local_world_size=1, node_rank=0,
                           experiment_name="run", storage_path=str(tmp_path))
    session = Session(context, torch.device("cpu"), plan=commits.with_plan({})["plan"])
    source = tmp_path / "model"
    source.mkdir()
    (source / "model.pt").write_text("weights")
    with running(session):
        for metrics in metrics_list:
            report(metrics, checkpoint=Checkpoint.from_directory(source))
            commits.poll(_RankZero(session.reporter))  # the driver's tick: it hears of the report and prunes
        listed = get_all_reported_checkpoints()
    return [(os.path.basename(r.checkpoint.path), r.metrics) for r in listed], sorted(os.listdir(root))


def test_get_all_reported_checkpoints_leaves_out_those_num_to_keep_deleted(tmp_path):
    """With CheckpointConfig(num_to_keep=2), get_all_reported_checkpoints() listed every checkpoint reported,
    those the run had deleted too: loading one raised FileNotFoundError."""
    listed, on_disk = run_reports(tmp_path, CheckpointConfig(num_to_keep=2), [{"i": i} for i in range(4)])
    assert listed == [("checkpoint_000003", {"i": 2}), ("checkpoint_000004", {"i": 3})]
    assert [name for name, _ in listed] == on_disk


def test_get_all_reported_checkpoints_keeps_the_best_by_score_and_the_latest(tmp_path):
    """By score: the best num_to_keep and the latest (kept for restarts), in the order they were reported."""
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc")
    listed, on_disk = run_reports(tmp_path, config, [{"acc": 0.9}, {"acc": 0.1}, {"acc": 0.5}])
    assert listed == [("checkpoint_000001", {"acc": 0.9}), ("checkpoint_000003", {"acc": 0.5})]
    assert [name for name, _ in listed] == on_disk


def test_a_metrics_dict_updated_after_report_changes_no_report_made(tmp_path):
    """One worker, one metrics dict updated in place each epoch (a common loop): every report the driver and
    get_all_reported_checkpoints() saw had the last epoch's values (Result's metrics and the callbacks' too), since
    the dict was kept by reference; several workers' reports are copies."""
    metrics = {"val": {"loss": None}}

    def epochs():
        for epoch in range(3):
            metrics["epoch"], metrics["val"]["loss"] = epoch, 1.0 / (epoch + 1)
            yield metrics

    heard = []
    listed, _ = run_reports(tmp_path, CheckpointConfig(), epochs(), heard)
    expected = [{"val": {"loss": 1.0}, "epoch": 0}, {"val": {"loss": 0.5}, "epoch": 1},
                {"val": {"loss": 1 / 3}, "epoch": 2}]
    assert heard == expected
    assert [reported for _, reported in listed] == expected
