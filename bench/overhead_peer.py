"""The tiny-MLP step of bench/overhead.cpp in plain PyTorch (Python, Debian's
python3-torch): 784-256-10 MLP, batch 64, SGD, one intra-op thread, data in
memory, the batch gathered with index_select as a loader does. Prints one JSON
object: microseconds per step, the first step excluded, median over reps.

    python3 bench/overhead_peer.py --steps 2000 --reps 5
"""
import argparse
import json
import statistics
import time

import torch


def run(steps, batch):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                              torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    torch.manual_seed(1)
    samples = min(steps, 500) * batch
    x = torch.randn(samples, 1, 28, 28)
    y = torch.randint(0, 10, (samples,))
    batches = samples // batch
    start = time.perf_counter()
    for s in range(steps):
        b = s % batches
        index = torch.arange(b * batch, (b + 1) * batch)
        loss = torch.nn.functional.cross_entropy(net(x.index_select(0, index)),
                                                 y.index_select(0, index))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) * 1e6 / (steps - 1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    us = statistics.median(run(a.steps, a.batch) for _ in range(a.reps))
    print(json.dumps({"benchmark": "python_step_mlp", "steps": a.steps, "reps": a.reps,
                      "python_us_per_step": round(us, 2)}))


if __name__ == "__main__":
    main()
