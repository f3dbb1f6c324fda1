#!/usr/bin/env python3
"""The Python side of bench/gpu.cpp: the same models, data, optimizer and
precision in a plain PyTorch loop (each batch moved with .to(device)) and in
PyTorch Lightning (when importable), µs per step over --steps steps after
--warmup, the two interleaved (order rotating), medians over --reps.
Prints one JSON object per model and, with --markdown FILE, writes a table.

    python3 bench/gpu.py [--steps 200] [--warmup 20] [--reps 2] [--markdown F]
"""
import argparse
import json
import time

import torch
from torch import nn

DISTINCT = 16


def mlp(widths):
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def small_cnn():
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 5 * 5, 128),
                         nn.ReLU(), nn.Linear(128, 10))


def main_cnn():
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.25),
                         nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


MODELS = {
    "mlp": (64, (784,), "32-true", lambda: mlp([784, 256, 10])),
    "cnn": (64, (1, 28, 28), "32-true", small_cnn),
    "cnn_bf16": (64, (1, 28, 28), "bf16-mixed", small_cnn),
    "cnn_fp16": (64, (1, 28, 28), "16-mixed", small_cnn),
    "mlp4096_bf16": (512, (4096,), "bf16-mixed", lambda: mlp([4096] * 5 + [10])),
    "main_cnn": (64, (1, 28, 28), "32-true", main_cnn),
}


def batches(batch, shape):
    torch.manual_seed(0)
    return [(torch.randn(batch, *shape), torch.randint(0, 10, (batch,)))
            for _ in range(DISTINCT)]


def plain_loop(spec, data, warmup, steps):
    _, _, precision, make = spec
    torch.manual_seed(1)
    net = make().cuda().train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    # 16-mixed: PyTorch's GradScaler, which reads its inf check each step.
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "16-mixed")
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = data[i % DISTINCT]
        x, y = x.cuda(), y.cuda()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=precision != "32-true"):
            loss = nn.functional.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / steps


def lightning_fit(spec, data, warmup, steps):
    import lightning.pytorch as pl  # noqa: deferred: optional

    _, _, precision, make = spec

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.net = make()

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Timer(pl.Callback):
        us = 0.0

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == warmup:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            if trainer.global_step == warmup + steps:
                torch.cuda.synchronize()
                self.us = (time.perf_counter() - self.start) * 1e6 / steps

    class Cycled(torch.utils.data.Dataset):
        def __len__(self):
            return (warmup + steps) * DISTINCT

        def __getitem__(self, i):
            return i

    def collate(indices):
        return data[(indices[0] // len(indices)) % DISTINCT]

    batch = spec[0]
    loader = torch.utils.data.DataLoader(Cycled(), batch_size=batch, collate_fn=collate,
                                         pin_memory=True)
    timer = Timer()
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=warmup + steps,
                         precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer], num_sanity_val_steps=0)
    trainer.fit(Module(), loader)
    return timer.us


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    try:
        import lightning.pytorch  # noqa: F401
        variants = ["pytorch", "lightning"]
    except ImportError:
        variants = ["pytorch"]
    rows = []
    for name in args.models.split(","):
        spec = MODELS[name]
        data = batches(spec[0], spec[1])
        us = {v: [] for v in variants}
        for rep in range(args.reps):
            for k in range(len(variants)):
                v = variants[(k + rep) % len(variants)]
                run = plain_loop if v == "pytorch" else lightning_fit
                us[v].append(run(spec, data, args.warmup, args.steps))
        med = {v: sorted(x)[len(x) // 2] if len(x) % 2 else sum(sorted(x)[len(x) // 2 - 1:
               len(x) // 2 + 1]) / 2 for v, x in us.items()}
        print(json.dumps({"model": name, **{f"{v}_us": round(m, 1) for v, m in med.items()}}),
              flush=True)
        rows.append((name, med))
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(f"| model | plain PyTorch loop (batch copied) | PyTorch Lightning |\n"
                      f"|---|---|---|\n")
            for name, med in rows:
                lightning_us = f"{med['lightning']:.0f}" if "lightning" in med else "n/a"
                out.write(f"| {name} | {med['pytorch']:.0f} | {lightning_us} |\n")


if __name__ == "__main__":
    main()
