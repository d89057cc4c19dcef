"""shutdown() releases everything at once (even after a failing pending call); placement_strategy reaches Ray."""
import threading

import pytest
import ray
import torch

from conftest import assert_released, live_actors, live_placement_groups
from helpers import LinearOperator
from raysgd import TorchTrainer

pytestmark = pytest.mark.usefixtures("ray_2cpus")


def assert_free_now():
    """No polling: what Ray reports right after shutdown() returned."""
    assert not live_actors(), live_actors()
    assert not live_placement_groups(), live_placement_groups()
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"], ray.available_resources()


@pytest.mark.parametrize("use_local", [False, True])
def test_shutdown_returns_with_the_resources_free(use_local):
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, use_local=use_local, timeout_s=30)
    trainer.train()
    trainer.shutdown()
    assert_free_now()
    assert not [t for t in threading.enumerate() if t.name == "raysgd-rank0"]  # rank 0's thread is gone too


def test_shutdown_after_a_failing_pending_call_still_releases_everything(tmp_path, caplog):
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, timeout_s=30, logdir=str(tmp_path))
    try:
        state = trainer.state_dict()
        state["models"][0]["weight"] = torch.zeros(3, 3)  # a trainer state, but every worker's load_state_dict raises
        trainer.load_state_dict(state, blocking=False)
    finally:
        trainer.shutdown()  # the pending call's error is logged, not raised: shutdown must finish its job
    assert_free_now()
    assert any("size mismatch" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("strategy", ["PACK", "STRICT_PACK", "SPREAD"])
def test_placement_strategy_reaches_the_placement_group(strategy):
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, placement_strategy=strategy)
    try:
        (group,) = live_placement_groups()
        assert group["strategy"] == strategy
    finally:
        trainer.shutdown()


def test_default_placement_strategy_is_spread_as_in_1x():
    trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2)
    try:
        assert [g["strategy"] for g in live_placement_groups()] == ["SPREAD"]
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("value", ["spread", "FILL", None])
def test_bad_placement_strategy_is_refused_before_any_actor_starts(value):
    with pytest.raises(ValueError) as info:
        TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, placement_strategy=value)
    for word in ("placement_strategy", "'PACK'", "'STRICT_SPREAD'", repr(value)):
        assert word in str(info.value)
    assert_released()
