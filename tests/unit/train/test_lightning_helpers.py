"""raysgd.train.lightning's Trainer helpers inside a training function on a session built here (no Ray).

Which Lightning package the classes subclass is fixed per process at their first use, so each check runs in a fresh
Python (a subprocess) that imports only the package it tests.
"""
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import os, shutil, sys, tempfile
    import torch, torch.distributed as dist
    import {package} as pl
    from raysgd.train.session import Session, TrainContext, running
    from raysgd.train.lightning import (RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback,
                                        prepare_trainer)

    reported = []

    class Recording(Session):
        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None):
            super().report(metrics, checkpoint, checkpoint_dir_name)
            reported.append((metrics, sorted(os.listdir(checkpoint.path))))

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, index):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    context = TrainContext(world_size=1, world_rank=0, local_rank=0, local_world_size=1, node_rank=0,
                           experiment_name="exp", storage_path="/tmp")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with running(Recording(context, torch.device("cpu"))):
        trainer = prepare_trainer(pl.Trainer(
            max_epochs=1, strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
            callbacks=[RayTrainReportCallback()], devices="auto", accelerator="auto", enable_progress_bar=False,
            logger=False, enable_checkpointing=False, enable_model_summary=False,
            default_root_dir=tempfile.mkdtemp()))
        data = torch.utils.data.TensorDataset(torch.randn(4, 2), torch.randn(4, 1))
        trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))
    dist.destroy_process_group()
    assert RayDDPStrategy.__mro__[1].__module__.startswith("{package}"), RayDDPStrategy.__mro__
    [(metrics, files)] = reported
    assert sorted(metrics) == ["epoch", "loss", "step"] and isinstance(metrics["loss"], float), metrics
    assert files == ["checkpoint.ckpt"], files
    print("OK")
""")


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_the_helpers_subclass_the_lightning_package_the_function_imported(package):
    """With both Lightning packages installed, a training function written with ``import pytorch_lightning as pl``
    failed at ``pl.Trainer(strategy=RayDDPStrategy())`` with Lightning's "You selected an invalid strategy name ...
    It must be ... an instance of `pytorch_lightning.strategies.Strategy`": the helpers subclassed
    ``lightning.pytorch``'s classes, whichever package the function used."""
    pytest.importorskip(package)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _SCRIPT.format(package=package)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=root)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


def test_ray_trains_deepspeed_strategy_is_refused_saying_what_to_use():
    """``from ray.train.lightning import RayDeepSpeedStrategy`` (under ``--train``) raised a bare "cannot import
    name", where raysgd.train's other missing names say they are not supported and what to use instead."""
    import raysgd.train.lightning

    with pytest.raises(ImportError, match=r"RayDeepSpeedStrategy is not supported: DeepSpeed .* RayFSDPStrategy"):
        raysgd.train.lightning.RayDeepSpeedStrategy
    with pytest.raises(AttributeError, match="has no attribute 'RayOtherStrategy'"):
        raysgd.train.lightning.RayOtherStrategy
