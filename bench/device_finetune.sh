#!/usr/bin/env bash
# Fine-tuning with `hytrain train` on one GPU (bench/finetune_bench.py), in stages:
#   build   installs this tree
#   ft      finetune_bench.py --sizes $SIZES --formats $FORMATS (defaults: 7b, fp32) $FT_ARGS
# Logs go to $OUT (or ./device-out).
set -uo pipefail
source "$(dirname "$0")/stage_env.sh"
for stage in "$@"; do
  case "$stage" in
    build) install_tree ;;
    ft)
      python3 bench/finetune_bench.py --sizes "${SIZES:-7b}" --formats "${FORMATS:-fp32}" ${FT_ARGS:-} 2>&1 \
        | tee -a "$out/finetune.log" | grep -v "Writing model shards" | tail -8
      free -g | head -2; df -h /tmp | tail -1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
