"""The 1.x CIFAR-10 example: a ResNet trained with SGD, momentum and a step schedule on Ray workers.

Data: the real CIFAR-10 files when ``data_dir`` holds them (the ``cifar-10-batches-py`` folder of
the python version, or its parent: nothing is downloaded), else CIFAR-shaped synthetic images
(3x32x32, 10 classes, 50,000 + 10,000 by default) with a learnable class structure, so the
example runs anywhere. Augmentation (4-pixel padded random crop, horizontal flip) is done with
torch ops: torchvision is not needed.

Run it: ``python -m raysgd.torch.examples.cifar_pytorch_example --num-workers 2 --smoke-test``.

Example:
    >>> train, val = load_cifar10(None, synthetic_sizes=(64, 32))
    >>> len(train), train[0][0].shape
    (64, torch.Size([3, 32, 32]))
"""
import argparse
import logging
import os
import pickle

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, Subset

from raysgd.torch import TorchTrainer, TrainingOperator
from raysgd.torch import resnet
from raysgd.utils import BATCH_SIZE

logger = logging.getLogger(__name__)

#: Per-channel mean and standard deviation of the CIFAR-10 training images.
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
MODELS = {"resnet18": resnet.ResNet18, "resnet34": resnet.ResNet34, "resnet50": resnet.ResNet50}


class CifarDataset(Dataset):
    """uint8 images (N, 3, 32, 32) and labels, normalised per channel, augmented when ``train``.

    Example:
        >>> ds = CifarDataset(np.zeros((2, 3, 32, 32), dtype=np.uint8), [3, 5], train=True)
        >>> image, label = ds[1]
        >>> tuple(image.shape), int(label)
        ((3, 32, 32), 5)
    """

    def __init__(self, images, labels, train=False):
        if images.ndim != 4 or images.shape[1:] != (3, 32, 32) or images.dtype != np.uint8:
            raise ValueError(f"CifarDataset expects uint8 images of shape (N, 3, 32, 32); "
                             f"got {images.dtype} {images.shape}")
        self.images = torch.from_numpy(images)
        self.labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
        self.train = train
        self._mean = torch.tensor(CIFAR_MEAN).view(3, 1, 1)
        self._std = torch.tensor(CIFAR_STD).view(3, 1, 1)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].float().div_(255)
        if self.train:
            padded = nn.functional.pad(image, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = padded[:, top:top + 32, left:left + 32]
            if torch.rand(()) < 0.5:
                image = image.flip(2)
        return (image - self._mean) / self._std, self.labels[index]


def _find_batches(data_dir):
    for candidate in (data_dir, os.path.join(data_dir, "cifar-10-batches-py")):
        if os.path.exists(os.path.join(candidate, "data_batch_1")):
            return candidate
    raise FileNotFoundError(f"load_cifar10(data_dir=...) expects the CIFAR-10 python files (data_batch_1 ... "
                            f"data_batch_5, test_batch) in {data_dir!r} or its cifar-10-batches-py folder; "
                            "found none (nothing is downloaded: get cifar-10-python.tar.gz and unpack it)")


def _read_batch(path):
    with open(path, "rb") as handle:
        entry = pickle.load(handle, encoding="bytes")  # the official files are pickles: read only trusted ones
    data = np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return data, np.asarray(entry[b"labels"], dtype=np.int64)


def synthetic_cifar(num_images, seed=0, num_classes=10):
    """``(images, labels)``: CIFAR-shaped uint8 images, each a noisy copy of a smooth per-class template.

    The templates come from a fixed seed, so every worker (and every call) builds the same data set.

    Example:
        >>> images, labels = synthetic_cifar(8)
        >>> images.shape, images.dtype, labels[:4].tolist()
        ((8, 3, 32, 32), dtype('uint8'), [0, 1, 2, 3])
    """
    templates_rng = np.random.default_rng(12345)
    coarse = templates_rng.uniform(40, 215, size=(num_classes, 3, 4, 4))
    templates = coarse.repeat(8, axis=2).repeat(8, axis=3)  # 4x4 colour blocks, upsampled to 32x32
    rng = np.random.default_rng(seed)
    labels = np.arange(num_images) % num_classes
    images = np.empty((num_images, 3, 32, 32), dtype=np.uint8)
    for start in range(0, num_images, 4096):  # in chunks: a float copy of 50,000 images would take 1.2 GB
        stop = min(start + 4096, num_images)
        noise = rng.normal(0, 60, size=(stop - start, 3, 32, 32))
        images[start:stop] = np.clip(templates[labels[start:stop]] + noise, 0, 255).astype(np.uint8)
    return images, labels


def load_cifar10(data_dir, synthetic_sizes=(50000, 10000)):
    """``(train_set, validation_set)``: real CIFAR-10 from ``data_dir``, or synthetic when it is None.

    Example:
        >>> train, val = load_cifar10(None, synthetic_sizes=(100, 20))
        >>> len(train), len(val)
        (100, 20)
    """
    if data_dir is None:
        train_images, train_labels = synthetic_cifar(synthetic_sizes[0], seed=0)
        val_images, val_labels = synthetic_cifar(synthetic_sizes[1], seed=1)
    else:
        folder = _find_batches(os.path.expanduser(data_dir))
        parts = [_read_batch(os.path.join(folder, f"data_batch_{i}")) for i in range(1, 6)]
        train_images = np.concatenate([p[0] for p in parts])
        train_labels = np.concatenate([p[1] for p in parts])
        val_images, val_labels = _read_batch(os.path.join(folder, "test_batch"))
    return CifarDataset(train_images, train_labels, train=True), CifarDataset(val_images, val_labels)


class CifarTrainingOperator(TrainingOperator):
    """ResNet, SGD with momentum and weight decay, a MultiStepLR schedule, cross-entropy; CIFAR-10 loaders.

    Config keys: ``lr`` (0.1), ``momentum`` (0.9), ``weight_decay`` (5e-4; 1.12 had none), ``model``
    ("resnet18"), ``num_epochs`` (for the schedule), ``data_dir`` (None: synthetic), ``synthetic_sizes``
    ((50000, 10000)), ``test_mode`` (64 images), ``BATCH_SIZE`` (the global batch; 128 per worker without it).

    Example:
        >>> trainer = TorchTrainer(training_operator_cls=CifarTrainingOperator, num_workers=2,  # doctest: +SKIP
        ...                        scheduler_step_freq="epoch", config={"test_mode": True, BATCH_SIZE: 64})
    """

    def setup(self, config):
        torch.manual_seed(config.get("seed", 0))
        model_name = config.get("model", "resnet18")
        if model_name not in MODELS:
            raise ValueError(f"config['model'] expects one of {sorted(MODELS)}; got {model_name!r}")
        model = MODELS[model_name](config)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=config.get("momentum", 0.9),
                                    weight_decay=config.get("weight_decay", 5e-4))
        num_epochs = config.get("num_epochs", 5)
        scheduler = torch.optim.lr_scheduler.MultiStepLR(
            optimizer, milestones=[max(1, int(num_epochs * f)) for f in (0.5, 0.75)], gamma=0.1)
        self.model, self.optimizer, self.criterion, self.scheduler = self.register(
            models=model, optimizers=optimizer, criterion=nn.CrossEntropyLoss(), schedulers=scheduler)
        sizes = (64, 64) if config.get("test_mode") else config.get("synthetic_sizes", (50000, 10000))
        train_set, val_set = load_cifar10(config.get("data_dir"), synthetic_sizes=sizes)
        if config.get("test_mode"):
            train_set, val_set = Subset(train_set, range(min(64, len(train_set)))), \
                Subset(val_set, range(min(64, len(val_set))))
        batch_size = config.get(BATCH_SIZE, 128)
        self.register_data(train_loader=DataLoader(train_set, batch_size=batch_size, shuffle=True),
                           validation_loader=DataLoader(val_set, batch_size=batch_size))


def train_cifar(test_mode=False, num_workers=1, use_gpu=False, num_epochs=5, fp16=False, data_dir=None,
                model="resnet18", batch_size_per_worker=128, lr=0.1, use_tqdm=False, synthetic_sizes=(50000, 10000)):
    """Train ``num_epochs`` epochs, validating after each; returns the last ``{**train, **validate}`` stats.

    The global batch size is ``batch_size_per_worker * num_workers`` (``BATCH_SIZE``), as in 1.x.

    Example:
        >>> stats = train_cifar(test_mode=True, num_workers=2, num_epochs=1)  # doctest: +SKIP
        >>> stats["val_accuracy"]  # doctest: +SKIP
    """
    trainer = TorchTrainer(
        training_operator_cls=CifarTrainingOperator, num_workers=num_workers, use_gpu=use_gpu, use_fp16=fp16,
        use_tqdm=use_tqdm, scheduler_step_freq="epoch",
        config={"lr": lr, "model": model, "num_epochs": num_epochs, "data_dir": data_dir, "test_mode": test_mode,
                "synthetic_sizes": tuple(synthetic_sizes), BATCH_SIZE: batch_size_per_worker * num_workers})
    stats = {}
    try:
        for epoch in range(num_epochs):
            train_stats = trainer.train(max_retries=1, info={"epoch_idx": epoch, "num_epochs": num_epochs})
            val_stats = trainer.validate()
            stats = {**train_stats, **val_stats}
            logger.info("epoch %d/%d: train_loss %.4f val_loss %.4f val_accuracy %.4f", epoch + 1, num_epochs,
                        train_stats["train_loss"], val_stats["val_loss"], val_stats["val_accuracy"])
    finally:
        trainer.shutdown()
    return stats


def main(argv=None):
    """The command line (see ``--help``).

    Example:
        >>> main(["--smoke-test", "--num-workers", "2"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description="RaySGD ResNet on CIFAR-10 (or CIFAR-shaped synthetic data)")
    parser.add_argument("--smoke-test", action="store_true", help="one epoch on 64 images")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", "-n", type=int, default=1)
    parser.add_argument("--num-epochs", type=int, default=5)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--fp16", default=False, const=True, nargs="?",
                        help="mixed precision: --fp16 (float16 on CUDA), --fp16 bf16, or --fp16 apex")
    parser.add_argument("--data-dir", default=None, help="folder with the CIFAR-10 python files (default: synthetic)")
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--batch-size-per-worker", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--use-tqdm", action="store_true", help="show a progress bar")
    parser.add_argument("--synthetic-sizes", type=int, nargs=2, default=(50000, 10000), metavar=("TRAIN", "VAL"),
                        help="synthetic data set sizes (without --data-dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import ray  # noqa: PLC0415

    ray.init(address=args.address or "local", include_dashboard=False)
    stats = train_cifar(test_mode=args.smoke_test, num_workers=args.num_workers, use_gpu=args.use_gpu,
                        num_epochs=1 if args.smoke_test else args.num_epochs, fp16=args.fp16, data_dir=args.data_dir,
                        model=args.model, batch_size_per_worker=args.batch_size_per_worker, lr=args.lr,
                        use_tqdm=args.use_tqdm, synthetic_sizes=args.synthetic_sizes)
    logger.info("final: %s", {k: round(v, 4) for k, v in stats.items() if isinstance(v, float)})
    ray.shutdown()
    return stats


if __name__ == "__main__":
    main()
