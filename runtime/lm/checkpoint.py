"""Reading local Hugging Face `LlamaForCausalLM` directories (config.json + safetensors + tokenizer).

Nothing here downloads: a path that is not a local LLaSA-format directory is a clear error.
Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) layouts are
read; tied and untied LM heads are handled the way transformers does.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from pcgtts.runtime.lm.digit_head import digit_count, find_digit_table
from pcgtts.runtime.lm.llama import Llama, LlamaArgs, rope_inv_freq
from pcgtts.runtime.text.vocab import SpeechVocab

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def read_config(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face model directory: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def weight_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a readable safetensors index ({type(err).__name__}: {err})") from None
        return [model_dir / s for s in shards]
    raise ValueError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def unreadable(path: Path, err: Exception) -> ValueError:
    """The one-line error for a weight file that cannot be read (damaged, truncated, not safetensors)."""
    return ValueError(f"cannot read {path}: {err}")


@contextlib.contextmanager
def open_weights(path: Path):
    """`safe_open` on one weight file (only its header is read until a tensor is asked for), with a
    missing or damaged file a one-line ValueError naming it."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise ValueError(f"missing weight shard {path}")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise unreadable(path, err) from None
    with handle as f:
        yield f


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        if not path.is_file():
            raise ValueError(f"missing weight shard {path}")
        try:
            state.update(load_file(str(path)))
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise unreadable(path, err) from None
    return state


def stored_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of everything a checkpoint stores, read from the safetensors headers (no
    weights loaded); a missing or damaged weight file is a one-line ValueError naming it."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(Path(model_dir)):
        with open_weights(path) as f:
            shapes.update({key: tuple(f.get_slice(key).get_shape()) for key in f.keys()})
    return shapes


# The config.json fields a stored LLaMA tensor's shape follows from, by the end of its name.
SHAPE_FIELDS = {"embed_tokens.weight": "vocab_size x hidden_size", "lm_head.weight": "vocab_size x hidden_size",
                "norm.weight": "hidden_size", "layernorm.weight": "hidden_size",
                "q_proj.weight": "num_attention_heads * head_dim x hidden_size",
                "k_proj.weight": "num_key_value_heads * head_dim x hidden_size",
                "v_proj.weight": "num_key_value_heads * head_dim x hidden_size",
                "o_proj.weight": "hidden_size x num_attention_heads * head_dim",
                "gate_proj.weight": "intermediate_size x hidden_size",
                "up_proj.weight": "intermediate_size x hidden_size",
                "down_proj.weight": "hidden_size x intermediate_size"}


def check_weight_shapes(model_dir: str | Path) -> LlamaArgs:
    """A one-line ValueError unless config.json describes the tensors the checkpoint stores (their
    shapes read from the safetensors headers, no weights loaded): a wrong vocab_size or hidden_size,
    a layer count other than the stored one, a missing tensor, a damaged weight file. Returns the
    checked `LlamaArgs`."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    try:
        args = LlamaArgs.from_hf_config(config)
    except ValueError as err:
        raise ValueError(f"{model_dir}: {err}") from None
    shapes = stored_shapes(model_dir)
    with torch.device("meta"):
        model = Llama(args, torch.zeros(1, dtype=torch.long))
    expected = {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("head.")}
    expected["lm_head.weight"] = (args.vocab_size, args.hidden_size)
    layers = {k.split(".")[2] for k in shapes if k.startswith("model.layers.")}
    if layers and len(layers) != args.num_layers:
        raise ValueError(f"{model_dir}: config.json's num_hidden_layers is {args.num_layers}, but the checkpoint "
                         f"stores {len(layers)} layers")
    for key, want in expected.items():
        got = shapes.get(key)
        if got is not None and got != want:
            fields = next((f for end, f in SHAPE_FIELDS.items() if key.endswith(end)), "its sizes")
            raise ValueError(f"{model_dir}: config.json does not match the stored weights: {key} is stored as "
                             f"{list(got)}, config.json ({fields}) makes it {list(want)}")
    missing = [key for key in expected if key != "lm_head.weight" and key not in shapes]
    if missing:
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(missing)} tensor(s) config.json describes, "
                         f"{missing[0]} among them")
    if "lm_head.weight" not in shapes and not args.tie_word_embeddings:
        raise ValueError(f"{model_dir}: untied model (tie_word_embeddings is false) without lm_head.weight")
    return args


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def same_tokenizer_files(a: str | Path, b: str | Path) -> bool:
    """Whether two model folders hold byte-identical tokenizer files (a tokenizer.json included): then
    they load the same tokenizer, which need not be loaded twice to compare (seconds each with
    65,536 added speech tokens)."""
    a, b = Path(a), Path(b)
    if not ((a / "tokenizer.json").is_file() and (b / "tokenizer.json").is_file()):
        return False
    for name in TOKENIZER_FILES:
        x, y = a / name, b / name
        if x.is_file() != y.is_file() or (x.is_file() and x.read_bytes() != y.read_bytes()):
            return False
    return True


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def lm_head_weight(state: dict[str, torch.Tensor], tied: bool, model_dir: Path) -> torch.Tensor:
    """The LM head `LlamaForCausalLM.from_pretrained` ends up with (transformers 5.x, checked in
    tests/test_fidelity.py): a stored `lm_head.weight` is used whenever present -- with
    `tie_word_embeddings: true` too, where transformers unties the pair when the stored head
    differs from the embeddings (some released checkpoints ship exactly that); only a checkpoint
    without one reuses the embeddings, and only when tied."""
    embed = state.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError(f"{model_dir}: checkpoint has no model.embed_tokens.weight")
    head = state.get("lm_head.weight")
    if head is None:
        if not tied:
            raise ValueError(f"{model_dir}: untied model (tie_word_embeddings is false) without lm_head.weight")
        return embed
    if tied and not torch.equal(head, embed):
        log.warning("%s: config.json ties the LM head to the embeddings but the checkpoint stores a different "
                    "lm_head.weight; using the stored head, as transformers does", model_dir)
    return head


def load_llama(model_dir: str | Path, vocab: SpeechVocab, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", digit_head: bool = True) -> Llama:
    """Build `Llama` from a checkpoint, keeping only the restricted LM-head rows (or, when the
    speech rows are FSQ digit sums and `digit_head`, their 34-row digit table: same logits)."""
    model_dir = Path(model_dir)
    args = LlamaArgs.from_hf_config(read_config(model_dir))
    if args.vocab_size < vocab.vocab_size:
        raise ValueError(f"model vocabulary ({args.vocab_size}) is smaller than the tokenizer's ({vocab.vocab_size})")
    state = read_state_dict(model_dir)
    prefix = "model."
    head = lm_head_weight(state, args.tie_word_embeddings, model_dir)
    all_rows = vocab.head_rows()
    subset = read_head_codes(model_dir, len(all_rows))
    rows = all_rows if subset is None else all_rows[subset]
    speech = head[vocab.speech_offset:vocab.speech_offset + vocab.num_speech]  # a view: checked chunk by chunk
    table = find_digit_table(speech, head[vocab.stop_id]) if digit_head else None
    if table is not None:
        log.info("%s: the speech head is FSQ digit-factorised; computing it from %d rows", model_dir, len(table))
    digits = 0 if table is None else digit_count(vocab.num_speech)
    with torch.device("meta"):
        model = Llama(args, rows, digits=digits)
    params = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    params["head.weight"] = head[rows] if table is None else table
    missing = set(model.state_dict()) - set(params)
    unexpected = set(params) - set(model.state_dict())
    if missing:
        raise ValueError(f"{model_dir}: checkpoint is missing {sorted(missing)[:5]} ...")
    if unexpected:
        log.debug("ignoring unexpected keys: %s", sorted(unexpected)[:5])
        params = {k: v for k, v in params.items() if k not in unexpected}
    target_dtype = resolve_dtype(dtype)
    model.load_state_dict({k: v.to(target_dtype) for k, v in params.items()}, assign=True)
    # Non-persistent buffers were created on the meta device: recreate them for real.
    model.head_rows = rows.clone()
    model.inv_freq = rope_inv_freq(args)
    model.causal = torch.zeros(0, dtype=torch.bool)
    model = model.to(device).eval()
    if subset is not None:
        model.use_head_subset(subset, len(all_rows))
    return model


HEAD_CODES_FILE = "head_codes.npy"  # a draft's used-codes head: restricted indices with a head row


def read_head_codes(model_dir: Path, restricted_size: int) -> torch.Tensor | None:
    """The restricted indices a draft's head covers (sorted, the stop index included), or None."""
    import numpy as np

    path = Path(model_dir) / HEAD_CODES_FILE
    if not path.is_file():
        return None
    index = torch.from_numpy(np.load(path, allow_pickle=False).astype(np.int64))
    if index.dim() != 1 or not len(index) or int(index.min()) < 0 or int(index.max()) >= restricted_size:
        raise ValueError(f"{path}: expected a list of restricted-vocabulary indices below {restricted_size}")
    if int(index[-1]) != restricted_size - 1 or not bool((index[1:] > index[:-1]).all()):
        raise ValueError(f"{path}: indices must be strictly increasing and end with the stop index {restricted_size - 1}")
    return index


def write_head_codes(model_dir: Path, used_codes, num_speech: int) -> Path:
    """Give a draft a used-codes head: rows for `used_codes` (speech codes) and the stop token."""
    import numpy as np

    codes = np.unique(np.asarray(used_codes, dtype=np.int64).reshape(-1))
    if codes.size == 0 or codes.min() < 0 or codes.max() >= num_speech:
        raise ValueError(f"used codes must be speech codes in [0, {num_speech})")
    path = Path(model_dir) / HEAD_CODES_FILE
    np.save(path, np.append(codes, num_speech).astype(np.int32))
    return path


def embedding_rows(model_dir: str | Path) -> int | None:
    """Rows of the embedding table of a Hugging Face checkpoint, read from the safetensors header
    (no weights loaded); None for a folder that is not one (an ONNX / TensorRT export)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        return None
    key = "model.embed_tokens.weight"
    for path in weight_files(model_dir):
        with open_weights(path) as f:
            if key in f.keys():
                return int(f.get_slice(key).get_shape()[0])
    raise ValueError(f"{model_dir}: no {key} in the checkpoint")


def load_speech_embeddings(model_dir: str | Path):
    """(embedding rows of the speech tokens [N, H] float32, SpeechVocab, fingerprint) of a local
    LLaSA checkpoint, read straight from the safetensors without building the model."""
    from pcgtts.groups.build import embedding_fingerprint

    model_dir = Path(model_dir)
    vocab = SpeechVocab.from_tokenizer(load_tokenizer(model_dir))
    key = "model.embed_tokens.weight"
    for path in weight_files(model_dir):
        with open_weights(path) as f:
            if key in f.keys():
                rows = f.get_slice(key)[vocab.speech_offset:vocab.speech_offset + vocab.num_speech].float()
                return rows, vocab, embedding_fingerprint(rows)
    raise ValueError(f"{model_dir}: no {key} in the checkpoint")
