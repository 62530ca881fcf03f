#!/usr/bin/env bash
# The paper's Table 1 on one 80-140 GB GPU: 4 tasks x 5 methods (+ the generalist team) x 3 seeds, then the table
# and figures. Every run resumes if interrupted (--resume when a checkpoint exists) and is skipped when evaluated.
# Estimated time (not measured here: no GPU on our machines): ~40-60 s per step on one H100/H200 with bf16
# (8 micro-batches x 32 completions x 128 tokens of Qwen2.5-3B, plus the scoring passes), i.e. 5-8 h per
# 500-step run and ~2-3 h per 233-step GSM8K run: about 400-500 GPU hours for the whole table.
# With N GPUs on one node each training run is data-parallel over them (torchrun, lib/distributed.py): N processes
# share the 8 micro-batches of every step, so N may be 1, 2, 4 or 8 (at most --grad-accum); the maths, and so
# the numbers, are those of one GPU. Evaluation stays on one GPU. `python train.py ... --plan` prints the memory
# per GPU first.
# Usage: bash experiments/paper.sh [--gpus N] [TASK...]   (default: 1 GPU; arithmetic algorithmic logic gsm8k)
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=1
if [ "${1:-}" = --gpus ]; then gpus=$2; shift 2; fi
case $gpus in ''|*[!0-9]*|0) echo "error: --gpus must be a positive integer, got '$gpus'" >&2; exit 2;; esac
if [ "$gpus" -gt 1 ]; then launch=(torchrun --standalone --nproc_per_node "$gpus"); else launch=(python); fi
tasks=${*:-arithmetic algorithmic logic gsm8k}
for task in $tasks; do
  for seed in 0 1 2; do
    for spec in "single default" "hard_routing default" "output_collab default" "no_xattn default" \
                "ours default" "ours generalist"; do
      set -- $spec; method=$1; team=$2
      out="runs/paper/$task-$team-$method-s$seed"
      [ -f "$out/eval.json" ] && continue
      extra=()
      [ "$task" = gsm8k ] && [ -n "${GSM8K_PATH:-}" ] && extra+=(--data-path "$GSM8K_PATH")
      resume=(); [ -f "$out/config.json" ] && resume=(--resume)   # started before: continue it
      [ -f "$out/lora_peft/adapter_config.json" ] || \
        "${launch[@]}" train.py --task "$task" --team "$team" --method "$method" --seed "$seed" --out "$out" "${extra[@]}" "${resume[@]}"
      python evaluate.py --run "$out"                     # 4,000 validation items (GSM8K: the 1,319 test items)
      [ "$method" = ours ] && python evaluate.py --run "$out" --no-context   # Fig. 5
    done
  done
done
python evaluate.py --summarize runs/paper --out results/paper
