#!/usr/bin/env bash
# Everything measured on the speech lab's trained pair (BENCHMARKS.md, QUALITY.md), after
# `pcgtts train corpus|codec|lm` have run in $LAB (default /work/lab). Steps are cached: a rerun
# reuses what exists. About 30 minutes on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
LAB=${LAB:-/work/lab}
OUT=${OUT:-bench_out/lab}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run() { local name=$1; shift; echo "== $name: $*"; "$@" 2>&1 | tr '\r' '\n' | grep -v '^$' | tail -40 | tee "$OUT/$name.log"; }

T=$LAB/lm/export
# 1. The paper's draft (3 of the target's layers, briefly fine-tuned; used-codes head), the
#    multi-token heads and the EAGLE draft on the frozen target, the code transition table, the group table.
[ -f "$LAB/draft/export/config.json" ] || run draft pcgtts train draft finetune --target "$T" --lm-dir "$LAB/lm" --out "$LAB/draft" --steps 200
[ -f "$T/mtp_heads.safetensors" ] || run heads pcgtts train heads --target "$T" --num-heads 3 --sequences 24 --heldout 6 --steps 300 --max-tokens 250
[ -f "$T/eagle_draft.safetensors" ] || run eagle pcgtts train eagle --target "$T" --sequences 500 --steps 1500
[ -f "$T/transitions.pct" ] || run transitions pcgtts train transitions --codes "$LAB/lm/codes.npz" --out "$T/transitions.pct"
[ -f "$LAB/groups.pcg" ] || run groups pcgtts groups build --target "$T" --mean-size 140 --out "$LAB/groups.pcg"
MODELS=(--target "$T" --draft "$LAB/draft/export" --codec "$LAB/codec/export" --groups "$LAB/groups.pcg")

# 2. Speed and acceptance per rule, side by side in one run (draft length 3, T 0.8).
run bench pcgtts bench "${MODELS[@]}" --policy ar,sd,ssd,pcg,eagle-sd,eagle-pcg,mtp-sd,mtp-pcg,mtp-strict,mtp-topm,mtp-threshold,mtp-viterbi \
    --draft-length 3 --runs 1 --warmup 1 --max-tokens 150 --json "$OUT/bench.json"

# 3. Quality next to speed (Table 1, small): WER / Sim vs target AR, paired.
run eval pcgtts eval --mode synth "${MODELS[@]}" --policies ar,sd,pcg,eagle-pcg,mtp-sd,mtp-topm --sentences 6 --seeds 0 \
    --max-tokens 300 --out "$OUT/eval"

# 4. The codec's bar on held-out speakers.
run codec pcgtts train codec --corpus "$LAB/corpus" --out "$LAB/codec" --eval
