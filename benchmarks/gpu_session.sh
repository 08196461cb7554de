#!/usr/bin/env bash
# Everything this project checks on an NVIDIA GPU, in one go (any CUDA machine with torch works;
# benchmarks/GPU.md says what to run first and each step's time and size budget).
#
#   bash benchmarks/gpu_session.sh [--inputs DIR] [--out DIR] [--minutes N] [--result-files N] [--part-mib N] [STEP]
#
# STEP: all (the default: tests, verify, lm, lmc), tests, verify, lm, lmc, scaled, eagle, codec, lab or labs.
# Every option has an environment variable of the same meaning; a flag wins over it.
#   --inputs DIR   PCGTTS_GPU_INPUTS  the folder of what the training steps read besides the repository
#                                     (default ./gpu_inputs): audio.npz (codec), lab.npz (lab, labs),
#                                     eagle_sentences.txt (eagle), and wheels/*.whl (e.g. a newer
#                                     transformers), installed to /tmp/site first
#   --out DIR      OUT                the results folder (default ./gpu_out): one log per step
#   --minutes N    MINUTES            the training steps' (codec, lab, labs) wall-clock budget (default 8;
#                                     the eagle step's is EAGLE_DEADLINE_MINUTES, default 8.5)
#   --result-files N  RESULT_FILES    for results copied back under limits: at most N files at the top of
#                                     the results folder (default 8) ...
#   --part-mib N   PART_MIB           ... of at most N MiB each (default 15): weights and large files are
#                                     split into parts of that size
set -uo pipefail
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed -E 's/^# ?//'; }
die() { echo "gpu_session.sh: $*" >&2; exit 2; }
step=all
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --inputs|--out|--minutes|--result-files|--part-mib)
            [ $# -ge 2 ] || die "$1 needs a value (--help lists the options)"
            case $1 in
                --inputs) PCGTTS_GPU_INPUTS=$2 ;;
                --out) OUT=$2 ;;
                --minutes) MINUTES=$2 ;;
                --result-files) RESULT_FILES=$2 ;;
                --part-mib) PART_MIB=$2 ;;
            esac
            shift 2 ;;
        -*) die "unknown option $1 (--help lists the options)" ;;
        *) step=$1; shift ;;
    esac
done
case $step in
    all|tests|verify|lm|lmc|scaled|eagle|codec|lab|labs) ;;
    *) die "unknown step '$step': one of all, tests, verify, lm, lmc, scaled, eagle, codec, lab, labs" ;;
esac
INPUTS=${PCGTTS_GPU_INPUTS:-gpu_inputs}
OUT=${OUT:-gpu_out}
RESULT_FILES=${RESULT_FILES:-8}
PART_MIB=${PART_MIB:-15}
[[ ${MINUTES:-8} =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--minutes (MINUTES) must be a number of minutes, got '${MINUTES}'"
[[ $RESULT_FILES =~ ^[1-9][0-9]*$ ]] || die "--result-files (RESULT_FILES) must be a positive whole number, got '$RESULT_FILES'"
[[ $PART_MIB =~ ^[1-9][0-9]*$ ]] || die "--part-mib (PART_MIB) must be a positive whole number, got '$PART_MIB'"
# what a training step reads must be there before anything is installed
need_input() { [ -f "$1" ] || die "the $step step reads $1 (${2}): not found; put it in the inputs folder ($INPUTS) or name it with $3"; }
case $step in
    codec) [ -f "${CODEC_WORK:-/tmp/codec}/corpus/manifest.jsonl" ] \
        || need_input "${CODEC_PACK:-$INPUTS/audio.npz}" "an audio pack: pcgtts.train.corpus.pack_audio" CODEC_PACK ;;
    lab|labs) [ -f /tmp/lab/codes.npz ] \
        || need_input "${LAB_PACK:-$INPUTS/lab.npz}" "a codes pack: pcgtts.train.lm.pack_codes" LAB_PACK ;;
    eagle) need_input "${EAGLE_SENTENCES:-$INPUTS/eagle_sentences.txt}" "one sentence a line" EAGLE_SENTENCES ;;
esac
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls "$INPUTS"/wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$INPUTS"/wheels/*.whl
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
rm "$OUT/install.log"  # keep $OUT to the results
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [ "$step" = all ] || [ "$step" = tests ]; then
    python3 -m pytest -q -m "requires_cuda or not requires_cuda" tests/test_lm.py tests/test_acceptance.py \
        tests/test_features.py tests/test_device_loop.py -k "cuda or torchaudio or transformers_feature" -rs 2>&1 | tee "$OUT/tests.log" | tail -15
fi
if [ "$step" = all ] || [ "$step" = verify ]; then
    python3 benchmarks/bench_verify.py --device cuda 2>&1 | tee "$OUT/verify.log" | tail -9
    python3 benchmarks/bench_groups.py --device cuda 2>"$OUT/groups.err" | tee "$OUT/groups.log" | tail -3
fi
if [ "$step" = all ] || [ "$step" = lm ]; then
    # rows: host loop without / with per-forward graphs, then whole steps graphed (1 and 8 per host read)
    python3 benchmarks/bench_lm.py --model llasa1b --device cuda --dtype bfloat16 --cuda-graphs both \
        --policies ar,sd,pcg --steps-per-sync 0,1,8 \
        --tokens 300 --runs 3 --cache /tmp/pcgtts-bench 2>"$OUT/lm.err" | tee "$OUT/lm.log" | tail -16
fi
if [ "$step" = all ] || [ "$step" = lmc ]; then
    # whole steps with their forwards compiled by inductor before capture ("k8c"; minutes of compiling)
    python3 benchmarks/bench_lm.py --model llasa1b --device cuda --dtype bfloat16 --cuda-graphs on \
        --policies ar,sd --steps-per-sync 0,8 --compile-steps --no-hf \
        --tokens 300 --runs 3 --cache /tmp/pcgtts-bench 2>"$OUT/lmc.err" | tee "$OUT/lmc.log" | tail -10
fi
if [ "$step" = scaled ]; then
    # The built-in voice scaled to the LLaSA-1B/3B/8B shapes (`pcgtts models scale`: its logits unchanged,
    # a stand-in for released weights, not released weights), made here in bfloat16 (an 8B folder is
    # ~15 GB) and deleted after its rows: plain decoding vs sd (the voice's own small draft), pcg and
    # eagle-pcg at L = 3 and adaptive, whole steps as CUDA graphs. SCALED_SHAPES picks the shapes.
    for shape in ${SCALED_SHAPES:-llasa-1b llasa-3b llasa-8b}; do
        dir=/tmp/pcgtts-scaled/$shape
        rm -rf "$dir"
        python3 -c "import sys; from pcgtts.cli import main; sys.exit(main())" models scale --shape "$shape" \
            --dtype bfloat16 --out "$dir" >"$OUT/scale-$shape.log" 2>&1 || { tail -3 "$OUT/scale-$shape.log"; continue; }
        python3 benchmarks/bench_lm.py --target "$dir/target" --draft "$dir/draft" --groups "$dir/groups.pcg" \
            --eagle "$dir/target/eagle_draft.safetensors" --device cuda --dtype bfloat16 --cuda-graphs on \
            --policies ar,sd,pcg,eagle-pcg --adaptive --no-hf --tokens 300 --runs 3 \
            2>"$OUT/scaled-$shape.err" | tee "$OUT/scaled-$shape.log" | tail -12
        rm -rf "$dir"
    done
fi
if [ "$step" = eagle ]; then
    # EAGLE drafts for the built-in voice's target trained here (not part of "all"): EAGLE_RUNS="name:flags;name:flags",
    # the flags `pcgtts train eagle`'s; the sentences file lies in the inputs folder (EAGLE_SENTENCES, default
    # $INPUTS/eagle_sentences.txt: a GPU machine may lack the fortunes package). The first run samples the
    # on-policy sequences (EAGLE_SAMPLE_BATCH at once); each later run starts once the first has them (its
    # train config written) and reads a copy. $OUT holds, within the results budget (RESULT_FILES, PART_MIB):
    # $OUT/<name>.safetensors (the draft)
    # and $OUT/<name>.log per run, and eagle.log (every run's tail); work folders, checkpoints and the
    # sequences stay in $EAGLE_WORK. Sampling that cannot finish within the time budget, and a
    # sequences file too large to copy back, would waste the run, hence:
    # - a probe first: one batch sampled and timed (benchmarks/bench_sampling.py), which sizes the sampling;
    # - one deadline for the whole step, EAGLE_DEADLINE_MINUTES (default 8.5) from its start: every run is ended
    #   then, and each run's training is given the time up to it (below), so that it ends on its own and writes
    #   its draft (a run the deadline ends returns its last checkpoint instead);
    # - the sequences go to $OUT split into parts, when RESULT_FILES leaves room for them.
    # Measured on an H100: 14,000 sequences sampled in 48 s; their states then took ~2 min, one
    # sequence a pass (since then STATE_BATCH a pass); run a (batch 32) trained 8,135 steps in 3.6 min and is the
    # built-in voice's draft; a second run beside it only slowed both. On an H200: that
    # draft trained on from its weights (--init-from, --seed 1, --lr 3e-4) on 32,599 new sequences, 12,500
    # steps in 4.6 min, +0.01 acceptance: the voice's draft since; a second round (--seed 2, 16,189 more)
    # moved nothing. This draft's shape (--block mlp --mlp-size 512) is saturated. Another shape pays on the
    # CPU only if it accepts ~0.07 more a position (--mlp-size 1024's proposals cost 0.77 against
    # 0.45 ms a step; --block attention has no compiled chain on the CPU yet and costs 2-3 ms).
    started=$(date +%s)
    deadline=$((started + $(python3 -c "print(int(60 * ${EAGLE_DEADLINE_MINUTES:-8.5}))")))
    work=${EAGLE_WORK:-/tmp/eagle}
    mkdir -p "$work"
    python3 -c "from pcgtts.train.package import expand_lm; expand_lm('pcgtts/voice', 'target', '$work/target')" || exit 1
    IFS=';' read -ra runs <<<"${EAGLE_RUNS:?EAGLE_RUNS names the runs}"
    wanted=$(grep -oE -- '--sequences [0-9]+' <<<"${runs[0]}" | grep -oE '[0-9]+$' || true)
    python3 benchmarks/bench_sampling.py "$work/target" --device "${EAGLE_DEVICE:-cuda}" --rounds 1 \
        --batch "${EAGLE_SAMPLE_BATCH:-512}" --sentences "${EAGLE_SENTENCES:-$INPUTS/eagle_sentences.txt}" \
        2>"$work/probe.err" | tee "$OUT/eagle.log" | tail -1 >"$work/probe.json" || { tail -5 "$work/probe.err"; exit 1; }
    # The first run's --sequences is cut to what the probe's rate samples within EAGLE_SAMPLE_MINUTES (default
    # 3) and every run reads that many. A run's training ends by the deadline less EAGLE_MARGIN_SECONDS (default
    # 45: evaluating and writing the draft) unless its flags give --max-minutes or --end-by.
    sequences=$(python3 - "$work/probe.json" "${wanted:-0}" "${EAGLE_SAMPLE_MINUTES:-3}" <<'PY'
import json, sys
rate = json.load(open(sys.argv[1]))["rounds"][0]["sequences_per_second"]
wanted, budget = int(sys.argv[2]), 60 * float(sys.argv[3])
n = min(wanted, int(rate * budget))
print(n)
print(f"probe: {rate:.1f} sequences/s; the first run's {wanted} would take {wanted / rate / 60:.1f} min "
      f"(budget {budget / 60:.1f}): sampling {n}", file=sys.stderr)
PY
    ) 2> >(tee -a "$OUT/eagle.log" >&2) || exit 1
    [ "$sequences" -gt 0 ] || { echo "eagle: the probe's rate samples no sequence in the budget" | tee -a "$OUT/eagle.log"; exit 1; }
    first=""
    for run in "${runs[@]}"; do
        name=${run%%:*}
        mkdir -p "$work/$name/work"
        if [ -n "$first" ]; then
            until [ -f "$work/$first/work/eagle_train_config.json" ] || ! kill -0 "$first_pid" 2>/dev/null; do sleep 2; done
            cp "$work/$first/work/sequences.npz" "$work/$name/work/" || continue
        fi
        left=$((deadline - $(date +%s)))
        flags=$(sed -E "s/--sequences [0-9]+/--sequences $sequences/" <<<"${run#*:}")
        grep -qE -- "--max-minutes|--end-by" <<<"$flags" || flags="$flags --end-by $((deadline - ${EAGLE_MARGIN_SECONDS:-45}))"
        [ "$left" -gt 10 ] || { echo "== $name: not started, the deadline has passed" | tee -a "$OUT/eagle.log"; continue; }
        echo "== $name starts ($((left / 60)) min $((left % 60)) s left): $flags" | tee -a "$OUT/eagle.log"
        # shellcheck disable=SC2086
        timeout "$left" python3 -c "import sys; from pcgtts.cli import main; sys.exit(main())" train eagle \
            --target "$work/target" --out "$OUT/$name.safetensors" --work-dir "$work/$name/work" \
            --device "${EAGLE_DEVICE:-cuda}" --sentences "${EAGLE_SENTENCES:-$INPUTS/eagle_sentences.txt}" \
            --sample-batch "${EAGLE_SAMPLE_BATCH:-512}" $flags >"$OUT/$name.log" 2>&1 &
        [ -n "$first" ] || { first=$name; first_pid=$!; }
    done
    wait
    for run in "${runs[@]}"; do
        name=${run%%:*}
        { echo "== $name: ${run#*:}"; tail -c 1500 "$OUT/$name.log" | tr '\r' '\n' | grep -av "^\s*$" | tail -8; } | tee -a "$OUT/eagle.log"
        # a run the deadline ended: its last checkpoint instead of the draft
        [ -f "$OUT/$name.safetensors" ] || cp "$work/$name/work/eagle_checkpoint.pt" "$OUT/$name.checkpoint.pt" 2>/dev/null
    done
    # the sampled sequences go to $OUT in parts of PART_MIB (cat them together), unless they would push $OUT
    # past RESULT_FILES files, which could crowd out the drafts: then they stay in $EAGLE_WORK
    split -b "${PART_MIB}M" -d "$work/$first/work/sequences.npz" "$work/sequences.npz.part"
    parts=("$work"/sequences.npz.part*)
    if [ ! -e "${parts[0]}" ]; then
        echo "eagle: no sequences to return" | tee -a "$OUT/eagle.log"
    elif [ $(( $(find "$OUT" -maxdepth 1 -type f | wc -l) + ${#parts[@]} )) -le "$RESULT_FILES" ]; then
        mv "${parts[@]}" "$OUT/"
    else
        echo "eagle: the sequences ($((${#parts[@]})) parts) stay in $work: they would exceed RESULT_FILES ($RESULT_FILES) files in $OUT" | tee -a "$OUT/eagle.log"
    fi
    ls -la "$OUT" | tee -a "$OUT/eagle.log"
fi
if [ "$step" = codec ]; then
    # The lab's codec trained here (not part of "all"): one run of `pcgtts train codec` for at most MINUTES
    # (default 8), resumed when called again on the same machine. Its inputs lie in the inputs folder
    # ($INPUTS/audio.npz and $INPUTS/wheels/; sizes below):
    # - CODEC_PACK (default $INPUTS/audio.npz): `pcgtts.train.corpus.pack_audio`'s Opus pack of the corpus;
    #   decoding it needs soundfile, given as wheels in $INPUTS/wheels/ (soundfile, cffi, pycparser for cp312);
    # - CODEC_ARGS: the run's flags, e.g. "--acoustic --init-from pcgtts/voice --steps 30000 --lr 3e-4" (the
    #   built-in voice's codec is in the repository, so starting from it needs no input file);
    # - CODEC_INIT (optional): a folder of `split_checkpoint` parts (float16, 15 MB for the lab's codec) of a
    #   run to go on from instead, joined into a model-only checkpoint (fresh AdamW moments; the step and the lr
    #   schedule go on; CODEC_ARGS must then match its model flags).
    # Sizes: the repository is 35.7 MiB, a pack of 24 MB (pack_audio's max_bytes 24_000_000) holds ~3 h of the corpus
    # and its voice bank (every training voice), the wheels are 1.5 MiB.
    # The weights come back as float16 parts in $OUT/codec (join_checkpoint, then `train codec --steps <step>`
    # exports them), with codec.log and loss.png; held-out figures are measured on a CPU machine (they need
    # PocketSphinx and pystoi). transformers 5.17 has Xcodec2Model and the lab codec's tests pass with it (and
    # huggingface_hub 1.33), so a GPU machine with that transformers needs no transformers wheel in $INPUTS/wheels/.
    work=${CODEC_WORK:-/tmp/codec}
    [ -f "$work/corpus/manifest.jsonl" ] || python3 -c "from pcgtts.train.corpus import unpack_audio; \
        print(unpack_audio('${CODEC_PACK:-$INPUTS/audio.npz}', '$work/corpus'))" || exit 1
    init=${CODEC_INIT:-}
    if [ -n "$init" ] && [ ! -f "$work/run/checkpoint.pt" ]; then
        mkdir -p "$work/run"
        python3 -c "from pcgtts.train.progress import join_checkpoint; join_checkpoint('$init', '$work/run/checkpoint.pt')" || exit 1
    fi
    # shellcheck disable=SC2086
    python3 -c "import sys; from pcgtts.cli import main; sys.exit(main())" train codec --corpus "$work/corpus" \
        --out "$work/run" --device "${CODEC_DEVICE:-cuda}" --batch-size "${CODEC_BATCH:-64}" --threads 8 \
        --checkpoint-minutes 100 --max-minutes "${MINUTES:-8}" ${CODEC_ARGS:-} >"$OUT/codec.log" 2>&1
    tail -c 3000 "$OUT/codec.log" | tr '\r' '\n' | grep -av "^\s*$" | tail -12
    python3 -c "import torch; from pcgtts.train.progress import split_checkpoint; \
        split_checkpoint('$work/run/checkpoint.pt', '$OUT/codec', max_bytes=$PART_MIB << 20, dtype=torch.float16)"
    cp "$work/run/loss.png" "$OUT/" 2>/dev/null
fi
if [ "$step" = lab ]; then  # one run, named lm: the labs step below with LAB_ARGS as its flags
    LAB_RUNS="lm:${LAB_ARGS:-}"
    step=labs
fi
if [ "$step" = labs ]; then
    # The lab's target LM trained here (not part of "all"), several runs side by side on the one GPU (one
    # run's host-side batch building leaves most of an H100 idle): LAB_RUNS="name:flags;name:flags", the
    # flags `pcgtts train lm`'s (e.g. "--size small --steps 4000 --align-weight 2"; batch 64 unless given).
    # LAB_PACK (default $INPUTS/lab.npz) is `pcgtts.train.lm.pack_codes`'s file, made on a CPU machine and
    # put in the inputs folder. Each run trains in /tmp/lab/<name> for at most MINUTES and resumes when
    # called again on the same machine; its weights come back as float16 parts in $OUT/<name>
    # (join_checkpoint), every run's log tail in $OUT/labs.log.
    [ -f /tmp/lab/codes.npz ] || python3 -c "from pcgtts.train.lm import unpack_codes; unpack_codes('${LAB_PACK:-$INPUTS/lab.npz}', '/tmp/lab')" || exit 1
    IFS=';' read -ra runs <<<"${LAB_RUNS:?LAB_RUNS names the runs}"
    for run in "${runs[@]}"; do
        name=${run%%:*}
        mkdir -p "/tmp/lab/$name" && ln -sf /tmp/lab/codes.npz "/tmp/lab/$name/codes.npz"
        # shellcheck disable=SC2086
        python3 -c "import sys; from pcgtts.cli import main; sys.exit(main())" train lm --corpus /tmp/lab/corpus \
            --codec /tmp/lab/codec --out "/tmp/lab/$name" --device cuda --batch-size 64 --checkpoint-minutes 100 \
            --max-minutes "${MINUTES:-8}" ${run#*:} >"/tmp/lab/$name.log" 2>&1 &
    done
    wait
    for run in "${runs[@]}"; do
        name=${run%%:*}
        { echo "== $name: ${run#*:}"; grep -E "heldout|stopping|conditioning|Error" "/tmp/lab/$name.log" | tail -4; } | tee -a "$OUT/labs.log"
        python3 -c "import torch; from pcgtts.train.progress import split_checkpoint; split_checkpoint('/tmp/lab/$name/checkpoint.pt', '$OUT/$name', max_bytes=$PART_MIB << 20, dtype=torch.float16)"
    done
fi
