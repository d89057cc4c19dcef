"""Mixed precision: the Precision object alone, then use_fp16 on real 2-worker trainers (CPU)."""
import logging

import pytest
import torch
import torch.nn as nn

from helpers import ClassifierOperator, DtypeRecorder
from raysgd import TorchTrainer
from raysgd.torch.operator import precision as precision_module
from raysgd.torch.operator.precision import Precision

CPU = torch.device("cpu")


def test_disabled_precision_is_plain_fp32():
    torch.manual_seed(0)
    model, data = nn.Linear(4, 1), torch.randn(8, 4)
    reference = nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    precision = Precision(False, CPU)
    assert not precision.enabled and precision.state_dict() == {}
    for _ in range(3):
        with precision.autocast():
            loss = model(data).pow(2).mean()
        opt.zero_grad()
        precision.backward(loss)
        precision.step(opt)
        ref_opt.zero_grad()
        reference(data).pow(2).mean().backward()
        ref_opt.step()
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


def test_fp16_on_cpu_keeps_fp32_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(precision_module, "_warned_cpu_fp16", False)
    caplog.set_level(logging.WARNING, logger="raysgd.torch.operator.precision")
    first, second = Precision(True, CPU), Precision(True, CPU)
    assert first.autocast_dtype is None and not first.scaler.is_enabled() and not second.enabled
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "bf16" in messages[0]


def test_bf16_autocasts_without_a_scaler():
    precision = Precision("bf16", CPU)
    assert precision.autocast_dtype is torch.bfloat16 and not precision.scaler.is_enabled()
    with precision.autocast():
        out = nn.Linear(4, 2)(torch.randn(3, 4))
    assert out.dtype is torch.bfloat16


def test_unknown_mode_and_missing_apex_are_clear_errors():
    with pytest.raises(ValueError, match="fp8"):
        Precision("fp8", CPU)
    with pytest.raises(ImportError, match="NVIDIA apex"):
        Precision("apex", CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: float16 autocast and GradScaler")
def test_fp16_on_cuda_scales_and_round_trips_the_scaler_state():
    device = torch.device("cuda")
    model = nn.Linear(16, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision(True, device)
    assert precision.autocast_dtype is torch.float16 and precision.scaler.is_enabled()
    for _ in range(3):
        with precision.autocast():
            out = model(torch.randn(8, 16, device=device))
            loss = out.float().pow(2).mean()
        assert out.dtype is torch.float16
        opt.zero_grad()
        precision.backward(loss)
        precision.step(opt)
    state = precision.state_dict()
    assert set(state) == {"amp_native"} and state["amp_native"]["scale"] > 0
    restored = Precision(True, device)
    restored.load_state_dict(state)
    assert restored.scaler.get_scale() == precision.scaler.get_scale()


# ----------------------------------------------------------------------------- on a real 2-worker trainer
@pytest.fixture(scope="module")
def cluster(ray_4cpus):
    return ray_4cpus


def test_apex_missing_on_the_workers_is_a_clear_error_before_training(cluster):
    """The workers of this module's cluster have no apex (tests/cluster/operator/test_apex.py gives its own a fake one)."""
    with pytest.raises(ImportError, match="NVIDIA apex"):
        TorchTrainer(training_operator_cls=ClassifierOperator, num_workers=1, use_fp16="apex")


def test_trainers_learn_under_each_cpu_mode_and_fp16_true_on_cpu_is_bit_identical_to_fp32(cluster):
    """Each CPU mode learns, and trains and validates in its dtype; ``use_fp16=True`` on the CPU keeps fp32, so its
    trained model is bit-identical to ``use_fp16=False``'s. (One trainer per mode for both checks: each trainer
    start is ~3 s of worker start-up.)"""
    trained = {}
    for use_fp16 in (False, True, "bf16"):
        trainer = TorchTrainer(training_operator_cls=DtypeRecorder, num_workers=2, use_fp16=use_fp16, timeout_s=60,
                               config={"n": 240, "batch_size": 16})
        try:
            losses = [trainer.train()["train_loss"] for _ in range(6)]
            assert losses[-1] < losses[0] * 0.8, (use_fp16, losses)
            dtypes = trainer.apply_all_operators(lambda op: sorted(op.seen_dtypes))
            expected = ["torch.bfloat16"] if use_fp16 == "bf16" else ["torch.float32"]
            assert dtypes == [expected, expected], use_fp16
            trainer.apply_all_operators(lambda op: op.seen_dtypes.clear())
            trainer.validate()  # validation runs under autocast too (without scaling)
            assert trainer.apply_all_operators(lambda op: sorted(op.seen_dtypes)) == [expected, expected], use_fp16
            assert trainer.apply_all_operators(lambda op: op.use_fp16) == [use_fp16, use_fp16]
            trained[use_fp16] = trainer.state_dict()["models"][0]  # (get_model() would carry the hook)
        finally:
            trainer.shutdown()
    for key in trained[False]:
        assert torch.equal(trained[False][key], trained[True][key]), key


def test_custom_gan_loop_with_the_helpers(cluster):
    from raysgd import TrainingOperator
    from torch.utils.data import DataLoader, TensorDataset

    class TinyGAN(TrainingOperator):
        def setup(self, config):
            torch.manual_seed(0)
            gen, disc = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2)), nn.Sequential(nn.Linear(2, 1))
            opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
            opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
            self.models, self.optimizers, self.criterion = self.register(
                models=(gen, disc), optimizers=(opt_g, opt_d), criterion=nn.BCEWithLogitsLoss())
            real = torch.randn(64, 2) * 0.5 + 2.0
            self.register_data(train_loader=DataLoader(TensorDataset(real), batch_size=16))

        def train_batch(self, batch, batch_info):
            (real,) = batch
            gen, disc = self.models
            opt_g, opt_d = self.optimizers
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            with self.autocast():
                fake = gen(torch.randn(len(real), 2))
                d_loss = self.criterion(disc(real).float(), ones) + self.criterion(disc(fake.detach()).float(), zeros)
            self.backward_and_step(d_loss, opt_d, clip_grad_norm=1.0)
            with self.autocast():
                g_loss = self.criterion(disc(fake).float(), ones)
            self.backward_and_step(g_loss, opt_g)
            return {"loss_d": d_loss.item(), "loss_g": g_loss.item(), "num_samples": len(real),
                    "fake_dtype": str(fake.dtype)}

    trainer = TorchTrainer(training_operator_cls=TinyGAN, num_workers=2, use_fp16="bf16")
    try:
        stats = trainer.train()
        assert stats["num_samples"] == 64 and stats["fake_dtype"] == "torch.bfloat16"
        assert stats["loss_d"] > 0 and stats["loss_g"] > 0
        gen, disc = trainer.get_model()
        assert isinstance(gen, nn.Sequential) and isinstance(disc, nn.Sequential)
    finally:
        trainer.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs: nccl and float16 GradScaler")
def test_nccl_fp16_trainer_round_trips_the_scaler(cluster):
    trainer = TorchTrainer(training_operator_cls=ClassifierOperator, num_workers=1, use_gpu=True, use_fp16=True)
    try:
        trainer.train()
        state = trainer.state_dict()
        assert "amp_native" in state
        trainer.load_state_dict(state, blocking=True)
        assert trainer.state_dict()["amp_native"]["scale"] == state["amp_native"]["scale"]
    finally:
        trainer.shutdown()


def test_apex_state_round_trip_reads_the_legacy_key(monkeypatch, tmp_path):
    from conftest import TESTS_DIR

    monkeypatch.syspath_prepend(f"{TESTS_DIR}/fake_apex")
    monkeypatch.setenv("FAKE_APEX_LOG", str(tmp_path / "log"))
    precision = Precision("apex", CPU)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model,), (opt,) = precision.initialize([model], [opt], {"opt_level": "O2"})
    precision.backward(model(torch.ones(1, 2)).sum(), opt)
    precision.step(opt)
    state = precision.state_dict()
    assert set(state) == {"amp_apex"}
    precision.load_state_dict({"amp": state["amp_apex"]})  # 1.x checkpoints used the key "amp"
    log = (tmp_path / "log").read_text()
    assert "initialize opt_level=O2" in log and "scale_loss" in log and "load_state_dict" in log
