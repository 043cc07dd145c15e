#!/usr/bin/env bash
# The GPU figures of the README in one go, on a machine with a CUDA GPU (about 10 minutes on one H100
# with 16 cores, slide generation included). Results go to ${OUT:-gpu_suite_out}: summary.txt (the
# tables, updated as each step ends), *.json (the numbers) and logs.tar.gz.
#
#   bash benchmarks/gpu_suite.sh                 # all of it
#   STEPS="train heatmap" bash benchmarks/gpu_suite.sh
#   TRAIN_ARGS="" bash benchmarks/gpu_suite.sh    # without the torchrun comparison (--ddp 1)
#
# Further steps, not in the default list: features (bench_features --preset gpu: the features stage
# against the bare ResNet50-trunk forward, 20x 224-px patches of the same slides), heatmap-log (the heatmap command once more, -v, its log and
# status CSV kept: the per-slide timeline), train-device (bench_train at 224 px with --decode device),
# profile (20 training steps at 224 px under torch.profiler: $OUT/profile/*_ops.txt and a trace),
# heatmap-profile (the heatmap command's main process under cProfile: where its wall time goes),
# nvjpeg (how far nvJPEG's pixels are from PIL's on the stored patches), train-compile (bench_train at
# 224 px with --compile $COMPILE_MODE (default 'default'): the training step through torch.compile),
# heatmap-b64 / heatmap-b512 (bench_heatmap at batch 64 / 512 instead of the preset's 256), slides (the
# 14 slides alone), train-spy / heatmap-spy (bench_train at 224 px / the heatmap command under py-spy:
# collapsed stacks of every process and thread, idle included, in logs/*.spy; summarise them with
# benchmarks/spy_summary.py).
# STEP_LIMIT_S stops any one step after that many seconds (default: no limit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_suite_out}
STEPS=${STEPS:-"tests train heatmap"}
CACHE=${CACHE:-/tmp/wsi_milssl_gpu_suite}  # slides generated once, shared by train and heatmap
TRAIN_ARGS=${TRAIN_ARGS---ddp 1}
STEP_LIMIT_S=${STEP_LIMIT_S:-0}  # 0: none
REPEAT=${REPEAT:-2}  # bench_heatmap's alternating command/bare runs
PY_SPY=${PY_SPY:-py-spy}  # the *-spy steps: py-spy (pip wheel py-spy) samples every process and thread
SPY_ARGS=${SPY_ARGS:-"--subprocesses --idle --threads --nonblocking --rate 100 --format raw"}
mkdir -p "$OUT/logs"
summary="$OUT/summary.txt"
{ date; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; python3 -c "import torch; print('torch', torch.__version__)"; } > "$summary" 2>&1

step() {  # name, command...
  local name=$1; shift
  echo "== $name ($(date +%T)): $*" | tee -a "$summary"
  local t0=$SECONDS
  if [ "$STEP_LIMIT_S" -gt 0 ]; then
    timeout "$STEP_LIMIT_S" "$@" > "$OUT/logs/$name.log" 2>&1
  else
    "$@" > "$OUT/logs/$name.log" 2>&1
  fi
  local rc=$?
  tail -n 25 "$OUT/logs/$name.log" >> "$summary"
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$summary"
}

checkpoint() {  # an untrained 224-px ResNet18 checkpoint for the heatmap command: $CACHE/ckpt/best.pt
  python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; from bench_heatmap import _checkpoint; _checkpoint(Path('$CACHE/ckpt/best.pt'), target_mpp=0.5, patch_size_px=224, entropy_bits=5.0)"
}

for s in $STEPS; do
  case $s in
    tests)   step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider ;;
    train)   step train python3 benchmarks/bench_train.py --preset gpu14 $TRAIN_ARGS --cache "$CACHE" --json "$OUT/train.json" ;;
    heatmap) step heatmap python3 benchmarks/bench_heatmap.py --preset gpu14 --repeat "$REPEAT" --cache "$CACHE" --json "$OUT/heatmap.json" ;;
    slides) step slides python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; \
from _slides import build_slides; build_slides(Path('$CACHE'), n=14, size=24576)" ;;
    train-spy) step train-spy "$PY_SPY" record $SPY_ARGS -o "$OUT/logs/train224.spy" -- \
        python3 benchmarks/bench_train.py --preset gpu14 --patch-size 224 --cache "$CACHE" --json "$OUT/train224.json" ;;
    heatmap-spy)
      checkpoint
      rm -rf "$CACHE/hm_spy"
      step heatmap-spy "$PY_SPY" record $SPY_ARGS -o "$OUT/logs/heatmap.spy" -- python3 -m wsi_milssl heatmap \
        "$CACHE/slides_24576/linked" --model "$CACHE/ckpt/best.pt" --out "$CACHE/hm_spy" --batch-size 256 -v \
        --log-file "$OUT/logs/heatmap-spy-command.log" ;;
    features) step features python3 benchmarks/bench_features.py --preset gpu --repeat 3 --cache "$CACHE" \
        --json "$OUT/features.json" ;;
    heatmap-b64) step heatmap-b64 python3 benchmarks/bench_heatmap.py --preset gpu14 --batch-size 64 --repeat "$REPEAT" \
        --cache "$CACHE" --json "$OUT/heatmap_b64.json" ;;
    train-compile) step train-compile python3 benchmarks/bench_train.py --preset gpu14 --patch-size 224 \
        --compile "${COMPILE_MODE:-default}" --cache "$CACHE" --json "$OUT/train_compile.json" ;;
    heatmap-b512) step heatmap-b512 python3 benchmarks/bench_heatmap.py --preset gpu14 --batch-size 512 --repeat "$REPEAT" \
        --cache "$CACHE" --json "$OUT/heatmap_b512.json" ;;
    heatmap-log)
      checkpoint
      rm -rf "$CACHE/hm_log"
      step heatmap-log python3 -m wsi_milssl heatmap "$CACHE/slides_24576/linked" --model "$CACHE/ckpt/best.pt" \
        --out "$CACHE/hm_log" --batch-size 256 -v --log-file "$OUT/logs/heatmap-command.log"
      cp "$CACHE/hm_log/heatmap_status.csv" "$OUT/logs/heatmap-status.csv" ;;
    heatmap-profile)  # the main process under cProfile: waiting for readers ('acquire') against its own work
      checkpoint
      rm -rf "$CACHE/hm_prof"
      step heatmap-profile python3 -m cProfile -o "$OUT/logs/heatmap.pstats" -m wsi_milssl heatmap \
        "$CACHE/slides_24576/linked" --model "$CACHE/ckpt/best.pt" --out "$CACHE/hm_prof" --batch-size 256
      step heatmap-profile-table python3 -c "import pstats; s = pstats.Stats('$OUT/logs/heatmap.pstats'); s.sort_stats('tottime').print_stats(25); s.sort_stats('cumulative').print_stats(25)" ;;
    train-device) step train-device python3 benchmarks/bench_train.py --preset gpu14 --patch-size 224 --decode device \
        --cache "$CACHE" --json "$OUT/train_device.json" ;;
    profile) step profile python3 benchmarks/bench_train.py --preset gpu14 --patch-size 224 --epochs 2 \
        --cache "$CACHE" --profile "$OUT/profile" ;;
    nvjpeg) step nvjpeg python3 benchmarks/nvjpeg_vs_pil.py "$CACHE/stores_24576_0.5_224" ;;
    *) echo "unknown step $s" | tee -a "$summary" ;;
  esac
done
tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "done: $summary"
