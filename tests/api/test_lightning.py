"""TrainingOperator.from_ptl: LightningModules trained by real Ray workers (DDP over gloo), on Lightning 2.x."""
import os
import subprocess
import sys
import textwrap

import pytest

pl = pytest.importorskip("pytorch_lightning", reason="the Lightning tests need pip install 'raysgd[test]'")
pytest.importorskip("lightning.pytorch", reason="the lightning.pytorch import name needs pip install 'raysgd[test]'")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from conftest import REPO_DIR  # noqa: E402
from lightning_modules import Classifier, NotAModule, PointsData, StepScheduled, TinyGAN  # noqa: E402
from lightning_pytorch_modules import PlateauClassifier  # noqa: E402
from raysgd import TrainingOperator  # noqa: E402
from raysgd.torch.operator import lightning_bridge as lightning  # noqa: E402
from raysgd.torch.lightning_operator import LightningOperator  # noqa: E402
from raysgd.torch.execution.worker import TorchWorker  # noqa: E402


def flat_params(op):
    return torch.cat([p.detach().reshape(-1) for p in op.get_model().parameters()])


def replicas_identical(trainer):
    first, *others = trainer.apply_all_operators(flat_params)
    return all(torch.equal(first, other) for other in others)


# ----------------------------------------------------------------- no cluster
def test_from_ptl_refuses_a_class_that_is_not_a_lightning_module():
    with pytest.raises(TypeError, match=r"LightningModule.*got class lightning_modules\.NotAModule"):
        TrainingOperator.from_ptl(NotAModule)
    with pytest.raises(TypeError, match="LightningModule.*got 3"):
        TrainingOperator.from_ptl(3)
    with pytest.raises(TypeError, match="datamodule=.*LightningDataModule"):
        TrainingOperator.from_ptl(Classifier, datamodule=NotAModule)
    operator_cls = TrainingOperator.from_ptl(Classifier)
    assert issubclass(operator_cls, LightningOperator) and issubclass(operator_cls, TrainingOperator)


def test_without_lightning_import_raysgd_works_and_from_ptl_says_what_to_install():
    script = textwrap.dedent("""
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("pytorch_lightning", "lightning"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Hide())
        import raysgd
        from raysgd import TrainingOperator
        import torch
        try:
            TrainingOperator.from_ptl(torch.nn.Linear)
        except ImportError as err:
            print("IMPORT-ERROR:", err)
        assert "pytorch_lightning" not in sys.modules
    """)
    root = REPO_DIR
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'IMPORT-ERROR: TrainingOperator.from_ptl needs PyTorch Lightning 2.x: pip install "raysgd[lightning]"' \
        in result.stdout


def test_every_configure_optimizers_form_is_parsed():
    model = nn.Linear(2, 2)
    a, b = torch.optim.SGD(model.parameters(), lr=1.0), torch.optim.Adam(model.parameters())
    step = torch.optim.lr_scheduler.StepLR(a, 1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(b)
    parse = lightning.parse_optimizers
    assert parse(None) == ([], [])
    assert parse(a) == ([a], [])
    assert parse([a, b]) == ([a, b], []) and parse((a, b)) == ([a, b], [])
    opts, configs = parse(([a, b], [step]))
    assert opts == [a, b] and configs[0].scheduler is step and configs[0].interval == "epoch"
    opts, configs = parse({"optimizer": a, "lr_scheduler": {"scheduler": step, "interval": "step", "frequency": 3}})
    assert (configs[0].interval, configs[0].frequency, configs[0].reduce_on_plateau) == ("step", 3, False)
    opts, configs = parse({"optimizer": b, "lr_scheduler": plateau, "monitor": "val_loss"})
    assert configs[0].reduce_on_plateau and configs[0].monitor == "val_loss"
    opts, configs = parse([{"optimizer": a, "lr_scheduler": step},
                           {"optimizer": b, "lr_scheduler": {"scheduler": plateau, "monitor": "x"}}])
    assert opts == [a, b] and [c.monitor for c in configs] == [None, "x"]
    with pytest.raises(ValueError, match="needs a 'monitor'"):
        parse({"optimizer": b, "lr_scheduler": plateau})
    with pytest.raises(ValueError, match="'interval' must be 'step' or 'epoch'; got 'batch'"):
        parse({"optimizer": a, "lr_scheduler": {"scheduler": step, "interval": "batch"}})
    with pytest.raises(TypeError, match="configure_optimizers must return .* got str"):
        parse("adam")
    assert lightning.use_fp16_for_precision("bf16-mixed") == "bf16"
    with pytest.raises(ValueError, match="'64-true' has no raysgd use_fp16 equivalent"):
        lightning.use_fp16_for_precision("64-true")


def test_the_1x_module_path_resolves_again():
    from raysgd import compat

    compat.install()
    try:
        from ray.util.sgd.torch.lightning_operator import LightningOperator as legacy  # noqa: PLC0415
    finally:
        compat.uninstall()
    assert legacy is LightningOperator


def in_process(module_cls, config=None):
    """A one-worker TorchWorker in this process (no Ray), its operator set up."""
    worker = TorchWorker(TrainingOperator.from_ptl(module_cls), dict(config or {}), is_local=True)
    worker.setup_operator()
    return worker


def test_step_interval_frequency_optimizer_step_override_and_early_epoch_end():
    worker = in_process(StepScheduled)
    op = worker.operator
    stats = worker.train_epoch()
    assert stats["num_samples"] == 64 and len(op.get_model().closure_losses) == 8  # the closure ran every batch
    assert op.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 ** 4)  # 8 batches, every 2nd: 4 steps
    with pytest.raises(RuntimeError, match="validate.. needs validation data for StepScheduled: define val_dataloader"):
        worker.validate()
    stopped = in_process(StepScheduled, {"stop_at": 3}).train_epoch()
    assert stopped["num_samples"] == 24  # on_train_batch_start returned -1 at batch 3
    with pytest.raises(ValueError, match="2 optimizers: several optimizers need manual optimization"):
        in_process(StepScheduled, {"optimizers": 2})


def test_on_train_batch_start_minus_one_ends_the_epoch_and_a_restart_agrees():
    """-1 ends the epoch (Lightning's rule): the next train() starts a new one. It used to go on with the rest of
    the epoch past the batch the hook refused, while the cursor said that batch was not consumed, so a restart
    from the state trained other batches than the worker that went on."""
    live = in_process(StepScheduled, {"stop_at": 3})
    first = live.train_epoch()
    assert first["epoch"] == 1 and first["num_samples"] == 24
    saved = live.state_dict()
    assert "cursor" not in saved and saved["epoch"] == 1  # the epoch is over: nothing of it is left to resume
    restarted = in_process(StepScheduled, {"stop_at": 3})
    restarted.load_state_dict(saved)
    second, again = live.train_epoch(), restarted.train_epoch()
    assert second["epoch"] == again["epoch"] == 2 and second["num_samples"] == again["num_samples"] == 24
    assert torch.equal(flat_params(live.operator), flat_params(restarted.operator))


# ----------------------------------------------------------------- on Ray workers
@pytest.fixture(scope="module")
def cluster(ray_2cpus):
    return ray_2cpus


def test_dict_form_steplr_and_self_log_on_two_workers(cluster, trainer_factory):
    trainer = trainer_factory(training_operator_cls=TrainingOperator.from_ptl(Classifier), num_workers=2,
                              use_local=True, config={"lr": 0.2})  # rank 0 here, rank 1 an actor: one start-up
    before = trainer.validate()
    stats = [trainer.train() for _ in range(2)]
    after = trainer.validate()
    for key in ("train_loss", "train_acc", "rank_seen", "epochs_seen"):
        assert key in stats[-1], stats[-1]
    assert stats[-1]["rank_seen"] == pytest.approx(0.5)  # each rank logged its own rank: reduced over both
    assert stats[-1]["epochs_seen"] == 2.0 and stats[-1]["num_samples"] == 256
    assert {"val_loss", "val_acc", "const"} <= set(after) and after["num_samples"] == 128
    assert after["val_loss"] < before["val_loss"] and after["val_acc"] > 0.8
    lrs = trainer.apply_all_operators(lambda op: op.optimizers[0].param_groups[0]["lr"])
    assert lrs == [pytest.approx(0.2 * 0.5 ** 2)] * 2  # StepLR stepped once per epoch, twice
    assert replicas_identical(trainer)
    calls = trainer.apply_all_operators(lambda op: op.get_model().calls)[1]
    assert calls[:2] == ["setup:fit", "on_fit_start"]
    assert calls.count("on_train_epoch_end") == 2 and "on_train_epoch_start:1" in calls
    assert calls.count("on_validation_epoch_start") == calls.count("on_validation_epoch_end") == 2
    model = trainer.get_model()
    assert isinstance(model, Classifier) and isinstance(model, pl.LightningModule)
    assert model.fabric is None and model._trainer is None  # detached: it pickled back to the driver


def test_manual_optimization_gan_without_config_and_a_datamodule(cluster, trainer_factory, tmp_path):
    log = tmp_path / "prepare.log"
    operator_cls = TrainingOperator.from_ptl(TinyGAN, datamodule=PointsData)
    trainer = trainer_factory(training_operator_cls=operator_cls, num_workers=2, use_local=True,
                              config={"prepare_log": str(log)})
    start = trainer.apply_all_operators(flat_params)[0]
    stats = trainer.train()
    assert {"g_loss", "d_loss"} <= set(stats) and "train_loss" not in stats and stats["num_samples"] == 128
    assert len(log.read_text().splitlines()) == 1  # prepare_data ran once on this node
    end = trainer.apply_all_operators(flat_params)
    assert not torch.equal(start, end[0]) and torch.equal(end[0], end[1])  # trained, and DDP kept them equal
    lrs = trainer.apply_all_operators(lambda op: [o.param_groups[0]["lr"] for o in op.optimizers])
    assert lrs[0] == [pytest.approx(0.001), pytest.approx(0.01)]  # self.lr_schedulers().step() on opt_g only


def test_reduce_lr_on_plateau_steps_after_validate_with_the_monitored_value(cluster, trainer_factory):
    trainer = trainer_factory(training_operator_cls=TrainingOperator.from_ptl(PlateauClassifier), num_workers=1,
                              use_local=True, config={"lr": 0.1})
    op = trainer.get_local_operator()
    lr = lambda: op.optimizers[0].param_groups[0]["lr"]  # noqa: E731
    for _ in range(2):
        trainer.train()
        assert lr() == 0.1 or len(op._pending_plateau) == 1  # waits for the monitored value from validate()
        stats = trainer.validate()
    assert stats["const"] == 1.0 and "val_loss" in stats
    assert lr() == pytest.approx(0.05)  # "const" did not improve on the second epoch: halved once


def test_save_and_load_round_trip_runs_the_checkpoint_hooks(cluster, trainer_factory, tmp_path):
    operator_cls = TrainingOperator.from_ptl(Classifier)
    trainer = trainer_factory(training_operator_cls=operator_cls, num_workers=1, use_local=True,
                              use_fp16="bf16", config={"lr": 0.2})
    trainer.train()
    path = str(tmp_path / "ckpt.pt")
    trainer.save(path)
    saved = trainer.get_model()
    assert all(saved.autocast_seen)  # use_fp16="bf16" reached training_step: autocast was on
    trainer.shutdown()
    fresh = trainer_factory(training_operator_cls=operator_cls, num_workers=1, use_local=True, config={"lr": 0.2})
    fresh.load(path)
    loaded = fresh.get_model()
    assert loaded.loaded == {"saved_at_step": 16, "weights": 4}
    for a, b in zip(saved.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    op = fresh.get_local_operator()
    assert op.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1) and op.global_step == 16
    assert fresh.train()["epoch"] == 2


def test_a_worker_killed_mid_epoch_is_recovered(cluster, trainer_factory, tmp_path):
    marker = tmp_path / "fault"
    trainer = trainer_factory(training_operator_cls=TrainingOperator.from_ptl(Classifier), num_workers=2,
                              use_local=True, timeout_s=30,  # rank 1, the actor, dies; rank 0 sees gloo fail
                              config={"fault": {"rank": 1, "batch": 3, "marker": str(marker)}})
    stats = trainer.train()
    assert marker.exists() and trainer.num_failures == 1
    assert stats["num_samples"] == 256 and stats["epoch"] == 1 and trainer.worker_group.num_workers == 2
    assert replicas_identical(trainer)
    assert trainer.validate()["num_samples"] == 128
