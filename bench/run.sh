#!/usr/bin/env bash
# Builds fulgur in Release and runs every benchmark, writing bench/RESULTS.md
# and bench/results.json. Each comparison runs both sides in one process,
# interleaved, and reports medians and their ratio.
#
#   bash bench/run.sh            # full run (several minutes)
#   STEPS=200 REPS=3 bash bench/run.sh   # quicker, noisier
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
# One thread per side: LibTorch's intra-op pool and OpenBLAS's own pool.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
steps=${STEPS:-2000}
reps=${REPS:-7}
cnn_steps=${CNN_STEPS:-200}
bin=build/bench/fulgur_bench_overhead
results=()
results+=("$($bin --model mlp --steps "$steps" --reps "$reps")")
results+=("$($bin --model mlp --steps "$steps" --reps "$reps" --log-every-step)")
results+=("$($bin --model mlp --steps "$steps" --reps "$reps" --progress-bar 2>/dev/null)")
results+=("$($bin --model cnn --steps "$cnn_steps" --reps "$reps")")

printf '[\n%s\n]\n' "$(IFS=$',\n'; echo "${results[*]}")" > bench/results.json
{
  echo "# fulgur benchmarks"
  echo
  echo "Made by \`bash bench/run.sh\` (STEPS=$steps REPS=$reps CNN_STEPS=$cnn_steps) on $(date -u +%Y-%m-%d),"
  echo "$(nproc --all) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'),"
  echo "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1. Both sides of a row run in one process,"
  echo "interleaved A B A B; figures are medians over the repetitions."
  echo
  echo "| benchmark | reference (hand-written LibTorch) µs/step | fulgur µs/step | ratio | overhead µs/step |"
  echo "|---|---|---|---|---|"
  for r in "${results[@]}"; do
    python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print("| %s | %.1f | %.1f | %.3f | %.1f |" % (r["benchmark"], r["reference_us_per_step"], r["fulgur_us_per_step"], r["ratio"], r["overhead_us_per_step"]))' "$r"
  done
  echo
  echo "Target (issue: benchmarks): ratio <= 1.02, or overhead <= 5 µs/step, whichever is larger."
} > bench/RESULTS.md
cat bench/RESULTS.md
