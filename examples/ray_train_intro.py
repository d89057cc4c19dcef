"""The Ray Train introduction's distributed part (MNIST, ResNet18, Ray Data), run on raysgd.train.

The introduction ("Introduction to Ray Train") writes MNIST to Parquet, reads it back with Ray Data and a per-row
transform, and trains torchvision's ResNet18 (1-channel ``conv1``) with ``train_loop_per_worker``:
``prepare_model``, ``get_dataset_shard("train").iter_torch_batches(...)``, and a rank-0 checkpoint reported by
every rank (``save_checkpoint_and_report_metrics``), under ``RunConfig(name, storage_path,
failure_config=FailureConfig(max_failures=3))``; then it loads ``result.checkpoint``'s ``model.pt``. That is this
script, with its ``ray.train`` imports. What changed, and why:

- **No download**: the images are synthetic uint8 28x28 arrays (a pattern per digit under noise, seeded), written
  to Parquet as the guide writes MNIST (an ``image`` column of nested lists and a ``label`` column).
- **No torchvision or PIL** (torchvision may not import): ``ToTensor`` + ``Normalize((0.5,), (0.5,))`` is the same
  arithmetic in numpy (``(x / 255 - 0.5) / 0.5``, shape 1x28x28); the ResNet is raysgd's own
  (:mod:`raysgd.torch.resnet`; one block per stage with ``--smoke-test``).
- **No GPU and no accelerator resource**: ``ScalingConfig(num_workers=2, use_gpu=args.use_gpu)``.
- **CPUs for Ray Data**: Ray Data's read and map tasks need CPUs beside the workers'. Without ``--address`` the
  script starts a local Ray with ``num_workers + 2`` CPUs (at least the machine's), so 2 workers leave 2 for them.
- **Resume**: the guide asks the loop to load the latest checkpoint (section 6); the loop does, from
  ``ray.train.get_checkpoint()`` (``model.pt`` as the guide saves it, plus ``train_state.pt``: the epoch and the
  optimizer). Running the script again with the same ``--name`` and ``--storage-path`` continues after the last
  reported epoch. The guide's mid-epoch resumption of Ray Data iterators (Anyscale's) is left out: Ray Data shards
  restart their epoch (raysgd's exactly-once cursor is ``prepare_data_loader``'s, see ``ray_train_guide.py``).
- **Left out**: the plots, the single-GPU Ray task, the dashboards.

Run it on raysgd (``ray.train`` mapped to ``raysgd.train``)::

    python -m raysgd.legacy --train examples/ray_train_intro.py --smoke-test
"""
import argparse
import datetime
import os
import tempfile

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.optim as optim

import ray
import ray.data
import ray.train
import ray.train.torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from raysgd.torch.resnet import BasicBlock, ResNet, ResNet18


def resnet18(num_classes, small=False):
    """raysgd's ResNet18 in place of torchvision's (``small``: one block per stage, for the smoke test)."""
    return ResNet18({"num_classes": num_classes}) if not small else ResNet(BasicBlock, [1, 1, 1, 1])


def build_model(small=False) -> nn.Module:
    model = resnet18(num_classes=10, small=small)
    model.conv1 = nn.Conv2d(
        in_channels=1,
        out_channels=64,
        kernel_size=(7, 7),
        stride=(2, 2),
        padding=(3, 3),
        bias=False,
    )
    return model


def synthetic_mnist(size):
    """MNIST's ``data`` (uint8, 28x28) and ``targets``: a pattern per digit under noise, seeded."""
    generator = np.random.default_rng(0)
    patterns = generator.uniform(0, 255, (10, 28, 28))
    targets = generator.integers(0, 10, size)
    data = np.clip(0.5 * patterns[targets] + generator.normal(64, 32, (size, 28, 28)), 0, 255).astype(np.uint8)
    return data, targets


def write_train_data(path, size):
    """The guide's "Preparing the Dataset": the images and labels to Parquet with Ray Data."""
    data, targets = synthetic_mnist(size)
    df = pd.DataFrame({
        "image": data.tolist(),
        "label": targets
    })
    ds = ray.data.from_pandas(df)
    ds.write_parquet(path)


def get_ray_dataset(path: str) -> ray.data.Dataset:
    ds = ray.data.read_parquet(path, file_extensions=["parquet"])

    def transform_images(row: dict) -> dict:
        image_arr = np.array(row["image"], dtype=np.uint8)
        # ToTensor() and Normalize((0.5,), (0.5,)), without torchvision
        row["image"] = ((image_arr.astype(np.float32) / 255.0 - 0.5) / 0.5)[None]
        return row

    # Apply the transform on-the-fly
    return ds.map(transform_images)


def save_checkpoint_and_report_metrics(
    model: torch.nn.Module, metrics: dict[str, float], optimizer: optim.Optimizer
) -> None:
    with tempfile.TemporaryDirectory() as temp_checkpoint_dir:
        checkpoint = None

        # Checkpoint only from rank 0 worker
        if ray.train.get_context().get_world_rank() == 0:
            # Access the original model via `model.module` when wrapped in DistributedDataParallel
            module = model.module if hasattr(model, "module") else model
            torch.save(
                module.state_dict(), os.path.join(temp_checkpoint_dir, "model.pt")
            )
            torch.save(  # to resume: the epoch and the optimizer
                {"epoch": metrics["epoch"], "optimizer": optimizer.state_dict()},
                os.path.join(temp_checkpoint_dir, "train_state.pt"),
            )
            checkpoint = ray.train.Checkpoint.from_directory(temp_checkpoint_dir)

        # All workers must call report to synchronize
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
        )


def train_loop_per_worker(config: dict) -> None:
    # 1. Setup Model
    model = build_model(small=config["small"])
    start_epoch, train_state = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:  # a restart, or the script run again with the same name and storage_path
        with checkpoint.as_directory() as checkpoint_dir:
            model.load_state_dict(torch.load(os.path.join(checkpoint_dir, "model.pt"), map_location="cpu"))
            train_state = torch.load(os.path.join(checkpoint_dir, "train_state.pt"), map_location="cpu")
        start_epoch = train_state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)  # Instead of model = model.to("cuda")

    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(model.parameters(), lr=config["lr"])
    if train_state is not None:
        optimizer.load_state_dict(train_state["optimizer"])

    # 2. Calculate Batch Size
    global_batch_size = config["batch_size"]
    world_size = ray.train.get_context().get_world_size()
    per_worker_batch_size = global_batch_size // world_size

    # 3. Setup Data (Ray Data)
    # Get the data shard for this worker and create an iterator
    dataset_shard = ray.train.get_dataset_shard("train")
    dataloader = dataset_shard.iter_torch_batches(
        batch_size=per_worker_batch_size,
        dtypes={"image": torch.float32, "label": torch.long},
        device=ray.train.torch.get_device()  # Auto-move to GPU
    )

    for epoch in range(start_epoch, config["epochs"]):
        for batch in dataloader:
            # Note: Batches are dictionaries (from Ray Data), not tuples
            inputs, labels = batch["image"], batch["label"]

            outputs = model(inputs)
            loss = criterion(outputs, labels)

            optimizer.zero_grad()
            loss.backward()  # gradients are accumulated across workers
            optimizer.step()

        # 4. Report Metrics & Checkpoint
        metrics = {"loss": loss.item(), "epoch": epoch, "start_epoch": start_epoch}
        save_checkpoint_and_report_metrics(model, metrics, optimizer)
        if ray.train.get_context().get_world_rank() == 0:
            print(metrics)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-test", action="store_true", help="a small model and data set, 2 epochs")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--name", default=None, help="the run's name (default: mnist_ray_train_demo_<time>)")
    parser.add_argument("--storage-path", default=None,
                        help="where the data and the run go (default: a new temporary folder)")
    parser.add_argument("--epochs", type=int, default=None)
    args = parser.parse_args()
    storage_path = os.path.abspath(args.storage_path or tempfile.mkdtemp(prefix="ray-train-intro-"))
    samples = 256 if args.smoke_test else 60000
    if args.address:
        ray.init(address=args.address)
    else:  # Ray Data's tasks need CPUs beside the workers'
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.num_workers + 2), include_dashboard=False)

    mnist_path = os.path.join(storage_path, "train_data")  # must be shared storage in multi-node clusters
    if not os.path.exists(mnist_path):
        write_train_data(mnist_path, samples)
    train_ds = get_ray_dataset(mnist_path)

    scaling_config = ScalingConfig(
        num_workers=args.num_workers,
        use_gpu=args.use_gpu,
    )

    run_config = RunConfig(
        name=args.name or f"mnist_ray_train_demo_{datetime.datetime.now().strftime('%Y%m%d_%H%M%S')}",
        storage_path=os.path.join(storage_path, "distributed_training"),
        failure_config=FailureConfig(max_failures=3),
    )

    trainer = TorchTrainer(
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config={"lr": 1e-3 if args.smoke_test else 1e-5, "batch_size": 32 if args.smoke_test else 128,
                           "epochs": args.epochs or 2, "small": args.smoke_test},
        scaling_config=scaling_config,
        run_config=run_config,
        datasets={"train": train_ds},
    )

    result = trainer.fit()

    print(f"Training finished. Result: {result}")

    if result.checkpoint:
        with result.checkpoint.as_directory() as ckpt_dir:
            model_path = os.path.join(ckpt_dir, "model.pt")
            print(f"Checkpoint saved at: {model_path}")

            # Load the model state dict
            loaded_model = build_model(small=args.smoke_test)
            state_dict = torch.load(model_path, map_location="cpu")
            loaded_model.load_state_dict(state_dict)
            loaded_model.eval()

        # Predictions on the first 10 training images (the guide plots them with the test set's)
        data, targets = synthetic_mnist(samples)
        images = torch.from_numpy((data[:10].astype(np.float32) / 255.0 - 0.5) / 0.5).unsqueeze(1)
        with torch.no_grad():
            predictions = loaded_model(images).argmax(dim=1).tolist()
        print(f"Pred: {predictions}\nTrue: {targets[:10].tolist()}")


if __name__ == "__main__":
    main()
