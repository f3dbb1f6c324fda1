"""PyTorch's own DistributedDataParallel (Gloo) on the workload of bench/ddp.cpp:
the 784-1024-1024-10 MLP, batch 64 per rank, SGD, one intra-op thread per rank,
data in memory. Started by torchrun; global rank 0 prints one JSON line.

    torchrun --standalone --nproc_per_node 2 bench/ddp_peer.py --steps 200
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def bytes_sent_off_loopback():
    """Bytes this network namespace sent on interfaces other than lo."""
    total = 0
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, counters = line.split(":", 1)
            if name.strip() != "lo":
                total += int(counters.split()[8])
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 10))
    model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_mb)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    total = args.steps + args.warmup
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(total * args.batch * world, 784, generator=gen)
    y = torch.randint(0, 10, (total * args.batch * world,), generator=gen)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    for step in range(total):
        if step == args.warmup:
            start = time.perf_counter()
            sent_at_start = bytes_sent_off_loopback()
        lo = (step * world + rank) * args.batch
        idx = torch.arange(lo, lo + args.batch)
        bx, by = x.index_select(0, idx), y.index_select(0, idx)
        sgd.zero_grad()
        loss_fn(model(bx), by).backward()
        sgd.step()
    seconds = time.perf_counter() - start
    sent = bytes_sent_off_loopback() - sent_at_start
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if rank == 0:
        print(json.dumps({"benchmark": "ddp_mlp_784_1024_1024_10", "impl": "pytorch_ddp",
                          "world_size": world, "steps": args.steps,
                          "batch_per_rank": args.batch, "bucket_mb": args.bucket_mb,
                          "samples_per_s": round(args.steps * args.batch * world / seconds, 1),
                          "sent_bytes_per_step": round(sent / args.steps),
                          "gradient_bytes": grad_bytes}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
