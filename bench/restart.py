"""Restart benchmark: from the moment a rank is SIGKILLed to the first
optimizer step after fulgur's launcher started every rank again
(max_restarts=1, a checkpoint every 4 steps), for a small state and a large
one. Split into: noticing the death and starting the new processes (kill to
the restarted rank 0's process start), starting up to the restored
checkpoint (LibTorch, rendezvous, parameter broadcast, the checkpoint load),
and the first step. Medians in milliseconds; one JSON object per size.

    python3 bench/restart.py --build build --reps 5 --sizes 1,256
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile


def run(exe, mb, root):
    shutil.rmtree(root, ignore_errors=True)
    out = subprocess.run([*exe, "--state-mb", str(mb), "--root", root], check=True,
                         capture_output=True, text=True, timeout=600)
    stamps = {}
    for line in out.stdout.splitlines():
        line = line.split("] ", 1)[-1]  # other ranks' lines carry "[rank k] "
        if line.startswith('{"restart_stamp"'):
            r = json.loads(line)
            stamps[r["restart_stamp"]] = r["ns"]
    missing = {"kill", "started", "restored", "first_step"} - stamps.keys()
    if missing:
        raise SystemExit("restart: no %s stamp in:\n%s\n%s" % (missing, out.stdout, out.stderr))
    ckpt = os.path.join(root, "checkpoints", "last.ckpt")
    return {"kill_to_first_step_ms": (stamps["first_step"] - stamps["kill"]) / 1e6,
            "kill_to_process_start_ms": (stamps["started"] - stamps["kill"]) / 1e6,
            "start_to_restored_ms": (stamps["restored"] - stamps["started"]) / 1e6,
            "restored_to_first_step_ms": (stamps["first_step"] - stamps["restored"]) / 1e6,
            "checkpoint_mb": os.path.getsize(ckpt) / 1e6}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default="build")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default="1,256")
    a = p.parse_args()
    exe = [os.path.join(a.build, "bench", "fulgur_bench"), "restart"]
    root = tempfile.mkdtemp(prefix="fulgur_bench_restart_")
    sizes = [int(s) for s in a.sizes.split(",")]
    runs = {mb: [] for mb in sizes}
    try:
        for _ in range(a.reps):
            for mb in sizes:  # interleaved: one of each size per repetition
                runs[mb].append(run(exe, mb, os.path.join(root, "run")))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for mb in sizes:
        row = {"benchmark": "restart_2_ranks", "state_mb": mb, "reps": a.reps}
        for key in runs[mb][0]:
            row[key] = round(statistics.median(r[key] for r in runs[mb]), 1)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
