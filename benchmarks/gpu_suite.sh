#!/usr/bin/env bash
# The GPU figures of the README in one go, on a machine with a CUDA GPU (about 10 minutes on one H100
# with 16 cores, slide generation included). Results go to ${OUT:-gpu_suite_out}: summary.txt (the
# tables, updated as each step ends), *.json (the numbers) and logs.tar.gz.
#
#   bash benchmarks/gpu_suite.sh                 # all of it
#   STEPS="train heatmap" bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_suite_out}
STEPS=${STEPS:-"tests train heatmap"}
CACHE=${CACHE:-/tmp/wsi_milssl_gpu_suite}  # slides generated once, shared by train and heatmap
mkdir -p "$OUT/logs"
summary="$OUT/summary.txt"
{ date; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; python3 -c "import torch; print('torch', torch.__version__)"; } > "$summary" 2>&1

step() {  # name, command...
  local name=$1; shift
  echo "== $name ($(date +%T)): $*" | tee -a "$summary"
  local t0=$SECONDS
  "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/logs/$name.log" >> "$summary"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$summary"
}

for s in $STEPS; do
  case $s in
    tests)   step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider ;;
    train)   step train python3 benchmarks/bench_train.py --preset gpu14 --ddp 1 --cache "$CACHE" --json "$OUT/train.json" ;;
    heatmap) step heatmap python3 benchmarks/bench_heatmap.py --preset gpu14 --repeat 2 --cache "$CACHE" --json "$OUT/heatmap.json" ;;
    *) echo "unknown step $s" | tee -a "$summary" ;;
  esac
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "done: $summary"
