"""Sharded data parallel benchmark: ddp, fsdp_shard_grad_op and fsdp (without
and with prefetch) on the same MLP (Adam, fp32, 2 ranks), run interleaved
(ddp, grad_op, grad_op with prefetch, fsdp, fsdp with prefetch, ddp, ...),
medians. Per strategy one JSON object: samples/s and its ratio to ddp's, the
model-state bytes a
rank holds after an optimizer step (counted from the tensors) against the
ZeRO formula (16 bytes per parameter P under
DDP: 16P; SHARD_GRAD_OP: 4P + 12P/N; FULL_SHARD: 16P/N), the most
full-parameter bytes held at once, and the peak RSS of rank 0.

    python3 bench/fsdp.py --build build --reps 3 --width 4096 --layers 3

With --largest-under MB, instead: the widest MLP (of --layers layers, widths
in steps of 128) that trains 2 steps on 2 ranks when every process may hold
at most MB of data (RLIMIT_DATA: heap and private writable mappings, which
is where LibTorch's CPU tensors live; the libraries' code is not counted),
for ddp and for fsdp (without and with prefetch), found by bisection (a run
that fails, whatever the error, does not fit). One JSON object per strategy.

    python3 bench/fsdp.py --build build --largest-under 1536
    FULGUR_HOST_ALLOCATOR=system python3 bench/fsdp.py --build build --largest-under 1536
"""
import argparse
import json
import os
import resource
import statistics
import subprocess

# ", prefetch": with FSDPOptions::prefetch (each unit's reduce-scatter
# overlapping backward; under FULL_SHARD also the next unit gathered
# ahead), to show what it buys and what it costs.
STRATEGIES = ["ddp", "fsdp_shard_grad_op", "fsdp_shard_grad_op, prefetch", "fsdp",
              "fsdp, prefetch"]


def run(exe, label, a):
    out = subprocess.run(exe + strategy_args(label) + ["--width", str(a.width), "--layers",
                          str(a.layers), "--steps", str(a.steps), "--warmup", str(a.warmup),
                          "--batch", str(a.batch)],
                         check=True, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith('{"benchmark": "fsdp_mlp"'):
            return json.loads(line)
    raise SystemExit("fsdp: no result from %s in:\n%s\n%s" % (label, out.stdout, out.stderr))


def strategy_args(label):
    """The bench's flags for a row label ("fsdp, prefetch": fsdp --prefetch)."""
    extra = ["--prefetch"] if label.endswith(", prefetch") else []
    return ["--strategy", label.split(",")[0]] + extra


def trains_under(exe, label, width, a, cap_bytes):
    """The run's JSON row when `label` trains `width` under the cap, else None."""
    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (cap_bytes, cap_bytes))
    try:
        out = subprocess.run(exe + strategy_args(label) + ["--width", str(width), "--layers",
                              str(a.layers), "--steps", "2", "--warmup", "0", "--batch",
                              str(a.batch)],
                             preexec_fn=limit, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    for line in out.stdout.splitlines():
        if line.startswith('{"benchmark": "fsdp_mlp"'):
            return json.loads(line)
    return None


def largest_under(exe, a):
    cap = a.largest_under * 1024 * 1024
    step = 128
    for s in ["ddp", "fsdp", "fsdp, prefetch"]:
        lo, hi = step, a.max_width  # lo fits (checked), hi + step does not (assumed)
        fit = trains_under(exe, s, lo, a, cap)
        if fit is None:
            raise SystemExit("fsdp: %s does not train even width %d under %d MB; raise "
                             "--largest-under" % (s, lo, a.largest_under))
        if trains_under(exe, s, hi, a, cap) is not None:
            raise SystemExit("fsdp: %s trains width %d under %d MB; raise --max-width"
                             % (s, hi, a.largest_under))
        tries = 2
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            row = trains_under(exe, s, mid, a, cap)
            tries += 1
            if row is None:
                hi = mid
            else:
                lo, fit = mid, row
        print(json.dumps({
            "benchmark": "fsdp_memory_cap", "strategy": s, "cap_mb": a.largest_under,
            "host_allocator": os.environ.get("FULGUR_HOST_ALLOCATOR", "cached"),
            "layers": a.layers, "largest_width": lo, "parameters": fit["parameters"],
            "state_mb": round(fit["state_bytes"] / 1e6, 1),
            "peak_rss_mb": round(fit["peak_rss_bytes"] / 1e6, 1),
            "width_that_failed": lo + step, "runs": tries}), flush=True)


def formula(label, p, n):
    strategy = label.split(",")[0]
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
    ap.add_argument("--largest-under", type=int, default=0, metavar="MB")
    ap.add_argument("--max-width", type=int, default=16384)
    a = ap.parse_args()
    exe = [os.path.join(a.build, "bench", "fulgur_bench"), "fsdp"]
    if a.largest_under:
        largest_under(exe, a)
        return
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
