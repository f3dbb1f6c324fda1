"""Sharded data parallel benchmark: ddp, fsdp_shard_grad_op and fsdp on the
same MLP (Adam, fp32, 2 ranks), run interleaved (ddp, grad_op, fsdp, ddp,
...), medians. Per strategy one JSON object: samples/s and its ratio to
ddp's, the model-state bytes a rank holds after an optimizer step (counted
from the tensors) against the ZeRO formula (16 bytes per parameter P under
DDP: 16P; SHARD_GRAD_OP: 4P + 12P/N; FULL_SHARD: 16P/N), the most
full-parameter bytes held at once, and the peak RSS of rank 0.

    python3 bench/fsdp.py --build build --reps 3 --width 4096 --layers 3
"""
import argparse
import json
import os
import statistics
import subprocess

STRATEGIES = ["ddp", "fsdp_shard_grad_op", "fsdp"]


def run(exe, strategy, a):
    out = subprocess.run([exe, "--strategy", strategy, "--width", str(a.width), "--layers",
                          str(a.layers), "--steps", str(a.steps), "--warmup", str(a.warmup),
                          "--batch", str(a.batch)],
                         check=True, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith('{"benchmark": "fsdp_mlp"'):
            return json.loads(line)
    raise SystemExit("fsdp: no result from %s in:\n%s\n%s" % (strategy, out.stdout, out.stderr))


def formula(strategy, p, n):
    if strategy == "ddp":
        return 16 * p
    if strategy == "fsdp_shard_grad_op":
        return 4 * p + 12 * p / n
    return 16 * p / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    exe = os.path.join(a.build, "bench", "fulgur_bench_fsdp")
    runs = {s: [] for s in STRATEGIES}
    for _ in range(a.reps):
        for s in STRATEGIES:
            runs[s].append(run(exe, s, a))
    ddp_rate = statistics.median(r["samples_per_s"] for r in runs["ddp"])
    for s in STRATEGIES:
        last = runs[s][-1]
        p, n = last["parameters"], last["world_size"]
        rate = statistics.median(r["samples_per_s"] for r in runs[s])
        f = formula(s, p, n)
        unit = 4 * (a.width * a.width + a.width)  # one layer's full parameters
        print(json.dumps({
            "benchmark": "fsdp_mlp", "strategy": s, "world_size": n, "parameters": p,
            "width": a.width, "layers": a.layers, "batch_per_rank": a.batch,
            "samples_per_s": round(rate, 2), "vs_ddp": round(rate / ddp_rate, 3),
            "state_mb": round(last["state_bytes"] / 1e6, 1),
            "parameter_mb": round(last["parameter_bytes"] / 1e6, 1),
            "shard_mb": round(last["shard_bytes"] / 1e6, 1),
            "gradient_mb": round(last["gradient_bytes"] / 1e6, 1),
            "optimizer_state_mb": round(last["optimizer_state_bytes"] / 1e6, 1),
            "formula_mb": round(f / 1e6, 1),
            "state_over_formula": round(last["state_bytes"] / f, 3),
            "peak_parameter_mb": round(last["peak_parameter_bytes"] / 1e6, 1),
            "unit_mb": round(unit / 1e6, 1),
            "peak_rss_mb": round(max(r["peak_rss_bytes"] for r in runs[s]) / 1e6, 1),
            "reps": len(runs[s])}))


if __name__ == "__main__":
    main()
