"""Compile models for the onnxruntime / TensorRT backends: the LM step graph with KV-cache I/O
(`onnx_lm.py`, `lm_graph.py`), the codec decoder (`codec_graph.py`), TensorRT engines
(`tensorrt.py`). Every export is checked against PyTorch in a staging folder before it is published."""
