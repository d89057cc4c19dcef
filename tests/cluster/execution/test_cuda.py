"""On a real GPU: device selection, nccl, use_local, fp16 with a GradScaler, bf16, state moving between devices.

Every test here needs CUDA and skips without it (CI has no GPU). On the GPU device machine they run with
``bash benchmarks/device/run_gpu_checks.sh tests`` (see benchmarks/README.md). The machine has one GPU, so
multi-rank nccl cannot run there: the nccl trainers have 1 worker, and the 2-rank tests (faults, commits)
share the GPU with ``num_gpus_per_worker=0.5`` over gloo.
"""
import math
import os

import pytest
import torch
import torch.nn as nn

from conftest import start_ray
from helpers import (ClassifierOperator, CountingOperator, DtypeRecorder, FaultyOperator, LinearOperator, counts,
                     executed, kill_after_commit, seeding_hook, tune_two_workers_on_one_gpu)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")]


@pytest.fixture(scope="module")
def gpu_cluster():
    ray = start_ray(4, num_gpus=torch.cuda.device_count())
    yield ray
    ray.shutdown()


@pytest.fixture
def gpu_trainer(gpu_cluster, trainer_factory):
    return lambda **kwargs: trainer_factory(**{"training_operator_cls": ClassifierOperator, "num_workers": 1,
                                               "timeout_s": 120, **kwargs})


def set_scale(value):
    """A function for apply_all_operators setting the GradScaler's scale (also before its first step)."""
    return lambda op: op.precision.scaler.load_state_dict({**op.precision.scaler.state_dict(), "scale": value})


def devices_of(trainer):
    return trainer.apply_all_operators(lambda op: sorted({p.device.type for p in op.model.parameters()}))


def test_use_gpu_auto_picks_the_gpu_and_nccl(gpu_trainer):
    trainer = gpu_trainer()  # use_gpu="auto", backend="auto"
    assert trainer.use_gpu is True and trainer.backend == "nccl"
    assert trainer.apply_all_operators(lambda op: str(op.device)) == ["cuda:0"]
    assert trainer.apply_all_workers(lambda: torch.distributed.get_backend()) == ["nccl"]
    assert devices_of(trainer) == [["cuda"]]
    stats = trainer.train()
    assert stats["num_samples"] == 240 and math.isfinite(stats["train_loss"])
    val = trainer.validate()
    assert val["num_samples"] == 240 and 0 <= val["val_accuracy"] <= 1


def test_use_local_trains_on_the_gpu_in_the_driver(gpu_trainer):
    trainer = gpu_trainer(use_local=True, use_gpu=True)
    first = trainer.train()["train_loss"]
    operator = trainer.get_local_operator()
    assert operator.device.type == "cuda" and {p.device.type for p in operator.model.parameters()} == {"cuda"}
    for _ in range(4):
        last = trainer.train()["train_loss"]
    assert last < first


def test_fp16_autocasts_to_float16_and_the_scaler_round_trips_save_and_load(gpu_trainer, tmp_path):
    trainer = gpu_trainer(training_operator_cls=DtypeRecorder, use_gpu=True, use_fp16=True)
    for _ in range(2):
        stats = trainer.train()
    assert math.isfinite(stats["train_loss"])
    assert "torch.float16" in trainer.apply_all_operators(lambda op: op.seen_dtypes)[0]
    state = trainer.state_dict()
    assert state["amp_native"]["scale"] > 0
    trainer.apply_all_operators(set_scale(1234.0))  # a scale no default has
    trainer.save(str(tmp_path / "ckpt"))
    other = gpu_trainer(training_operator_cls=DtypeRecorder, use_gpu=True, use_fp16=True)
    other.load(str(tmp_path / "ckpt"))
    assert other.apply_all_operators(lambda op: op.precision.scaler.get_scale()) == [1234.0]
    assert other.state_dict()["amp_native"]["scale"] == 1234.0
    other.train()


def test_fp16_scaler_state_survives_a_worker_failure(gpu_trainer, tmp_path):
    fault = {"rank": 0, "batch": 3, "kind": "exit", "marker": str(tmp_path / "fault")}
    trainer = gpu_trainer(training_operator_cls=FaultyOperator, use_gpu=True, use_fp16=True,
                          config={"data_size": 200, "batch_size": 10, "fault": fault})
    trainer.apply_all_operators(set_scale(96.0))  # taken into train()'s snapshot
    stats = trainer.train()
    assert (tmp_path / "fault").exists() and trainer.num_failures == 1  # the worker really died
    assert stats["num_samples"] == 200
    # the restarted worker loaded the snapshot's scale: a fresh scaler starts at 65536, which halving never
    # turns into 96, and 20 steps are far from the growth interval of 2000, so the scale is unchanged
    assert trainer.apply_all_operators(lambda op: op.precision.scaler.get_scale()) == [96.0]
    assert devices_of(trainer) == [["cuda"]]


def test_bf16_autocasts_on_cuda_without_a_scaler(gpu_trainer):
    trainer = gpu_trainer(training_operator_cls=DtypeRecorder, use_gpu=True, use_fp16="bf16")
    stats = trainer.train()
    assert math.isfinite(stats["train_loss"])
    assert "torch.bfloat16" in trainer.apply_all_operators(lambda op: op.seen_dtypes)[0]
    assert "amp_native" not in trainer.state_dict()


def test_get_model_to_cpu_from_a_gpu_worker(gpu_trainer):
    trainer = gpu_trainer(use_gpu=True)
    trainer.train()
    model = trainer.get_model(to_cpu=True)
    assert isinstance(model, nn.Module) and {p.device.type for p in model.parameters()} == {"cpu"}
    assert devices_of(trainer) == [["cuda"]]  # the worker's own model did not move
    expected = trainer.apply_all_operators(lambda op: [p.detach().cpu() for p in op.model.parameters()])[0]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected))


def test_load_state_dict_lands_on_each_workers_device(gpu_trainer):
    source = gpu_trainer(training_operator_cls=LinearOperator, use_gpu=False)
    for _ in range(3):
        source.train()
    state = source.state_dict()  # CPU tensors
    target = gpu_trainer(training_operator_cls=LinearOperator, use_gpu=True)
    target.load_state_dict(state, blocking=True)
    assert devices_of(target) == [["cuda"]]
    loaded = target.state_dict()
    for name, value in state["models"][0].items():
        assert torch.equal(loaded["models"][0][name].cpu(), value.cpu()), name
    target.train()  # the optimizer state moved too: a step works on the GPU


def test_two_workers_share_the_gpu_and_a_killed_rank_is_replaced_with_the_scaler_kept(gpu_trainer, tmp_path):
    fault = {"rank": 1, "batch": 3, "kind": "exit", "marker": str(tmp_path / "fault")}
    trainer = gpu_trainer(training_operator_cls=FaultyOperator, num_workers=2, use_gpu=True, num_gpus_per_worker=0.5,
                          use_fp16=True, config={"data_size": 200, "batch_size": 10, "fault": fault})
    assert trainer.backend == "gloo" and devices_of(trainer) == [["cuda"], ["cuda"]]
    trainer.apply_all_operators(set_scale(96.0))
    before = trainer.apply_all_workers(os.getpid)
    stats = trainer.train()
    after = trainer.apply_all_workers(os.getpid)
    assert (tmp_path / "fault").exists() and trainer.num_failures == 1
    assert stats["num_samples"] == 200 and trainer.worker_group.num_workers == 2
    assert after[0] == before[0] and after[1] != before[1]  # the survivor kept its process (and its CUDA context)
    assert trainer.apply_all_operators(lambda op: op.precision.scaler.get_scale()) == [96.0, 96.0]
    assert devices_of(trainer) == [["cuda"], ["cuda"]]
    assert trainer.validate()["num_samples"] == 100


def test_a_commit_on_the_gpu_resumes_exactly_once_and_bit_exact(gpu_trainer, tmp_path):
    """CountingOperator's dropout draws from the CUDA generator: the commit must carry every rank's CUDA stream."""
    n = 96
    defaults = dict(training_operator_cls=CountingOperator, num_workers=2, use_gpu=True, num_gpus_per_worker=0.5,
                    commit_every_n_steps=3, initialization_hook=seeding_hook)
    clean = gpu_trainer(**defaults, config={"n": n, "batch_size": 4})
    expected = [clean.train() for _ in range(2)]
    expected_state = clean.state_dict()
    clean.shutdown()

    log, marker = str(tmp_path / "log"), str(tmp_path / "fault")
    faulty = gpu_trainer(**defaults, config={"n": n, "batch_size": 4, "log": log,
                                             "fault": {"step": 8, "rank": 1, "marker": marker}})
    kill_after_commit(faulty, marker, min_steps=6)
    first = faulty.train()
    assert os.path.exists(marker) and faulty.num_failures == 1
    assert first["num_samples"] == n and torch.equal(counts(faulty), torch.ones(n))
    assert first["train_loss"] == pytest.approx(expected[0]["train_loss"], rel=1e-6)
    assert executed(log) <= 24 + 2 * 3, executed(log)  # one commit interval recomputed, not the epoch
    faulty.train()
    got = faulty.state_dict()
    assert got["global_step"] == expected_state["global_step"]
    for key, value in expected_state["models"][0].items():
        assert torch.equal(got["models"][0][key].cpu(), value.cpu()), key


def test_a_tune_trial_trains_two_workers_on_the_gpu(gpu_cluster, tmp_path):
    pytest.importorskip("ray.tune", reason="needs ray[tune] (on the device: pydantic, carried in .whl/)")
    result = tune_two_workers_on_one_gpu(tmp_path)
    assert result.metrics["devices"] == "cuda:0,cuda:0" and result.metrics["backend"] == "gloo"
    assert math.isfinite(result.metrics["val_loss"]) and 0 <= result.metrics["val_accuracy"] <= 1


@pytest.mark.parametrize("num_workers", [1, 2])
def test_torch_compile_with_inductor_trains_and_saves_the_plain_model(gpu_trainer, num_workers):
    """The default backend (inductor, Triton kernels); 2 workers share the GPU, compiled outside DDP."""
    shared = {"num_gpus_per_worker": 0.5} if num_workers == 2 else {}
    trainer = gpu_trainer(use_gpu=True, num_workers=num_workers, config={"compile": {}}, **shared)
    first = trainer.train()["train_loss"]
    for _ in range(3):
        last = trainer.train()["train_loss"]
    assert last < first
    names = trainer.apply_all_operators(lambda op: type(op.model).__name__)
    assert names == ["OptimizedModule"] * num_workers
    state = trainer.state_dict()
    assert not any(key.startswith("_orig_mod.") for key in state["models"][0])
    model = trainer.get_model(to_cpu=True)
    assert isinstance(model, nn.Sequential) and {p.device.type for p in model.parameters()} == {"cpu"}
    assert 0 <= trainer.validate()["val_accuracy"] <= 1
