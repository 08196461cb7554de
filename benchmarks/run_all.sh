#!/usr/bin/env bash
# Re-run the CPU tables of BENCHMARKS.md on this machine, each with the command its rows name.
#
#   bash benchmarks/run_all.sh            # about 80 minutes on 2 cores; the compiled rows need g++
#   bash benchmarks/run_all.sh --help
#
# Output in bench_out/: NAME.log for every command; NAME.json for every `pcgtts bench` (its --json
# report). Each report becomes rows of its BENCHMARKS.md table with the `--add` line the script prints
# at the end (python tools/results_pages.py --add FILE --table ID --command "..."), which replaces the
# rows of the same labels, stamps the date and the commit, and rewrites the page. The other scripts'
# figures (benchmarks/bench_*.py print a table and a last JSON line) go into
# benchmarks/results/speed.json by hand, with their command. GPU tables: benchmarks/GPU.md.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
if [[ $# -gt 0 ]]; then
    echo "run_all.sh: unknown argument $1 (see --help)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
mkdir -p bench_out
ADD=()
run() { local name=$1; shift; echo "== $name: $*"; "$@" 2>&1 | tee "bench_out/$name.log"; }
# bench NAME TABLE ARGS...: a `pcgtts bench` run whose report is recorded into TABLE
bench() {
    local name=$1 table=$2; shift 2
    run "$name" pcgtts bench "$@" --json "bench_out/$name.json"
    local args="$*"
    ADD+=("python tools/results_pages.py --add bench_out/$name.json --table $table --command \"pcgtts bench ${args//$V/V}\"")
}

# The built-in voice: the first speak expands it and exports its graphs (once), V is where.
run speak pcgtts speak "Hello world" --out bench_out/hello.wav
V=$(python -c "from pathlib import Path; from pcgtts.builtin import trained_voice; print(Path(trained_voice().target).parent)")
EAGLE="--target $V/target --codec $V/onnx-int8/codec --groups $V/groups.pcg --eagle pcgtts/voice/eagle_draft.safetensors"

bench builtin_ar       cpu-builtin-int8     --policy ar --runs 3 --warmup 1
bench builtin_policies cpu-builtin-int8     --policy ar,pcg,eagle-pcg,eagle-sd --draft-length 3 --adaptive --runs 3 --warmup 1 --max-tokens 150
run   graph_step       python benchmarks/bench_graph_step.py "$V/onnx-int8/target" --taps --rounds 15
bench compiled         cpu-builtin-compiled $EAGLE --policy ar,eagle-pcg,eagle-sd --adaptive --draft-length 3 --runs 3 --warmup 1 --max-tokens 150 --compile --temperature 0.8
bench eager            cpu-builtin-eager    $EAGLE --policy ar,eagle-pcg,eagle-sd --adaptive --draft-length 3 --runs 3 --warmup 1 --max-tokens 150 --backend torch --temperature 0.8
run   lm_builtin       env OMP_NUM_THREADS=1 python benchmarks/bench_lm.py --target "$V/target" --draft "$V/draft" --groups "$V/groups.pcg" \
                           --eagle pcgtts/voice/eagle_draft.safetensors --policies ar,eagle-pcg,eagle-sd --backends torch-compiled --tokens 150 --runs 3 --no-hf
run   sampling         python benchmarks/bench_sampling.py "$V/target" --batch 128 --rounds 2

# The built-in voice at LLaSA-1B cost (a stand-in for released weights; 6.6 GB in bench_out/S, ~20 min).
run   scale_1b   pcgtts models scale --shape llasa-1b --out bench_out/S
printf '%s\n' "The birch canoe slid on the smooth planks." "Glue the sheet to the dark blue background." \
    "It's easy to tell the depth of a well." "These days a chicken leg is a rare dish." \
    "Rice is often served in round bowls." "The juice of lemons makes fine punch." > bench_out/harvard6.txt
S=bench_out/S
bench scaled_1b cpu-llasa1b-scaled --target $S/target --draft $S/draft --groups $S/groups.pcg --codec $S/codec --quantize int8 \
    --policy ar,sd,pcg,eagle-sd,eagle-pcg --draft-length 3 --adaptive --runs 1 --warmup 1 --max-tokens 80 \
    --texts bench_out/harvard6.txt --temperature 0.8
if python -c "import llama_cpp, gguf" 2>/dev/null; then
    run llama_cpp_1b python benchmarks/bench_llama_cpp.py --target $S/target --draft $S/draft --types F16,Q8_0 \
        --ours torch,torch-int8,onnxruntime-int8 --no-hf --tokens 100 --runs 2
fi

# The demo shape (random weights), next to Hugging Face and llama.cpp.
run hf_demo       python benchmarks/bench_lm.py --model demo --backends torch,torch-compiled --policies ar,sd,pcg --adaptive --runs 2 --tokens 200
run ort_demo      python benchmarks/bench_lm.py --model demo --backends torch,onnxruntime --policies ar,sd,pcg --adaptive --runs 2 --tokens 200
run wide          python benchmarks/bench_lm.py --model wide --backends torch,torch-compiled --policies ar,sd --runs 2 --tokens 100
run device_loop   python benchmarks/bench_lm.py --model demo --policies ar,sd,pcg --steps-per-sync 0,8 --runs 2 --tokens 100 --no-hf
run step_sizes    env OMP_NUM_THREADS=1 python benchmarks/bench_step_sizes.py --model demo,wide
run verify        python benchmarks/bench_verify.py
run groups        python benchmarks/bench_groups.py
run streaming     python benchmarks/bench_streaming.py --tokens 400 --seqs 4
if python -c "import llama_cpp, gguf" 2>/dev/null; then  # the peer engine: pip install -e ".[peers]"
    run llama_cpp python benchmarks/bench_llama_cpp.py --model demo
else
    echo "== llama_cpp: skipped (pip install -e \".[peers]\" for the llama.cpp rows)"
fi

echo
echo "== To record the pcgtts bench reports as rows of BENCHMARKS.md:"
printf '%s\n' "${ADD[@]}"
