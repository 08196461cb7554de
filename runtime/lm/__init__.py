"""LM stage: a language model behind the `LM` protocol (`protocol.py`): prefill, forward, rollback.

`checkpoint.py` reads Hugging Face LlamaForCausalLM folders; `llama.py` is the lean LLaMA with a
static KV cache; `torch_lm.py`, `onnxruntime.py`, `tensorrt.py` are the backends (`loader.py`
picks one); `draft.py` makes a draft from a subset of the target's layers.
"""
