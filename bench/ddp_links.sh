#!/usr/bin/env bash
# DDP across a slow network: 2 machines x 1 rank each, the machines being the
# network namespaces of scripts/netns-cluster.sh with both directions of every
# link limited by tc tbf to each rate in RATES. Each run is started on both
# machines by torchrun's c10d rendezvous (as on a cluster), and the sides are
# interleaved over the repetitions:
#   fulgur, bucket_cap_mb 1 / 25 / 100   (bench/ddp.cpp --impl fulgur)
#   the naive loop (one all-reduce per parameter after backward; --impl naive)
#   PyTorch's DistributedDataParallel, Python, bucket 25 MB (bench/ddp_peer.py)
# Each run reports rank 0's samples/s over the timed steps and the bytes its
# machine sent per step, to compare with the ring all-reduce's
# 2(N-1)/N x gradient bytes (= the gradient bytes for N = 2).
#
# Usage (as root, after scripts/build.sh): bash bench/ddp_links.sh
#   RATES="1gbit 100mbit" REPS=3 STEPS_1gbit=60 STEPS_100mbit=15 (defaults)
# Prints one JSON line per rate, and a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "ddp_links: needs root (network namespaces)" >&2; exit 2; }
bin=build/bench/fulgur_bench
[ -x "$bin" ] || { echo "ddp_links: $bin is missing: run scripts/build.sh" >&2; exit 2; }
py=/usr/bin/python3
[ -x "$py" ] || py=python3
rates=${RATES:-"1gbit 100mbit"}
reps=${REPS:-3}
export FULGUR_NETNS_NAME=fulgur-bench OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
net=scripts/netns-cluster.sh
logs="$(mktemp -d /tmp/fulgur-ddp-links.XXXXXX)"
trap 'bash "$net" down >/dev/null 2>&1 || true' EXIT
bash "$net" down >/dev/null
bash "$net" up 2 >/dev/null
main="$(bash "$net" addr 0)"
# run LABEL ARGS...: torchrun on both machines (ARGS after torchrun's own);
# prints rank 0's JSON line with "label" added. Called in $(...), a subshell:
# each run's port and rendezvous id come from the number of runs started.
run() {
  local label="$1" node status=0
  shift
  local port=$((29700 + $(cat "$logs/count" 2>/dev/null || echo 0)))
  echo $((port - 29700 + 1)) >"$logs/count"
  local pids=()
  for node in 0 1; do
    timeout 900 bash "$net" exec "$node" "$py" tools/fulgur-torchrun --nnodes 2 \
      --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint "$main:$port" \
      --rdzv_id "links-$port" --redirects 1 --tee 1 --log_dir "$logs/$port-n$node" "$@" \
      >"$logs/$port-n$node.out" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=$?; done
  if [ "$status" != 0 ]; then
    echo "ddp_links: run $label failed (exit $status); its output: $logs/$port-n0.out" >&2
    tail -n 20 "$logs/$port-n0.out" >&2
    exit 1
  fi
  grep -ho '{"benchmark.*' "$logs/$port-n0.out" "$logs/$port-n1.out" | head -n 1 |
    sed "s/^{/{\"label\": \"$label\", /"
}

rows=()
for rate in $rates; do
  bash "$net" rate 0 "$rate" && bash "$net" rate 1 "$rate"
  var="STEPS_$rate"
  steps="${!var:-}"
  [ -n "$steps" ] || case "$rate" in *gbit) steps=60 ;; *) steps=15 ;; esac
  common=(--steps "$steps" --warmup 5)
  runs=()
  for ((i = 0; i < reps; i++)); do
    for mb in 1 25 100; do
      runs+=("$(run "fulgur_bucket_${mb}mb" --no_python "$bin" ddp --impl fulgur --bucket-mb "$mb" "${common[@]}")")
    done
    runs+=("$(run naive --no_python "$bin" ddp --impl naive "${common[@]}")")
    runs+=("$(run pytorch_ddp bench/ddp_peer.py "${common[@]}")")
  done
  rows+=("$("$py" - "$rate" "${runs[@]}" <<'EOF'
import json, statistics, sys
rate, runs = sys.argv[1], [json.loads(l) for l in sys.argv[2:] if l.strip()]
labels = ["fulgur_bucket_1mb", "fulgur_bucket_25mb", "fulgur_bucket_100mb", "naive", "pytorch_ddp"]
med = {l: statistics.median(r["samples_per_s"] for r in runs if r["label"] == l) for l in labels}
sent = {l: statistics.median(r["sent_bytes_per_step"] for r in runs if r["label"] == l)
        for l in labels}
grad = runs[0]["gradient_bytes"]
world = runs[0]["world_size"]
ring = 2 * (world - 1) / world * grad
print(json.dumps({"benchmark": "ddp_links_2_machines_x_1_rank", "rate": rate,
                  "samples_per_s": med, "sent_bytes_per_step": sent,
                  "ring_allreduce_bytes_per_step": ring, "gradient_bytes": grad,
                  "fulgur_25mb_vs_pytorch_ddp": round(med["fulgur_bucket_25mb"] / med["pytorch_ddp"], 3),
                  "steps": runs[0]["steps"], "runs": len(runs)}))
EOF
)")
done
printf '%s\n' "${rows[@]}"
"$py" - "${rows[@]}" <<'EOF'
import json, sys
print("| link | side | samples/s | ÷ PyTorch DDP | sent per step (MB) | ÷ ring formula |")
print("|---|---|---|---|---|---|")
for line in sys.argv[1:]:
    r = json.loads(line)
    base = r["samples_per_s"]["pytorch_ddp"]
    for label, sps in r["samples_per_s"].items():
        sent = r["sent_bytes_per_step"][label]
        print(f"| {r['rate']} | {label} | {sps:.1f} | {sps / base:.3f} | {sent / 1e6:.2f} | "
              f"{sent / r['ring_allreduce_bytes_per_step']:.3f} |")
EOF
