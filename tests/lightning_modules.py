"""LightningModules for tests/api/test_lightning.py (importable by workers: tests/ is on their path)."""
import os

import pytorch_lightning as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(n=256, seed=0):
    """Two separable classes in 4 dimensions."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


class Classifier(pl.LightningModule):
    """An MLP with a dict-form configure_optimizers; config picks the scheduler and an injected fault."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        torch.manual_seed(config.get("seed", 3))
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.calls = []
        self.loaded = None
        self.autocast_seen = []

    def forward(self, x):
        return self.net(x)

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def on_train_epoch_start(self):
        self.calls.append(f"on_train_epoch_start:{self.current_epoch}")

    def on_train_epoch_end(self):
        self.calls.append("on_train_epoch_end")
        self.log("epochs_seen", float(self.current_epoch + 1))

    def on_validation_epoch_start(self):
        self.calls.append("on_validation_epoch_start")

    def on_validation_epoch_end(self):
        self.calls.append("on_validation_epoch_end")

    def training_step(self, batch, batch_idx):
        fault = self.config.get("fault")
        if fault and self.global_rank == fault["rank"] and batch_idx == fault["batch"]:
            if not os.path.exists(fault["marker"]):
                with open(fault["marker"], "w") as handle:
                    handle.write(str(os.getpid()))
                os._exit(1)
        x, y = batch
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.log("train_acc", (logits.argmax(1) == y).float().mean())
        self.log_dict({"rank_seen": float(self.global_rank)})
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.log("val_acc", (logits.argmax(1) == y).float().mean())
        self.log("const", 1.0)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.config.get("lr", 0.2))
        if self.config.get("scheduler") == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "const"}}
        step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "epoch", "frequency": 1}}

    def train_dataloader(self):
        return DataLoader(blobs(self.config.get("n", 256)), batch_size=16, shuffle=True)

    def val_dataloader(self):
        return DataLoader(blobs(128, seed=1), batch_size=32)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["marker"] = {"saved_at_step": checkpoint["global_step"], "weights": len(checkpoint["state_dict"])}

    def on_load_checkpoint(self, checkpoint):
        self.loaded = checkpoint["marker"]


class PointsData(pl.LightningDataModule):
    """Points from a 2-d Gaussian around (2, -1); ``prepare_data`` appends a line to ``config["prepare_log"]``."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def prepare_data(self):
        with open(self.config["prepare_log"], "a") as handle:
            handle.write(f"{os.getpid()}\n")

    def setup(self, stage):
        generator = torch.Generator().manual_seed(0)
        self.points = torch.randn(128, 2, generator=generator) * 0.5 + torch.tensor([2.0, -1.0])

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.points), batch_size=16, shuffle=True)


class TinyGAN(pl.LightningModule):
    """A GAN on 2-d points with two optimizers and manual optimization; no ``config`` argument."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch, batch_idx):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        z = torch.randn(real.size(0), 2)
        fake = self(z)
        g_loss = bce(self.discriminator(fake), torch.ones(real.size(0), 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = (bce(self.discriminator(real), torch.ones(real.size(0), 1))
                  + bce(self.discriminator(fake.detach()), torch.zeros(real.size(0), 1))) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self.clip_gradients(opt_d, gradient_clip_val=10.0, gradient_clip_algorithm="norm")
        opt_d.step()
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def on_train_epoch_end(self):
        self.lr_schedulers().step()

    def configure_optimizers(self):
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=0.01)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.1)]


class NotAModule(nn.Module):
    """A plain torch module: from_ptl refuses it."""


class StepScheduled(pl.LightningModule):
    """Per-step scheduling (every 2nd batch), an overridden optimizer_step and an early epoch end."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.net = nn.Linear(4, 2)
        self.closure_losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == self.config.get("stop_at", -2) else None

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        self.closure_losses.append(float(optimizer.step(closure=optimizer_closure).detach()))

    def configure_optimizers(self):
        optimizers = [torch.optim.SGD(self.parameters(), lr=1.0) for _ in range(self.config.get("optimizers", 1))]
        scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.5)
        return optimizers, [{"scheduler": scheduler, "interval": "step", "frequency": 2}]

    def train_dataloader(self):
        return DataLoader(blobs(64), batch_size=8)
