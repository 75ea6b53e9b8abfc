#!/usr/bin/env bash
# Rebuild the default model's shipped drafters on one CUDA GPU, as run on an H200:
#   1. self-distillation data: the target's greedy answers (and a sampled pass at T = 0.8)
#      to instructions built from offline text (specdecode/train/instructions.py), in 4
#      parallel shards each; then a second greedy pass whose texts to summarise are the
#      first pass's prose answers (--passages), unless PASSAGES=0;
#   2. every method trained at once on that data plus 18 standard-library modules, each
#      for a fixed wall-clock time (--time-limit; the schedule follows the time).
#   3. optionally (RESUME_S), every method resumed until RESUME_S seconds of training in all:
#      a warm restart, since the schedule's progress drops back to TRAIN_S / RESUME_S.
# Training is bounded by time, so the steps reached (in each train_log.json) depend on the GPU.
# usage: scripts/train_drafters_gpu.sh TARGET OUT   (TARGET: .gguf, HF folder or alias)
# The shipped weights: PASSAGES=0 TRAIN_S=210 REGEN_S=110 RESUME_S=430 on one H200 (the passages
# pass came later); eagle was then continued on CPU (README).
# Knobs (environment): TRAIN_S (seconds per method, 200), REGEN_S (seconds of data generation,
# 120; the passages pass gets as long again), NUM_GREEDY (3000), NUM_SAMPLED (1200), BATCH (128
# answered at once), MAX_NEW (256), TRAIN_BATCH (16 windows of SEQ 512 tokens), RESUME_S (unset:
# no second stage), PASSAGES (1; 0 skips the passages pass), METHODS, DATA (1; 0 reuses OUT/data),
# INIT (unset: from scratch; a prefix such as specdecode/weights/smollm2-135m continues each method's
# folder INIT-METHOD on the new data, --init --finetune, at LR_INIT, 5e-4), BF16 (0; 1 trains in mixed
# precision, `specdecode train --bf16`: tested on CPU only).
# A run can be split in two, e.g. TRAIN_S=250 REGEN_S=90 (data and a first stage), then
# DATA=0 TRAIN_S=0 RESUME_S=480 (every method resumed to 480 s in all).
set -euo pipefail
TARGET=${1:?usage: $0 TARGET OUT}
OUT=${2:?usage: $0 TARGET OUT}
TRAIN_S=${TRAIN_S:-200}; REGEN_S=${REGEN_S:-120}; NUM_GREEDY=${NUM_GREEDY:-3000}; NUM_SAMPLED=${NUM_SAMPLED:-1200}
BF16=${BF16:-0}; BATCH=${BATCH:-128}; MAX_NEW=${MAX_NEW:-256}; TRAIN_BATCH=${TRAIN_BATCH:-16}; SEQ=${SEQ:-512}; METHODS=${METHODS:-"eagle eagle3 mtp medusa dflash"}
mkdir -p "$OUT/data" "$OUT/code" "$OUT/logs"
STDLIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
for f in cgitb compileall crypt dataclasses gettext glob heapq imp nntplib opcode secrets smtplib sndhdr \
    socketserver symtable token tracemalloc uuid; do
  if [ -f "$STDLIB/$f.py" ]; then cp "$STDLIB/$f.py" "$OUT/code/"; fi  # some left Python 3.13's stdlib
done
python -c "from specdecode.model.loader import load_model; load_model('$TARGET')"  # converts a .gguf once

if [ "${DATA:-1}" != 0 ]; then
for k in 0 1 2 3; do
  timeout "$REGEN_S" python -m specdecode.train.regenerate --target "$TARGET" --out "$OUT/data/greedy$k.jsonl" \
    --num "$NUM_GREEDY" --seed 21 --batch "$BATCH" --max-tokens "$MAX_NEW" --shard $k/4 --overwrite --threads 2 \
    > "$OUT/logs/regen_greedy$k.log" 2>&1 &
  timeout "$REGEN_S" python -m specdecode.train.regenerate --target "$TARGET" --out "$OUT/data/sampled$k.jsonl" \
    --num "$NUM_SAMPLED" --seed 22 --temperature 0.8 --batch "$BATCH" --max-tokens "$MAX_NEW" --shard $k/4 --overwrite \
    --threads 2 > "$OUT/logs/regen_sampled$k.log" 2>&1 &
done
wait
if [ "${PASSAGES:-1}" != 0 ]; then
  for k in 0 1 2 3; do
    timeout "$REGEN_S" python -m specdecode.train.regenerate --target "$TARGET" --out "$OUT/data/passages$k.jsonl" \
      --num "$NUM_GREEDY" --seed 23 --batch "$BATCH" --max-tokens "$MAX_NEW" --shard $k/4 --overwrite --threads 2 \
      --passages "$OUT"/data/greedy?.jsonl > "$OUT/logs/regen_passages$k.log" 2>&1 &
  done
  wait
fi
fi
echo "self-distillation records: $(cat "$OUT"/data/*.jsonl 2>/dev/null | wc -l)"

train_all() {  # $1: the time limit; further arguments go to every run
  local limit=$1; shift
  for m in $METHODS; do
    case $m in eagle) net='{"train_steps":2}'; lr=2e-3 ;; eagle3) net='{}'; lr=2e-3 ;; *) net='{}'; lr=1e-3 ;; esac
    local opts=()
    if [ -n "${INIT:-}" ]; then opts=(--init "$INIT-$m" --finetune); lr=${LR_INIT:-5e-4}; fi
    if [ "$BF16" = 1 ]; then opts+=(--bf16); fi
    python -m specdecode.entrypoints.cli train --method "$m" --target "$TARGET" --data "$OUT/data" "$OUT/code" \
      ${opts[@]+"${opts[@]}"} --net-config "$net" --lr $lr --batch-size $TRAIN_BATCH --seq-len $SEQ --warmup 100 --steps 1000000 \
      --time-limit "$limit" --eval-every 0 --eval-batches 16 --save-every 1000000 --max-tokens 4000000 \
      --cache-topk 64 --threads 2 "$@" --out "$OUT/$m" > "$OUT/logs/train_$m.$limit.log" 2>&1 &
  done
  wait
  for m in $METHODS; do echo "== $m"; tail -3 "$OUT/logs/train_$m.$limit.log"; done
}
if [ "$TRAIN_S" != 0 ]; then train_all "$TRAIN_S" --overwrite; fi  # a fresh run replaces an earlier one in $OUT
if [ -n "${RESUME_S:-}" ]; then train_all "$RESUME_S" --resume; fi
