#!/usr/bin/env bash
# Re-run every CPU figure in BENCHMARKS.md (about 50 minutes on a 2-core machine; the compiled rows need g++).
# Output: bench_out/*.log, *.json, *.png. GPU figures: benchmarks/gpu_session.sh on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench_out
run() { local name=$1; shift; echo "== $name: $*"; "$@" 2>&1 | tee "bench_out/$name.log"; }

run harness_demo  pcgtts bench --runs 1 --warmup 1 --json bench_out/harness_demo.json --plot bench_out/harness_demo.png
run lm_demo       python benchmarks/bench_lm.py --model demo --tokens 60 --runs 1
run lm_wide       python benchmarks/bench_lm.py --model wide --tokens 60 --runs 1
run ort_demo      python benchmarks/bench_lm.py --model demo --backends torch,onnxruntime --no-hf --tokens 60 --runs 1 --policies ar,sd,pcg
run ort_wide      python benchmarks/bench_lm.py --model wide --backends torch,onnxruntime --no-hf --tokens 60 --runs 1 --policies ar,sd,pcg
run compiled_demo python benchmarks/bench_lm.py --model demo --backends torch,torch-compiled --policies ar,sd,pcg --adaptive --runs 2 --tokens 200
run verify        python benchmarks/bench_verify.py
run prefix_reuse  python benchmarks/bench_prefix_reuse.py
run step_sizes    python benchmarks/bench_step_sizes.py --model demo,wide
run groups        python benchmarks/bench_groups.py
run streaming     python benchmarks/bench_streaming.py
if python -c "import llama_cpp, gguf" 2>/dev/null; then  # the peer engine: pip install -e ".[peers]"
    run llama_cpp python benchmarks/bench_llama_cpp.py --model demo
else
    echo "== llama_cpp: skipped (pip install -e \".[peers]\" for the llama.cpp rows)"
fi
