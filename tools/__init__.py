"""Tools around the runtime, never inside the decode path: the latency harness (`bench.py`,
`bench_plots.py`), the random-weight demo-model builders (`demo.py`, `demo_codec.py`) and group
tables for a model folder (`model_groups.py`)."""
