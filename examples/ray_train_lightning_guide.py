"""The Ray Train Lightning guide's script (FashionMNIST, ResNet18), run on raysgd.train: unchanged but for the data.

The guide ("Get Started with Distributed Training using PyTorch Lightning") trains torchvision's ResNet18 in a
``LightningModule`` with ``RayDDPStrategy``, ``RayLightningEnvironment``, ``RayTrainReportCallback`` and
``prepare_trainer``, then loads ``result.checkpoint`` with ``ImageClassifier.load_from_checkpoint``. Here the
images are synthetic (no download): 1x28x28 tensors of 10 classes, each class a fixed random pattern under noise,
so the loss has something to learn; the ResNet is raysgd's own (:mod:`raysgd.torch.resnet`, torchvision not
needed) with the guide's 1-channel ``conv1`` (``ImageClassifier(small=True)``: one block per stage, for the smoke
test). The rest is the guide's code with its ``ray.train`` imports, plus the epochs, batch size and storage options
from the command line, and ``ray.init`` (``--address``, else a local Ray without the dashboard). Run it on raysgd
(``ray.train`` mapped to ``raysgd.train``)::

    python -m raysgd.legacy --train examples/ray_train_lightning_guide.py --smoke-test

Without the mapping (``python examples/ray_train_lightning_guide.py``) the imports are Ray Train's own (not tested
here). Without Lightning it stops at once with an ``ImportError`` saying ``pip install "raysgd[examples]"``.
Every epoch's checkpoint is reported (``checkpoint.ckpt``, Lightning's own); the script prints the last
metrics and the loaded model's accuracy on the training data.
"""
import argparse
import os

try:
    import lightning.pytorch as pl
except ImportError:  # the guide's import; without Lightning, say what to install (Lightning's older name
    from raysgd import optional  # works too, as raysgd.train.lightning takes either)

    pl = optional.require("pytorch_lightning", "examples/ray_train_lightning_guide.py", extra="examples")
import torch
from torch.utils.data import DataLoader, TensorDataset

import ray
import ray.train
import ray.train.lightning
from ray.train.torch import TorchTrainer
from raysgd.torch.resnet import BasicBlock, ResNet, ResNet18


def resnet18(num_classes, small=False):
    """raysgd's ResNet18 in place of torchvision's (``small``: one block per stage, for the smoke test)."""
    return ResNet18({"num_classes": num_classes}) if not small else ResNet(BasicBlock, [1, 1, 1, 1])


def synthetic_fashion_mnist(size):
    """FashionMNIST's shapes (1x28x28 images, 10 classes): a pattern per class under noise, seeded (the same data
    on every worker)."""
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (size,), generator=generator)
    images = patterns[labels] + torch.randn(size, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


# Model, Loss, Optimizer
class ImageClassifier(pl.LightningModule):
    def __init__(self, small=False):
        super(ImageClassifier, self).__init__()
        self.save_hyperparameters()  # `small`, for load_from_checkpoint
        self.model = resnet18(num_classes=10, small=small)
        self.model.conv1 = torch.nn.Conv2d(
            1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
        )
        self.criterion = torch.nn.CrossEntropyLoss()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        outputs = self.forward(x)
        loss = self.criterion(outputs, y)
        self.log("loss", loss, on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.001)


def train_func(config):
    # Data
    train_data = synthetic_fashion_mnist(config["samples"])
    train_dataloader = DataLoader(train_data, batch_size=config["batch_size"], shuffle=True)

    # Training
    model = ImageClassifier(small=config["smoke_test"])
    # [1] Configure PyTorch Lightning Trainer.
    trainer = pl.Trainer(
        max_epochs=config["max_epochs"],
        devices="auto",
        accelerator="auto",
        strategy=ray.train.lightning.RayDDPStrategy(),
        plugins=[ray.train.lightning.RayLightningEnvironment()],
        callbacks=[ray.train.lightning.RayTrainReportCallback()],
        # [1a] Optionally, disable the default checkpointing behavior
        # in favor of the `RayTrainReportCallback` above.
        enable_checkpointing=False,
        enable_progress_bar=not config["smoke_test"],
        enable_model_summary=not config["smoke_test"],
        logger=not config["smoke_test"],
    )
    trainer = ray.train.lightning.prepare_trainer(trainer)
    trainer.fit(model, train_dataloaders=train_dataloader)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="a small model and data set, 3 epochs")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--name", default=None)
    parser.add_argument("--storage-path", default=None)
    parser.add_argument("--epochs", type=int, default=None)
    args = parser.parse_args()
    # TorchTrainer.fit() would start Ray as it is; a local one here skips the dashboard (seconds on a small machine)
    ray.init(address=args.address or "local", include_dashboard=False)
    # The smoke test's 256 samples give each of 2 ranks 8 steps an epoch: the batch norms' running statistics (what
    # the loaded model uses in eval mode) need ~20 steps to settle; after 6, its accuracy ranged 0.25-0.95.
    config = {"smoke_test": args.smoke_test, "samples": 256 if args.smoke_test else 60000,
              "batch_size": 16 if args.smoke_test else 128, "max_epochs": args.epochs or (3 if args.smoke_test else 10)}

    # [2] Configure scaling and resource requirements.
    scaling_config = ray.train.ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu)

    # [3] Launch distributed training job.
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=scaling_config,
        # [3a] If running in a multi-node cluster, this is where you
        # should configure the run's persistent storage that is accessible
        # across all worker nodes.
        run_config=ray.train.RunConfig(name=args.name, storage_path=args.storage_path),
    )
    result: ray.train.Result = trainer.fit()
    print("metrics:", result.metrics)
    print("checkpoint:", result.checkpoint)

    # [4] Load the trained model.
    with result.checkpoint.as_directory() as checkpoint_dir:
        model = ImageClassifier.load_from_checkpoint(
            os.path.join(
                checkpoint_dir,
                ray.train.lightning.RayTrainReportCallback.CHECKPOINT_NAME,
            ),
        )
    images, labels = synthetic_fashion_mnist(config["samples"]).tensors
    model.eval()
    with torch.no_grad():
        accuracy = (model(images.to(model.device)).argmax(dim=1).cpu() == labels).float().mean().item()
    print(f"loaded model: accuracy {accuracy:.3f} on the training data")


if __name__ == "__main__":
    main()
