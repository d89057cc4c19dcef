"""The Ray Train PyTorch guide's script (FashionMNIST, ResNet18), run on raysgd.train: unchanged but for the data.

The guide ("Get Started with Distributed Training using PyTorch") trains torchvision's ResNet18 on FashionMNIST.
Here the images are synthetic (random 1x28x28 tensors and labels: no download) and the ResNet is raysgd's own
(:mod:`raysgd.torch.resnet`, torchvision not needed), with the guide's 1-channel ``conv1``; the rest is the guide's
code with its ``ray.train`` imports, plus the resume from ``ray.train.get_checkpoint()`` of its checkpointing guide.
Run it on raysgd (``ray.train`` mapped to ``raysgd.train``)::

    python -m raysgd.legacy --train examples/ray_train_guide.py --smoke-test

or on Ray Train itself (``python examples/ray_train_guide.py``). Re-running with the same ``--name`` and
``--storage-path`` resumes from the latest reported checkpoint. ``--pause-after-epoch N`` (for the driver-crash
test) makes rank 0 wait after reporting epoch ``N`` of a fresh run, so the driver can be killed there.
"""
import argparse
import os
import tempfile
import time

import torch
from torch.nn import CrossEntropyLoss
from torch.optim import Adam
from torch.utils.data import DataLoader, TensorDataset

import ray.train.torch
from raysgd.torch.resnet import BasicBlock, ResNet, ResNet18


def synthetic_fashion_mnist(size):
    """FashionMNIST's shapes (1x28x28 images, 10 classes), random but seeded: the same on every worker."""
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(size, 1, 28, 28, generator=generator),
                         torch.randint(0, 10, (size,), generator=generator))


def train_func(config):
    # Model, Loss, Optimizer
    model = ResNet18({"num_classes": 10}) if not config["smoke_test"] else ResNet(BasicBlock, [1, 1, 1, 1])
    model.conv1 = torch.nn.Conv2d(
        1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
    )
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:  # resume (the checkpointing guide's pattern)
        with checkpoint.as_directory() as checkpoint_dir:
            state = torch.load(os.path.join(checkpoint_dir, "model.pt"))
            model.load_state_dict(state["model"])
            start_epoch = state["epoch"] + 1
    # [1] Prepare model.
    model = ray.train.torch.prepare_model(model)
    # model.to("cuda")  # This is done by `prepare_model`
    criterion = CrossEntropyLoss()
    optimizer = Adam(model.parameters(), lr=0.001)

    # Data
    train_data = synthetic_fashion_mnist(config["samples"])
    train_loader = DataLoader(train_data, batch_size=config["batch_size"], shuffle=True)
    # [2] Prepare dataloader.
    train_loader = ray.train.torch.prepare_data_loader(train_loader)

    # Training
    for epoch in range(start_epoch, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)

        for images, labels in train_loader:
            # This is done by `prepare_data_loader`!
            # images, labels = images.to("cuda"), labels.to("cuda")
            outputs = model(images)
            loss = criterion(outputs, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        # [3] Report metrics and checkpoint.
        metrics = {"loss": loss.item(), "epoch": epoch, "resumed_from": start_epoch}
        with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
            torch.save(
                {"model": model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
                 "epoch": epoch},
                os.path.join(temp_checkpoint_dir, "model.pt")
            )
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(temp_checkpoint_dir),
            )
        if ray.train.get_context().get_world_rank() == 0:
            print(metrics)
            if epoch == config["pause_after_epoch"] and start_epoch == 0:
                time.sleep(120)  # the driver-crash test kills the driver here


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="a small model and data set, 2 epochs")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--name", default=None)
    parser.add_argument("--storage-path", default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--pause-after-epoch", type=int, default=None)
    args = parser.parse_args()
    config = {"smoke_test": args.smoke_test, "samples": 64 if args.smoke_test else 60000,
              "batch_size": 16 if args.smoke_test else 128, "epochs": args.epochs or (2 if args.smoke_test else 10),
              "pause_after_epoch": args.pause_after_epoch}
    if args.address:  # else the trainer starts a local cluster (or joins $RAY_ADDRESS)
        ray.init(address=args.address)

    # [4] Configure scaling and resource requirements.
    scaling_config = ray.train.ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu)

    # [5] Launch distributed training job.
    trainer = ray.train.torch.TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=scaling_config,
        run_config=ray.train.RunConfig(name=args.name, storage_path=args.storage_path),
    )
    result = trainer.fit()
    print("metrics:", result.metrics)
    print("checkpoint:", result.checkpoint)

    # [6] Load the trained model.
    with result.checkpoint.as_directory() as checkpoint_dir:
        model_state_dict = torch.load(os.path.join(checkpoint_dir, "model.pt"))["model"]
        model = ResNet18({"num_classes": 10}) if not args.smoke_test else ResNet(BasicBlock, [1, 1, 1, 1])
        model.conv1 = torch.nn.Conv2d(
            1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False
        )
        model.load_state_dict(model_state_dict)


if __name__ == "__main__":
    main()
