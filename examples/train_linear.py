"""Basic usage from the RaySGD user guide: linear regression with a custom TrainingOperator.

    python examples/train_linear.py --num-workers 2            # starts a local Ray cluster itself
    python examples/train_linear.py --address auto             # or joins a running cluster
    python examples/train_linear.py --smoke-test               # a few seconds
"""
import argparse

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from raysgd import TorchTrainer, TrainingOperator
from raysgd.torch.examples.train_example import LinearDataset
from raysgd.utils import BATCH_SIZE


class MyTrainingOperator(TrainingOperator):
    def setup(self, config):
        # Data: y = 2x + 5. BATCH_SIZE is the global batch size; config[BATCH_SIZE] is this worker's share.
        train_loader = DataLoader(LinearDataset(2, 5, size=config["data_size"]), batch_size=config[BATCH_SIZE],
                                  shuffle=True)
        val_loader = DataLoader(LinearDataset(2, 5, size=config["data_size"] // 5), batch_size=config[BATCH_SIZE])
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=config.get("lr", 1e-2))
        criterion = nn.MSELoss()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.9)
        # register() moves the model to the device and wraps it in DistributedDataParallel when distributed.
        self.model, self.optimizer, self.criterion, self.scheduler = self.register(
            models=model, optimizers=optimizer, criterion=criterion, schedulers=scheduler)
        self.register_data(train_loader=train_loader, validation_loader=val_loader)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--num-epochs", type=int, default=20)
    parser.add_argument("--address", default=None, help="Ray address (default: start a local cluster)")
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--smoke-test", action="store_true", help="tiny and quick")
    args = parser.parse_args()
    if args.address:
        import ray

        ray.init(address=args.address)
    epochs, size = (3, 200) if args.smoke_test else (args.num_epochs, 2000)
    trainer = TorchTrainer(training_operator_cls=MyTrainingOperator, num_workers=args.num_workers,
                           use_gpu=args.use_gpu, scheduler_step_freq="epoch",
                           config={"lr": 1e-2, BATCH_SIZE: 64, "data_size": size})
    for epoch in range(epochs):
        stats = trainer.train()
        val = trainer.validate()
        print(f"epoch {epoch + 1}: train_loss {stats['train_loss']:.4f}  val_loss {val['val_loss']:.4f}  "
              f"({stats['num_samples']} samples on {trainer.worker_group.num_workers} workers)")
    model = trainer.get_model(to_cpu=True)
    print(f"learned y = {model.weight.item():.3f} x + {model.bias.item():.3f} (true: y = 2 x + 5)")
    trainer.shutdown()


if __name__ == "__main__":
    main()
