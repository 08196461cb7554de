"""Tools around the runtime, never inside the decode path: `pcgtts prepare` (`prepare.py`), the
latency harness (`bench.py`, `bench_plots.py`), the random-weight demo-model builders (`demo.py`,
`demo_codec.py`), the scaler to LLaSA shapes (`scale.py`) and the results pages (`results_pages.py`, their pictures: `result_plots.py`)."""
