"""Make what the runtime loads from a checkpoint: the LM step graph with KV-cache I/O for
onnxruntime (`onnx_lm.py`, `lm_graph.py`), the codec decoder (`codec_graph.py`), TensorRT engines
(`tensorrt.py`) and a model's group table (`group_table.py`). Every graph is checked against
PyTorch in a staging folder before it is published."""
