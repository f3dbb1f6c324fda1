"""Startup benchmark: wall time from starting a process to its first optimizer
step (tiny 784-256-10 MLP), and the latency of `fulgur resolve`.

Each side is started REPS times, interleaved (noop, hand, fulgur, fulgur x2,
resolve, noop, ...); medians in milliseconds. "noop" only loads LibTorch: it is
the floor every C++ side pays. Prints one JSON object per row.

    python3 bench/startup.py --build build --reps 15
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time


def run(cmd):
    t0 = time.time_ns()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    t_end = time.time_ns()
    stamps = [json.loads(l)["first_step_ns"] for l in out.stdout.splitlines()
              if l.startswith('{"startup"')]
    # The first step of the slowest rank (all of them for 2 processes); the
    # whole run for programs that print no stamp (fulgur resolve).
    return ((max(stamps) if stamps else t_end) - t0) / 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--reps", type=int, default=15)
    a = p.parse_args()
    exe = [os.path.join(a.build, "bench", "fulgur_bench"), "startup"]
    fulgur = os.path.join(a.build, "tools", "fulgur")
    root = tempfile.mkdtemp(prefix="fulgur_bench_startup_")
    sides = {
        "noop": [*exe, "--impl", "noop"],
        "hand": [*exe, "--impl", "hand"],
        "fulgur_1_process": [*exe, "--impl", "fulgur", "--root", root],
        "fulgur_2_processes": [*exe, "--impl", "fulgur", "--devices", "2", "--root", root],
        "fulgur_resolve": [fulgur, "resolve", "--devices", "2"],
    }
    times = {k: [] for k in sides}
    for _ in range(a.reps):
        for k, cmd in sides.items():
            times[k].append(run(cmd))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"benchmark": "startup_to_first_step_ms", "reps": a.reps,
                      "noop_ms": round(med["noop"], 1), "hand_ms": round(med["hand"], 1),
                      "fulgur_1_process_ms": round(med["fulgur_1_process"], 1),
                      "fulgur_2_processes_ms": round(med["fulgur_2_processes"], 1),
                      "ratio_1_process": round(med["fulgur_1_process"] / med["hand"], 3)}))
    print(json.dumps({"benchmark": "fulgur_resolve_ms", "reps": a.reps,
                      "resolve_ms": round(med["fulgur_resolve"], 1),
                      "noop_ms": round(med["noop"], 1),
                      "ratio_vs_noop": round(med["fulgur_resolve"] / med["noop"], 3)}))


if __name__ == "__main__":
    main()
