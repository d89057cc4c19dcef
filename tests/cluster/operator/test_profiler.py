"""``TorchTrainer.profile``: a torch.profiler trace per rank, written by the driver; the steps count as training."""
import json

import pytest
import torch

from helpers import LinearOperator
from raysgd import TorchTrainer
from raysgd.torch.operator.tracing import TraceRecorder


def events(path):
    with open(path) as handle:
        return json.load(handle)["traceEvents"]


@pytest.mark.parametrize("use_local", [False, True], ids=["actors", "rank0-local"])
def test_profile_writes_one_trace_per_rank_and_trains_those_steps(ray_2cpus, tmp_path, use_local):
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, use_local=use_local, timeout_s=60,
                           config={"data_size": 64, "batch_size": 4})
    try:
        result = trainer.profile(num_steps=3, logdir=tmp_path / "traces")
        after_profile = trainer.train()  # the rest of the epoch: 8 batches per worker, 3 of them already trained
    finally:
        trainer.shutdown()
    assert result["traces"] == [str(tmp_path / "traces" / f"rank_{r}.pt.trace.json") for r in (0, 1)]
    assert result["num_samples"] == 2 * 3 * 4 and after_profile["num_samples"] == 2 * 5 * 4
    for path in result["traces"]:
        names = {event.get("name", "") for event in events(path)}
        assert any(name.startswith("aten::") for name in names), sorted(names)[:20]  # the ops of the steps
        assert any("allreduce" in name.lower() for name in names), "DDP's gradient allreduce is in the trace"
    assert not list((tmp_path / "traces").glob("*.tmp"))


def test_profile_checks_its_arguments_before_any_call(tmp_path):
    trainer = TorchTrainer.__new__(TorchTrainer)  # no workers: the checks come first
    with pytest.raises(ValueError, match="num_steps expects an int >= 1"):
        trainer.profile(num_steps=0, logdir=tmp_path)
    with pytest.raises(ValueError, match="num_steps expects an int >= 1"):
        trainer.profile(num_steps=None, logdir=tmp_path)
    with pytest.raises(TypeError, match="logdir expects a local folder path"):
        trainer.profile(num_steps=2, logdir=None)
    with pytest.raises(ValueError, match="local folder"):
        trainer.profile(num_steps=2, logdir="s3://bucket/traces")
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(ValueError, match="cannot be created"):
        trainer.profile(num_steps=2, logdir=tmp_path / "file" / "traces")


def test_a_trace_is_recorded_only_when_asked_and_handed_out_once():
    recorder = TraceRecorder()
    with recorder.record(False):
        torch.ones(3).sum()
    assert recorder.take() is None
    with recorder.record(True):
        torch.mm(torch.ones(4, 4), torch.ones(4, 4))
    trace = json.loads(recorder.take())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    assert recorder.take() is None
