"""use_fp16="apex" with a fake apex.amp on the workers' path (NVIDIA apex cannot be installed here)."""
import collections
import os

import pytest

from conftest import TESTS_DIR, start_ray, worker_env
from helpers import ClassifierOperator
from raysgd import TorchTrainer

FAKE_APEX = os.path.join(TESTS_DIR, "fake_apex")


@pytest.fixture(scope="module")
def apex_cluster(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("apex") / "calls.log")
    env = worker_env(extra_paths=[FAKE_APEX])
    env["env_vars"]["FAKE_APEX_LOG"] = log
    ray = start_ray(2, runtime_env=env)
    yield log
    ray.shutdown()


def calls(log):
    counts = collections.defaultdict(collections.Counter)
    with open(log) as handle:
        for line in handle:
            pid, event = line.split(" ", 1)
            counts[pid][event.split()[0]] += 1
    return counts


def test_apex_initialize_once_per_worker_and_scale_loss_every_step(apex_cluster):
    config = {"n": 96, "register_args": {"apex_args": {"opt_level": "O1"}}}
    trainer = TorchTrainer(training_operator_cls=ClassifierOperator, num_workers=2, use_fp16="apex", config=config)
    try:
        assert trainer.apply_all_operators(lambda op: (op.use_fp16_apex, op.use_fp16_native)) == [(True, False)] * 2
        stats = trainer.train()
        per_worker = calls(apex_cluster)
        assert len(per_worker) == 2
        for counter in per_worker.values():
            assert counter["initialize"] == 1 and counter["scale_loss"] == stats["batch_count"] == 3
        assert "opt_level=O1" in open(apex_cluster).read()

        state = trainer.state_dict()
        assert state["amp_apex"]["loss_scaler0"]["steps"] == 3
        trainer.load_state_dict(state, blocking=True)
        assert open(apex_cluster).read().count("load_state_dict steps=3") == 2
    finally:
        trainer.shutdown()
