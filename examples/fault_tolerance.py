"""Fault tolerance: a worker is killed in the middle of an epoch and training carries on.

The driver kills one worker actor (as a preempted node would lose it) halfway through epoch 2. The
trainer ends the attempt at once, restarts the workers from the state saved at the start of that
train() call, and retries the epoch: train() still returns the whole epoch's metrics.

    python examples/fault_tolerance.py --smoke-test
"""
import argparse
import threading
import time

import ray
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from raysgd import TorchTrainer, TrainingOperator
from raysgd.torch.examples.train_example import LinearDataset


class SlowLinearOperator(TrainingOperator):
    def setup(self, config):
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.MSELoss())
        self.register_data(train_loader=DataLoader(LinearDataset(2, 5, size=config["size"]), batch_size=16),
                           validation_loader=DataLoader(LinearDataset(2, 5, size=200), batch_size=16))

    def train_batch(self, batch, batch_info):
        time.sleep(self.config["batch_sleep"])  # stands in for real work, so the kill lands mid-epoch
        return super().train_batch(batch, batch_info)


def kill_later(trainer, delay_s):
    victim = trainer.worker_group.remote_workers[-1]

    def kill():
        time.sleep(delay_s)
        print(f"--> killing a worker {delay_s:.1f} s into the epoch")
        ray.kill(victim)

    threading.Thread(target=kill, daemon=True).start()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray address (default: start a local cluster)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--num-epochs", type=int, default=4)
    parser.add_argument("--smoke-test", action="store_true")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(address="local", num_cpus=max(2, args.num_workers), include_dashboard=False)
    size, batch_sleep = (320, 0.02) if args.smoke_test else (3200, 0.01)
    trainer = TorchTrainer(training_operator_cls=SlowLinearOperator, num_workers=args.num_workers, timeout_s=30,
                           use_gpu=args.use_gpu, config={"size": size, "batch_sleep": batch_sleep})
    for epoch in range(1, args.num_epochs + 1):
        if epoch == 2:
            kill_later(trainer, delay_s=0.2)
        start = time.monotonic()
        stats = trainer.train(max_retries=3)
        print(f"epoch {epoch}: {stats['num_samples']} samples, train_loss {stats['train_loss']:.3f}, "
              f"{time.monotonic() - start:.1f} s, workers now {trainer.worker_group.num_workers}, "
              f"failures so far {trainer.num_failures}")
    assert trainer.num_failures == 1, "the injected failure should have been recovered exactly once"
    print("validation:", {k: round(v, 4) for k, v in trainer.validate().items()})
    trainer.shutdown()


if __name__ == "__main__":
    main()
