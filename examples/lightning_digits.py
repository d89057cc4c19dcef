"""Train a PyTorch Lightning classifier on scikit-learn's digits with raysgd (``TrainingOperator.from_ptl``).

The model stays an ordinary ``LightningModule`` (``training_step``, ``validation_step``, ``self.log``,
``configure_optimizers`` with a scheduler dict); ``from_ptl`` turns it into a raysgd operator, so it
trains on ``--num-workers`` Ray actors (DDP), epoch by epoch from this script, with raysgd's fault
recovery, checkpoints, mixed precision (``--bf16``) and Tune. Needs ``pip install "raysgd[examples]"``
(Lightning and scikit-learn).

    python examples/lightning_digits.py                 # 2 workers, 15 epochs, ~99% validation accuracy
    python examples/lightning_digits.py --smoke-test    # a quick check
"""
import argparse
import time

import numpy as np
import ray
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator, optional
from raysgd.utils import BATCH_SIZE

# Lightning and scikit-learn (the data); without them this says what to install: pip install "raysgd[examples]"
pl = optional.require("pytorch_lightning", "examples/lightning_digits.py", extra="examples")
load_digits = optional.require("sklearn.datasets", "examples/lightning_digits.py", extra="examples").load_digits


class DigitsModule(pl.LightningModule):
    """A small convolutional network on 8x8 digits; ``config`` comes from ``TorchTrainer(config=...)``."""

    def __init__(self, config):
        super().__init__()
        self.save_hyperparameters({k: v for k, v in config.items() if isinstance(k, str) and k.isidentifier()})
        self.config = config
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Dropout(0.2), nn.Linear(64 * 4, 10))

    def forward(self, x):
        return self.net(x)

    def prepare_data(self):
        load_digits()  # once per node: scikit-learn ships the data, so nothing to download

    def setup(self, stage):
        images, labels = load_digits(return_X_y=True)
        order = np.random.default_rng(0).permutation(len(labels))[:self.config.get("limit")]
        images = torch.tensor(images[order] / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)
        labels = torch.tensor(labels[order], dtype=torch.long)
        n_val = len(labels) // 5
        self.train_set = TensorDataset(images[n_val:], labels[n_val:])
        self.val_set = TensorDataset(images[:n_val], labels[:n_val])

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        self.log("train_accuracy", (logits.argmax(1) == y).float().mean())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean())
        return nn.functional.cross_entropy(logits.float(), y)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.config["lr"])
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.config["epochs"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}

    def train_dataloader(self):
        # config[BATCH_SIZE] is the global batch size divided by the workers; raysgd shards the loader.
        return DataLoader(self.train_set, batch_size=self.config[BATCH_SIZE], shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=256)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="2 epochs on part of the data")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", "-n", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size, split among the workers")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (Lightning's precision='bf16-mixed')")
    parser.add_argument("--use-gpu", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke_test:
        args.epochs = 2
    ray.init(address=args.address or "local", include_dashboard=False)
    config = {"lr": args.lr, "epochs": args.epochs, BATCH_SIZE: args.batch_size,
              "limit": 600 if args.smoke_test else None}
    trainer = TorchTrainer(training_operator_cls=TrainingOperator.from_ptl(DigitsModule), num_workers=args.num_workers,
                           config=config, use_gpu=args.use_gpu, use_fp16="bf16" if args.bf16 else False)
    start = time.monotonic()
    for epoch in range(1, args.epochs + 1):
        train_stats = trainer.train()
        val_stats = trainer.validate()
        print(f"epoch {epoch:3d}  train_loss {train_stats['train_loss']:.4f}  "
              f"train_accuracy {train_stats['train_accuracy']:.4f}  val_loss {val_stats['val_loss']:.4f}  "
              f"val_accuracy {val_stats['val_accuracy']:.4f}")
    elapsed = time.monotonic() - start
    model = trainer.get_model()  # the DigitsModule itself, unwrapped, on the CPU of this process
    trainer.shutdown()
    print(f"final val_accuracy {val_stats['val_accuracy']:.4f} with {args.num_workers} workers, {args.epochs} "
          f"epochs in {elapsed:.1f} s; got back a {type(model).__name__} (lr hyperparameter {model.hparams.lr})")
    ray.shutdown()
    return val_stats["val_accuracy"]


if __name__ == "__main__":
    main()
