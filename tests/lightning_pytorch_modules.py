"""A LightningModule under the ``lightning.pytorch`` import name, for tests/api/test_lightning.py.

Kept apart from lightning_modules.py so that workers loading those modules import one Lightning package only.
"""
import lightning.pytorch as lp
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from lightning_modules import blobs


class PlateauClassifier(lp.LightningModule):
    """The same network under the ``lightning.pytorch`` import name, with ReduceLROnPlateau on a logged value."""

    def __init__(self, config):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)
        self.lr = config.get("lr", 0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("const", 1.0)
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": plateau, "monitor": "const"}

    def train_dataloader(self):
        return DataLoader(blobs(64), batch_size=16)

    def val_dataloader(self):
        return DataLoader(blobs(64, seed=1), batch_size=16)
