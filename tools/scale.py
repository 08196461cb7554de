"""A trained voice computed at the cost of a larger LLaSA shape, with its logits unchanged.

`pcgtts models scale --from builtin --shape llasa-1b --out DIR` writes a target of the LLaSA-1B (3B,
8B or a custom) shape whose logits equal the small voice's in real arithmetic, so speculative
decoding can be measured with real speech acceptance at a realistic step cost. It is a stand-in
for released weights, not released weights: every figure measured on it says so.

The residual stream of width d is carried as `Q x` in width D, with `Q` (D × d) of orthonormal
columns of disjoint supports (source coordinate i spread evenly over target coordinates
i·r … i·r + r - 1, r = D / d). Per-coordinate weights commute with such a `Q`, so an RMSNorm keeps
its weight, repeated r times, and with eps scaled by d / D gives `RMSNorm(Q x) = sqrt(D/d) Q RMSNorm(x)`.
So: readers of a normed state get `W Qᵀ sqrt(d/D)`, writers to the stream `Q W`, embedding rows `Q e`.
Attention heads are placed on heads of the new grouped-query layout that share the right KV head
(the others write through zero `o_proj` columns); a larger head_dim places source RoPE pair j at
pair 2j (dims j, j + h/2 → 2j, 2j + H/2) with the other q/k dims zero and q scaled by sqrt(H/h),
which keeps both the rotation frequencies and the attention scale. The MLP gains rows whose
`down_proj` columns are zero, and new layers write nothing (zero `o_proj` and `down_proj`): the
identity on the stream. The speech head is made dense: each row gains a random component orthogonal
to span(Q), which the normed state never has, so the logits are unchanged and the head is no longer
a sum of FSQ digit rows. The EAGLE draft is scaled the same way (its normed inputs and outputs carry
the same `sqrt(D/d) Q` factor), and its feature layers renumbered to where the voice's layers stand.

Beside the target (`target/`, with the scaled EAGLE draft in it): `draft/` is the voice's own small
draft unchanged (same tokenizer, so it drafts for the scaled target as it does for the voice);
`draft-subset/` is the paper's layer-subset draft of the scaled target, its layers where the voice's
draft's layers stand (the built-in voice's draft began as its target's layers 0, 2, 5: at the 1B
shape layers 0, 6, 15), so it is the untrained subset draft `pcgtts train draft init` makes from the voice,
at the new width and with the dense head; `codec/` is a copy; `groups.pcg` the voice's groups with the
new target's embedding fingerprint; `SCALED.json` says what the folder is and where the layers stand.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STANDIN_NOTICE = ("a trained small voice computed at the cost of the named shape: a stand-in for released "
                  "weights, not released weights")
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
          "special_tokens_map.json")


@dataclass(frozen=True)
class Shape:
    """A LLaMA body: width, depth, query heads, KV heads, head size, MLP width."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


SHAPES = {  # the released LLaSA targets' bodies (LLaMA-3.2 1B / 3B, LLaMA-3.1 8B)
    "llasa-1b": Shape(2048, 16, 32, 8, 64, 8192),
    "llasa-3b": Shape(3072, 28, 24, 8, 128, 8192),
    "llasa-8b": Shape(4096, 32, 32, 8, 128, 14336),
}


def shape_from_flags(name: str, custom: dict[str, int | None]) -> Shape:
    """A named shape, or `custom` with every field given (`head_dim` defaults to hidden ÷ heads, as in
    transformers); a one-line ValueError otherwise."""
    given = {k: v for k, v in custom.items() if v is not None}
    if name != "custom":
        if name not in SHAPES:
            raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)} or custom")
        if given:
            raise ValueError(f"--{next(iter(given)).replace('_', '-')} goes with --shape custom only")
        return SHAPES[name]
    missing = [k for k in Shape.__dataclass_fields__ if k not in given and k != "head_dim"]
    if missing:
        raise ValueError(f"--shape custom needs {', '.join('--' + k.replace('_', '-') for k in missing)}")
    if any(v < 1 for v in given.values()):
        raise ValueError("every size of a custom shape must be >= 1")
    if "head_dim" not in given:
        check_layout(Shape(**given, head_dim=1))
        given["head_dim"] = given["hidden"] // given["heads"]
    shape = Shape(**given)
    check_layout(shape)
    return shape


def check_layout(shape: Shape) -> None:
    """A one-line ValueError unless `shape` is a LLaMA layout transformers accepts."""
    if shape.heads % shape.kv_heads:
        raise ValueError(f"{shape.heads} heads do not divide into {shape.kv_heads} KV heads")
    if shape.hidden % shape.heads:
        raise ValueError(f"hidden {shape.hidden} is not a multiple of the {shape.heads} heads "
                         "(a LLaMA's width must divide evenly among its heads)")


GiB = 2**30
SPEECH_TOKENS = 65536  # X-codec2's speech tokens: the fewest rows a LLaSA vocabulary can have
HEADROOM = 1.2  # memory and disk asked for beyond the estimate: allocator slack, the runtime's own
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def layer_parameters(shape: Shape) -> int:
    attention = 2 * shape.hidden * shape.head_dim * (shape.heads + shape.kv_heads)
    return attention + 3 * shape.hidden * shape.ffn + 2 * shape.hidden


@dataclass(frozen=True)
class Estimate:
    """What scaling to a shape costs, in bytes: the target's weights, the peak memory (the weights held
    whole while they are written, plus float64 working copies of the largest piece: about four
    vocabulary × width arrays while the head is made dense, or three of a layer), and the disk the
    output folder takes (the target and the layer-subset draft; the rest is the voice's own size)."""

    weights: int
    memory: int
    disk: int


def estimate(shape: Shape, dtype_name: str, vocab: int = SPEECH_TOKENS, draft_layers: int = 1,
             source_bytes: int = 0) -> Estimate:
    """The cost of `scale_voice` to `shape`, from sizes alone (nothing is allocated)."""
    size = DTYPE_BYTES[dtype_name]
    ends = 2 * vocab * shape.hidden + shape.hidden  # embedding, head, final norm
    layer = layer_parameters(shape)
    weights = (ends + shape.layers * layer) * size
    memory = weights + 8 * max(4 * vocab * shape.hidden, 3 * layer) + source_bytes
    disk = weights + (ends + min(draft_layers, shape.layers) * layer) * size
    return Estimate(weights, memory, disk)


def available_memory() -> int | None:
    """Bytes of memory a new allocation can have without swapping (psutil, else /proc/meminfo's
    MemAvailable, else free physical pages); None when the system does not say."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_disk(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GB" if n < 10 * GiB else f"{n / GiB:,.0f} GB"


def shape_name(shape: Shape) -> str:
    named = [f"--shape {name}" for name, known in SHAPES.items() if known == shape]
    return named[0] if named else f"the custom shape (hidden {shape.hidden}, {shape.layers} layers, ffn {shape.ffn})"


def check_resources(shape: Shape, dtype_name: str, out: Path, **sizes) -> Estimate:
    """A one-line ValueError, before anything is allocated, when scaling to `shape` would not fit in
    the available memory or on `out`'s disk (with `HEADROOM`), saying what would fit. `sizes` are
    `estimate`'s: lower bounds by default, so it can run before the voice is read."""
    need, named = estimate(shape, dtype_name, **sizes), shape_name(shape)
    memory = available_memory()
    if memory is not None and need.memory * HEADROOM > memory:
        def fits(s: Shape, dtype: str) -> bool:
            return estimate(s, dtype, **sizes).memory * HEADROOM <= memory

        ways = []
        if dtype_name != "bfloat16" and fits(shape, "bfloat16"):
            ways.append(f"--dtype bfloat16 (about {_gib(estimate(shape, 'bfloat16', **sizes).memory)})")
        for dtype in dict.fromkeys((dtype_name, "bfloat16")):
            smaller = [n for n, s in SHAPES.items() if fits(s, dtype)]
            if smaller:
                flag = f"--shape {smaller[-1]}" + ("" if dtype == dtype_name else f" --dtype {dtype}")
                size = estimate(SHAPES[smaller[-1]], dtype, **sizes).memory
                ways.append(f"a smaller shape ({flag}: about {_gib(size)})")
                break
        way = " or ".join(ways) if ways else "a smaller shape or a machine with more memory"
        raise ValueError(f"{named} in {dtype_name} needs about {_gib(need.memory)} of memory (its weights "
                         f"{_gib(need.weights)}) but {_gib(memory)} is available: use {way}")
    disk = free_disk(out.parent)
    if disk is not None and need.disk * HEADROOM > disk:
        raise ValueError(f"{named} in {dtype_name} writes about {_gib(need.disk)} but {out.parent} has "
                         f"{_gib(disk)} free: free some space, give --out on another disk, or use "
                         + ("a smaller shape" if dtype_name == "bfloat16" else "--dtype bfloat16 or a smaller shape"))
    return need


def source_shape(config: dict) -> Shape:
    heads = config["num_attention_heads"]
    return Shape(config["hidden_size"], config["num_hidden_layers"], heads, config["num_key_value_heads"],
                 config.get("head_dim") or config["hidden_size"] // heads, config["intermediate_size"])


def check_shape(source: Shape, shape: Shape, what: str = "shape") -> None:
    """A one-line ValueError unless `shape` can hold `source` exactly."""
    for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn"):
        if getattr(shape, name) < getattr(source, name):
            raise ValueError(f"the {what}'s {name} ({getattr(shape, name)}) is smaller than the voice's "
                             f"({getattr(source, name)}): a scaled model must be at least as large")
    if shape.hidden % source.hidden:
        raise ValueError(f"hidden {shape.hidden} is not a multiple of the voice's {source.hidden}")
    check_layout(shape)
    if shape.heads // shape.kv_heads < source.heads // source.kv_heads:
        raise ValueError(f"{shape.heads // shape.kv_heads} query heads a KV head cannot hold the voice's "
                         f"{source.heads // source.kv_heads}")
    if shape.head_dim % source.head_dim or (shape.head_dim // source.head_dim) & (shape.head_dim // source.head_dim - 1):
        raise ValueError(f"head_dim {shape.head_dim} is not the voice's {source.head_dim} times a power of two")


def spread(d: int, big: int, dtype=torch.float64) -> torch.Tensor:
    """Q [big, d]: orthonormal columns with disjoint supports, column i spread over rows i·r … i·r + r - 1."""
    r = big // d
    q = torch.zeros(big, d, dtype=dtype)
    for i in range(d):
        q[i * r:(i + 1) * r, i] = 1 / math.sqrt(r)
    return q


def layer_positions(source_layers: int, layers: int) -> list[int]:
    """Where the voice's layers stand in the deeper model: spread evenly, first and last kept."""
    if source_layers == 1:
        return [0]
    return [round(i * (layers - 1) / (source_layers - 1)) for i in range(source_layers)]


def head_dims(source_dim: int, dim: int) -> torch.Tensor:
    """Target dims of source q/k dims in the rotate-half layout: pair j (dims j, j + h/2) at pair s·j."""
    step, half = dim // source_dim, source_dim // 2
    j = torch.arange(source_dim)
    return torch.where(j < half, step * j, dim // 2 + step * (j - half))


class Scaler:
    """The maps for one (source shape, target shape) pair; every method returns float64 tensors."""

    def __init__(self, source: Shape, shape: Shape, generator: torch.Generator):
        self.source, self.shape, self.gen = source, shape, generator
        self.factor = math.sqrt(source.hidden / shape.hidden)  # sqrt(d / D)
        self.positions = layer_positions(source.layers, shape.layers)

    def noise(self, *size: int, scale: float = 0.02) -> torch.Tensor:
        """Weights that carry no function: uniform with standard deviation `scale` (uniform is cheaper
        to draw than normal, which counts at the 8B shape's ~4e9 such weights)."""
        bound = scale * math.sqrt(3)
        return torch.empty(*size, dtype=torch.float64).uniform_(-bound, bound, generator=self.gen)

    @property
    def r(self) -> int:
        return self.shape.hidden // self.source.hidden

    def lift_in(self, w: torch.Tensor) -> torch.Tensor:  # W Qᵀ: Q's columns have one value, 1/sqrt(r), on r rows
        return w.double().repeat_interleave(self.r, dim=-1) / math.sqrt(self.r)

    def reader(self, w: torch.Tensor) -> torch.Tensor:  # reads a normed state: W Qᵀ sqrt(d/D)
        return self.lift_in(w) * self.factor

    def writer(self, w: torch.Tensor) -> torch.Tensor:  # writes to the stream: Q W
        return w.double().repeat_interleave(self.r, dim=0) / math.sqrt(self.r)

    def norm(self, gamma: torch.Tensor) -> torch.Tensor:
        return gamma.double().repeat_interleave(self.r)

    def orthogonal(self, rows: int, scale: float) -> torch.Tensor:
        """Random rows orthogonal to span(Q): each block of r coordinates loses its mean."""
        g = self.noise(rows, self.source.hidden, self.r, scale=scale)
        return (g - g.mean(-1, keepdim=True)).reshape(rows, self.shape.hidden)

    def head(self, w: torch.Tensor) -> torch.Tensor:
        """The head as a reader, made dense by a component the normed state never has."""
        scale = float(w.double().std()) * self.factor
        return self.reader(w) + self.orthogonal(w.shape[0], scale)

    def attention(self, get) -> dict[str, torch.Tensor]:
        """One layer's attention (`get(name)` gives the source tensor of `self_attn.<name>`)."""
        src, dst = self.source, self.shape
        sh, dh = src.head_dim, dst.head_dim
        dims = head_dims(sh, dh)
        q_scale = math.sqrt(dh / sh)
        wq = self.noise(dst.heads * dh, dst.hidden)
        wk = self.noise(dst.kv_heads * dh, dst.hidden)
        wv = self.noise(dst.kv_heads * dh, dst.hidden)
        wo = torch.zeros(dst.hidden, dst.heads * dh, dtype=torch.float64)
        q_src, k_src, v_src = (self.reader(get(n)) for n in ("q_proj", "k_proj", "v_proj"))
        o_src = self.writer(get("o_proj"))
        group, big_group = src.heads // src.kv_heads, dst.heads // dst.kv_heads
        for kv in range(src.kv_heads):
            rows = kv * dh + dims
            wk[kv * dh:(kv + 1) * dh] = 0
            wk[rows] = k_src[kv * sh:(kv + 1) * sh]
            wv[kv * dh:(kv + 1) * dh] = 0
            wv[kv * dh:kv * dh + sh] = v_src[kv * sh:(kv + 1) * sh]
        for h in range(src.heads):
            t = (h // group) * big_group + h % group  # the same KV head in the new layout
            wq[t * dh:(t + 1) * dh] = 0
            wq[t * dh + dims] = q_src[h * sh:(h + 1) * sh] * q_scale
            wo[:, t * dh:t * dh + sh] = o_src[:, h * sh:(h + 1) * sh]
        return {"q_proj": wq, "k_proj": wk, "v_proj": wv, "o_proj": wo}

    def mlp(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        extra = width - gate.shape[0]
        return {"gate_proj": torch.cat([self.reader(gate), self.noise(extra, self.shape.hidden)]),
                "up_proj": torch.cat([self.reader(up), self.noise(extra, self.shape.hidden)]),
                "down_proj": torch.cat([self.writer(down), torch.zeros(self.shape.hidden, extra, dtype=torch.float64)], 1)}

    def identity_layer(self, prefix: str, width: int) -> dict[str, torch.Tensor]:
        """A layer that writes nothing to the stream (any weights, zero o_proj and down_proj)."""
        dst = self.shape
        return {f"{prefix}input_layernorm.weight": torch.ones(dst.hidden, dtype=torch.float64),
                f"{prefix}post_attention_layernorm.weight": torch.ones(dst.hidden, dtype=torch.float64),
                f"{prefix}self_attn.q_proj.weight": self.noise(dst.heads * dst.head_dim, dst.hidden),
                f"{prefix}self_attn.k_proj.weight": self.noise(dst.kv_heads * dst.head_dim, dst.hidden),
                f"{prefix}self_attn.v_proj.weight": self.noise(dst.kv_heads * dst.head_dim, dst.hidden),
                f"{prefix}self_attn.o_proj.weight": torch.zeros(dst.hidden, dst.heads * dst.head_dim, dtype=torch.float64),
                f"{prefix}mlp.gate_proj.weight": self.noise(width, dst.hidden),
                f"{prefix}mlp.up_proj.weight": self.noise(width, dst.hidden),
                f"{prefix}mlp.down_proj.weight": torch.zeros(dst.hidden, width, dtype=torch.float64)}

    def block(self, sd: dict, src_prefix: str, prefix: str, width: int, attention: bool = True) -> dict:
        """One source block (LLaMA names under `src_prefix`) as a block of the new shape under `prefix`."""
        out = {f"{prefix}post_attention_layernorm.weight": self.norm(sd[f"{src_prefix}post_attention_layernorm.weight"])}
        if attention:
            out[f"{prefix}input_layernorm.weight"] = self.norm(sd[f"{src_prefix}input_layernorm.weight"])
            attn = self.attention(lambda n: sd[f"{src_prefix}self_attn.{n}.weight"])
            out.update({f"{prefix}self_attn.{n}.weight": w for n, w in attn.items()})
        mlp = self.mlp(*(sd[f"{src_prefix}mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")), width)
        out.update({f"{prefix}mlp.{n}.weight": w for n, w in mlp.items()})
        return out

    def target(self, sd: dict):
        """A LlamaForCausalLM state dict of the source shape -> the new shape (untied head), yielded a
        layer at a time as {name: float64 tensor} so the caller can convert before the next is made."""
        embed = sd["model.embed_tokens.weight"]
        yield {"model.embed_tokens.weight": self.lift_in(embed), "model.norm.weight": self.norm(sd["model.norm.weight"])}
        yield {"lm_head.weight": self.head(sd.get("lm_head.weight", embed))}
        placed = dict(zip(self.positions, range(self.source.layers)))
        for layer in range(self.shape.layers):
            prefix = f"model.layers.{layer}."
            if layer in placed:
                yield self.block(sd, f"model.layers.{placed[layer]}.", prefix, self.shape.ffn)
            else:
                yield self.identity_layer(prefix, self.shape.ffn)

    def eagle(self, tensors: dict, feature_layers: tuple[int, ...], mlp_width: int) -> dict[str, torch.Tensor]:
        """An EAGLE draft's tensors (`runtime/lm/eagle.py`'s names) for the scaled target."""
        d = self.source.hidden
        fc = tensors["fc.weight"].double()
        out = {"fc.weight": torch.cat([self.writer(self.reader(fc[:, :d])), self.writer(self.lift_in(fc[:, d:]))], 1),
               "norm.weight": self.norm(tensors["norm.weight"])}
        if "fuse.weight" in tensors:
            fuse, parts = tensors["fuse.weight"].double(), len(feature_layers) + 1
            out["fuse.weight"] = torch.cat([self.writer(self.lift_in(fuse[:, i * d:(i + 1) * d])) for i in range(parts)], 1)
        attention = any(k.startswith("block.self_attn.") for k in tensors)
        out.update(self.block(tensors, "block.", "block.", mlp_width, attention))
        return out


def scale_config(config: dict, shape: Shape, source: Shape, dtype: str) -> dict:
    new = {**config, "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
           "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
           "intermediate_size": shape.ffn, "tie_word_embeddings": False, "dtype": dtype,
           "rms_norm_eps": config["rms_norm_eps"] * source.hidden / shape.hidden}
    return new


def source_folders(source: str) -> dict[str, Path]:
    """The voice's expanded folders: a voice pack folder expanded into the cache, or one expanded already
    (`pcgtts models scale --from builtin` gives the built-in voice's folder)."""
    pack = Path(source)
    if (pack / "target" / "config.json").is_file():  # already expanded
        return {name: pack / name for name in ("target", "draft", "codec")} | {"groups": pack / "groups.pcg"}
    if not (pack / "voice.json").is_file():
        raise ValueError(f"--from {source}: neither 'builtin', a voice folder (voice.json) nor an expanded one")
    from pcgtts.runtime.files import cache_root
    from pcgtts.train.package import expand_voice

    return {k: Path(v) for k, v in expand_voice(pack, cache_root() / f"scale-src-{pack.resolve().name}").items()}


def write_lm(src: Path, out: Path, scaler: Scaler, dtype: torch.dtype, dtype_name: str) -> None:
    """A LlamaForCausalLM folder scaled into `out` (weights, config, tokenizer files)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    source = source_shape(config)
    sd = load_file(str(src / "model.safetensors"))
    tensors = {k: v.to(dtype).contiguous() for part in scaler.target(sd) for k, v in part.items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(scale_config(config, scaler.shape, source, dtype_name), indent=2) + "\n")
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def write_eagle(src: Path, out: Path, scaler: Scaler, fingerprint: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layers = tuple(int(x) for x in meta["feature_layers"].split(",")) if meta.get("feature_layers") else ()
    width = int(meta.get("intermediate_size") or scaler.source.ffn)
    if width == scaler.source.ffn:  # "the target's width": the scaled target's
        width = scaler.shape.ffn
        meta["intermediate_size"] = str(width)
    scaled = {k: v.to(torch.float32).contiguous() for k, v in scaler.eagle(tensors, layers, width).items()}
    if layers:
        meta["feature_layers"] = ",".join(str(scaler.positions[i]) for i in layers)
    meta["target_fingerprint"] = fingerprint
    meta.pop("acceptance", None)  # measured on the voice; the scaled draft proposes the same, but say nothing unmeasured
    save_file(scaled, str(out), metadata=meta)


def subset_layers(draft: Path, scaler: Scaler) -> list[int]:
    """The layers of the paper's layer-subset draft at the new shape: the scaled target's layers where
    the voice's draft's layers stand. The voice's draft records which of its target's layers it began
    as (`pcgtts train draft init`); one that does not is taken as its depth spread over the target's."""
    from pcgtts.train.subset_draft import spread_layers

    config = json.loads((draft / "config.json").read_text())
    began = config.get("pcgtts_draft", {}).get("layers")
    if not began or not all(0 <= i < scaler.source.layers for i in began):
        began = spread_layers(scaler.source.layers, min(config["num_hidden_layers"], scaler.source.layers))
    return [scaler.positions[i] for i in began]


def write_subset_draft(target: Path, out: Path, layers: list[int]) -> None:
    """`pcgtts train draft init --layers …` on the scaled target, naming it by its place in the output folder."""
    from pcgtts.train.subset_draft import make_layer_subset_draft

    make_layer_subset_draft(target, out, layers)
    config = json.loads((out / "config.json").read_text())
    config["pcgtts_draft"]["source"] = "the scaled target beside it (../target)"
    (out / "config.json").write_text(json.dumps(config, indent=2))


def speech_fingerprint(target: Path) -> str:
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings

    return load_speech_embeddings(target)[2]


def scale_voice(source: str, shape: Shape, out: Path, dtype_name: str = "float32", seed: int = 0,
                progress=lambda what: None) -> Path:
    """Writes the scaled voice into `out` (staged beside it, renamed at the end); returns `out`."""
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.lm.eagle import EAGLE_FILE

    from pcgtts.runtime.files import check_output_dir

    if dtype_name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype_name!r}: one of {', '.join(DTYPE_BYTES)}")
    out = Path(out)
    if out.exists():
        raise ValueError(f"--out {out} exists: give a new folder (nothing is overwritten)")
    check_output_dir(out)  # its parent folder exists and is writable
    check_layout(shape)
    check_resources(shape, dtype_name, out)  # lower bounds, before the voice is read (or first expanded)
    folders = source_folders(source)
    config = json.loads((folders["target"] / "config.json").read_text())
    src_shape = source_shape(config)
    check_shape(src_shape, shape)
    draft_layers = json.loads((folders["draft"] / "config.json").read_text())["num_hidden_layers"]
    check_resources(shape, dtype_name, out, vocab=config["vocab_size"], draft_layers=draft_layers,
                    source_bytes=(folders["target"] / "model.safetensors").stat().st_size)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    stage = out.with_name(f".{out.name}.partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        gen = torch.Generator().manual_seed(seed)
        scaler = Scaler(src_shape, shape, gen)
        progress("target")
        write_lm(folders["target"], stage / "target", scaler, dtype, dtype_name)
        fingerprint = speech_fingerprint(stage / "target")
        if (folders["target"] / EAGLE_FILE).is_file():
            progress("EAGLE draft")
            write_eagle(folders["target"] / EAGLE_FILE, stage / "target" / EAGLE_FILE, scaler, fingerprint)
        progress("drafts and codec")
        shutil.copytree(folders["draft"], stage / "draft")
        subset = subset_layers(folders["draft"], scaler)
        write_subset_draft(stage / "target", stage / "draft-subset", subset)
        shutil.copytree(folders["codec"], stage / "codec")
        table = GroupTable.load(folders["groups"])
        table.with_model(table.speech_offset, table.vocab_size, fingerprint).save(stage / "groups.pcg")
        (stage / "SCALED.json").write_text(json.dumps({
            "what": STANDIN_NOTICE, "source": str(source), "shape": vars(shape), "dtype": dtype_name, "seed": seed,
            "source_layers_at": scaler.positions, "draft_subset_layers": subset}, indent=2) + "\n")
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out
