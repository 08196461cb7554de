"""A feature-level draft on the frozen target (EAGLE-style): one LLaMA block that reads the target's own hidden states.

A layer-subset draft must rebuild from tokens what the target already computed; this draft
starts from the target's final-normed hidden state h_j (the state whose head predicts token
j + 1) and the token x_{j+1} actually chosen there, and predicts the next state:

    e_j = W_in [h_j ; E x_{j+1}]            E: the target's token embedding (frozen, not stored)
    f_j = RMSNorm(Block(e_0 .. e_j))        one LLaMA block with its own static KV cache
    logits = the target's head (f_j)        predicts x_{j+2}; f_j stands in for h_{j+1}

With `feature_layers` (EAGLE-3's multi-layer features), h_j in the first line is replaced by
F [a_j ; b_j ; h_j], where a, b, ... are the outputs of those target layers, RMS-normalised without
a weight (the target returns them with h: `Llama.taps`), and F [D, (k + 1) D] is the draft's own
`fuse` map; rows the draft fed back (its own f) stand in for the fused state unchanged. The last
layer's state is specialised to the next token; the lower layers keep more of what the token
after it depends on (the alignment to the text, the voice), which a draft that sees one row has
no other way to read.

or, attention-free (`block="mlp"`), f_j = RMSNorm(e_j + MLP(RMSNorm(e_j))): a row reads only its own
(h_j, x_{j+1}), so there is no cache, and a proposal costs about half the ops (on a CPU, where a
proposal's cost is its ops' fixed costs, half the time).

so proposing the token after next costs one small block plus the target's (digit-factorised)
head. While drafting, f_j is fed back as the next step's h; after verification the target's true
states overwrite the speculative positions (static cache, explicit positions). Any draft
distribution keeps the SD and PCG rules exact, so this changes speed only, never the output law.

File format: `eagle_draft.safetensors` next to the target checkpoint (or any path), tensors
`fc.weight` [D, 2D], `block.*` (a `llama.Block`'s names; an attention-free block has only its
`post_attention_layernorm` and `mlp`), `norm.weight` [D], float16/bfloat16/float32, and
safetensors metadata {"format": "pcgtts-eagle-draft", "version": "1", "target_fingerprint":
<fingerprint of the target's speech embedding rows>, "intermediate_size": <the block's MLP width>,
optionally "block": "attention" (the default) or "mlp", optionally "feature_layers": "1,3" (the
target layers read besides the last, ascending, 0-based; then a tensor `fuse.weight` [D, (k + 1) D]),
optionally "acceptance": <held-out SD acceptance measured by the trainer, the adaptive draft
length's starting estimate>, optionally "temperature_scales": "0.2:1.1,0.8:0.8" <sampling temperature:
the factor the draft's own temperature is multiplied by there, fitted on held-out sequences
(`proposal_temperature`)>};
the block's other dimensions (heads, head size, RoPE) are the target's, and a draft trained for
one target is refused for another. A narrower MLP than the target's makes each proposal cheaper.

The draft proposes at its own temperature: the sampling temperature T times a factor
interpolated in T from the file's "temperature_scales" (1 without them). A draft fitted by a KL at
temperature 1 is flatter than the target where the target is hot (drawing it cooler, e.g. 0.64 for
T 0.8, is accepted more) and sharper where it is cold. The rules read the distribution the
proposals were drawn from, so this too changes speed only.

At run time a draft step is `run(states, tokens, start) -> (f, head scores)` over its own static
cache: `TorchEagleStep` here (`HostEagleStep`: its NumPy twin for an attention-free draft on a CPU),
`onnxruntime.OrtEagleStep` over the graph `pcgtts export onnx` writes beside the target's
(`export/eagle_graph.py`); `proposers.EagleProposer` drives either. On a compiled CPU target an
attention-free draft's proposals of a step are made in one compiled call (`CompiledEagleChain`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pcgtts.runtime import aot
from pcgtts.runtime.files import atomic_output, read_tagged_safetensors

from pcgtts.runtime.lm.digit_head import sample_digit_codes
from pcgtts.runtime.lm.proposal_head import proposal_head_for
from pcgtts.runtime.lm.llama import MLP, Block, Llama, LlamaArgs, RMSNorm, rope_cos_sin, rope_inv_freq
from pcgtts.runtime.lm.torch_lm import compile_for_cpu

log = logging.getLogger(__name__)

EAGLE_FILE = "eagle_draft.safetensors"
FORMAT = "pcgtts-eagle-draft"
VERSION = "1"
BLOCKS = ("attention", "mlp")


def proposal_temperature(scales: tuple[tuple[float, float], ...], temperature: float) -> float:
    """The temperature a draft with `scales` ((T, factor) pairs, T ascending) proposes at when the
    target samples at `temperature`: T times the factor interpolated linearly in T, the end factors
    held beyond the fitted range; T itself without scales, and 0 (greedy) stays 0."""
    if not scales or temperature == 0:
        return temperature
    ts, factors = zip(*scales)
    return temperature * float(np.interp(temperature, ts, factors))


def parse_temperature_scales(text: str) -> tuple[tuple[float, float], ...]:
    """"0.2:1.1,0.8:0.8" -> ((0.2, 1.1), (0.8, 0.8)), checked: temperatures > 0 strictly ascending,
    factors > 0, all finite."""
    try:
        pairs = tuple((float(t), float(f)) for t, f in (item.split(":") for item in text.split(",")))
    except ValueError:
        raise ValueError(f"temperature scales must read like 0.2:1.1,0.8:0.8, got {text!r}") from None
    ts = [t for t, _ in pairs]
    if not all(np.isfinite(v) and v > 0 for pair in pairs for v in pair) or ts != sorted(set(ts)):
        raise ValueError(f"temperature scales need temperatures > 0 in ascending order and factors > 0, got {text!r}")
    return pairs


def format_temperature_scales(scales: tuple[tuple[float, float], ...]) -> str:
    return ",".join(f"{t:g}:{f:.3f}" for t, f in scales)


class ResidualMLP(nn.Module):
    """A LLaMA block without its attention half (same names): x + MLP(RMSNorm(x))."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleDraft(nn.Module):
    """W_in + one LLaMA block (or its MLP half) + RMSNorm over the target's states; the target
    supplies E and the head."""

    def __init__(self, args: LlamaArgs, target_fingerprint: str = "", intermediate_size: int | None = None,
                 block: str = "attention", feature_layers: tuple[int, ...] = ()):
        super().__init__()
        if intermediate_size is not None and intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1, got {intermediate_size}")
        if block not in BLOCKS:
            raise ValueError(f"block must be one of {BLOCKS}, got {block!r}")
        self.feature_layers = feature_layers = checked_feature_layers(feature_layers, args.num_layers)
        self.args = dataclasses.replace(args, num_layers=1, intermediate_size=intermediate_size or args.intermediate_size)
        d = args.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.fuse = nn.Linear((len(feature_layers) + 1) * d, d, bias=False) if feature_layers else None
        self.attention = block == "attention"
        self.block = Block(self.args) if self.attention else ResidualMLP(self.args)
        self.norm = RMSNorm(d, args.rms_norm_eps)
        self.target_fingerprint = target_fingerprint
        self.acceptance: float | None = None  # held-out SD acceptance recorded by the trainer
        self.temperature_scales: tuple[tuple[float, float], ...] = ()  # fitted by the trainer (`proposal_temperature`)
        self.register_buffer("inv_freq", rope_inv_freq(self.args), persistent=False)

    def features(self, states: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor, end: int | None, cached: bool = True,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """states, token_embeds: [B, T, D] -> predicted next states [B, T, D].

        Decoding (B = 1): `positions` [T] are this draft's cache slots, `mask` [T, S] and `end`
        as in `Llama.hidden`. `cached=False`: no cache, the T rows attend among themselves
        (`mask` [T, T]; `positions` only place RoPE): see `train_features`. `rope`: cos, sin of
        `positions` when the caller has them (the target's table: the block shares its RoPE).
        `states` are the target's rows (with `feature_layers`: [B, T, (k + 1) D], fused here) or
        rows the draft fed back [B, T, D]."""
        states = self.fused(states)
        x = self.fc(torch.cat([states, token_embeds.to(states.dtype)], dim=-1))
        if not self.attention:
            return self.norm(self.block(x))
        cos, sin = rope if rope is not None else rope_cos_sin(self.inv_freq, positions, self.norm.weight.dtype)
        return self.norm(self.block(x, cos, sin, positions if cached else None, mask, end))

    def fused(self, states: torch.Tensor) -> torch.Tensor:
        """A target's rows [..., (k + 1) D] -> the draft's input states [..., D] (rows of width D pass)."""
        return states if self.fuse is None or states.shape[-1] == self.norm.weight.shape[0] else self.fuse(states)

    @property
    def state_size(self) -> int:
        """The width of the target's rows this draft reads: (k + 1) D."""
        return (len(self.feature_layers) + 1) * self.norm.weight.shape[0]

    @property
    def block_kind(self) -> str:
        return "attention" if self.attention else "mlp"

    def train_features(self, states: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Whole sequences at once without a cache (training): [B, T, D] -> [B, T, D], causal."""
        t = states.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=states.device).tril()
        return self.features(states, token_embeds, torch.arange(t, device=states.device), causal, None, cached=False)

    def save(self, path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write the draft atomically (temporary file, then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "version": VERSION, "target_fingerprint": self.target_fingerprint,
                "intermediate_size": str(self.args.intermediate_size), "block": self.block_kind}
        if self.feature_layers:
            meta["feature_layers"] = ",".join(map(str, self.feature_layers))
        if self.acceptance is not None:
            meta["acceptance"] = f"{self.acceptance:.4f}"
        if self.temperature_scales:
            meta["temperature_scales"] = format_temperature_scales(self.temperature_scales)
        with atomic_output(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return path

    @staticmethod
    def stored_shape(path: str | Path) -> tuple[str, int | None, tuple[int, ...]]:
        """(block, MLP width or None for the target's, target layers read) of a saved draft, without a target."""
        _, meta = read_tagged_safetensors(path, FORMAT, VERSION, "EAGLE draft", "train one with `pcgtts train eagle`")
        return _stored_shape(meta, path)

    @classmethod
    def load(cls, path: str | Path, target: Llama, fingerprint: str | None = None) -> "EagleDraft":
        """Load a draft for `target` (its `Llama`); `fingerprint` (the target's) is checked when given."""
        tensors, meta = read_tagged_safetensors(path, FORMAT, VERSION, "EAGLE draft",
                                                "train one with `pcgtts train eagle`")
        stored = meta.get("target_fingerprint", "")
        if fingerprint is not None and stored and stored != fingerprint:
            raise ValueError(f"{path}: this draft was trained for another target "
                             f"(speech embeddings {stored[:12]}..., this target {fingerprint[:12]}...)")
        block, width, layers = _stored_shape(meta, path)
        try:
            draft = cls(target.args, stored, width or target.args.intermediate_size, block, layers)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        draft.acceptance = float(meta["acceptance"]) if "acceptance" in meta else None
        if meta.get("temperature_scales"):
            try:
                draft.temperature_scales = parse_temperature_scales(meta["temperature_scales"])
            except ValueError as err:
                raise ValueError(f"{path}: {err}") from None
        try:
            draft.load_state_dict(tensors)
        except RuntimeError as err:
            raise ValueError(f"{path}: tensors do not fit this target's shape ({err})") from None
        weight = target.embed_tokens.weight
        return draft.to(device=weight.device, dtype=weight.dtype).eval().requires_grad_(False)


def _stored_shape(meta: dict, path) -> tuple[str, int | None, tuple[int, ...]]:
    block = meta.get("block", "attention")
    if block not in BLOCKS:
        raise ValueError(f"{path}: unknown EAGLE block {block!r} (this version reads {', '.join(BLOCKS)})")
    try:
        layers = tuple(int(i) for i in meta["feature_layers"].split(",")) if meta.get("feature_layers") else ()
        width = int(meta["intermediate_size"]) if "intermediate_size" in meta else None
    except ValueError as err:
        raise ValueError(f"{path}: unreadable EAGLE draft metadata ({err})") from None
    return block, width, layers


class TorchEagleStep:
    """An `EagleDraft` on the torch target it was trained for, with its own one-block static cache.

    run(states [k, D], tokens [k], start) feeds k rows (target or fed-back states, and the
    restricted-vocabulary token chosen after each) at slots start .. start + k - 1 and returns
    (f of the last row [D], the target head's float32 scores of it [W])."""

    def __init__(self, draft: EagleDraft, target: Llama, vocab, max_length: int):
        self.draft, self.model, self.vocab, self.max_length = draft, target, vocab, max_length
        self.acceptance, self.temperature_scales = draft.acceptance, draft.temperature_scales
        self.dtype, self.device = draft.norm.weight.dtype, draft.norm.weight.device  # its linears may be int8
        self.hidden_size = draft.state_size  # the width of the target's rows it reads
        self.digits = target.digits if target.samples_digits else 0  # > 0: scores can be drawn digit by digit
        self.head = proposal_head_for(target) or target.head_scores  # a large dense head: its cheap stand-in
        if draft.attention:
            attn, shape = draft.block.self_attn, (1, draft.args.num_kv_heads, max_length, draft.args.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def run(self, states: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.model
        if not self.draft.attention:  # rows are independent: only the last one is asked for
            f, scores = self.run_rows([(states, tokens)])
            return f[0], scores[0]
        embeds = model.embed_tokens(self.vocab.restricted_to_token_ids(tokens))
        end = start + len(tokens)
        positions = torch.arange(start, end, device=states.device)
        # the target's causal mask (the draft's slots never exceed the target's)
        f = self.draft.features(states[None], embeds[None], positions, model.causal[positions, :end], end,
                                rope=model.rope(positions))[0, -1]
        return f, self.head(f.to(model.dtype))

    @property
    def stateless(self) -> bool:
        """Whether it keeps no cache (an attention-free draft), so that several streams' proposals can
        be made in one call (`run_rows`)."""
        return not self.draft.attention

    def run_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention-free draft's `run` for several streams at once: [(states [k, ·], tokens [k])] ->
        (f of each one's last row [n, D], their head scores [n, W]), one product per weight."""
        return last_rows(self.draft, self.model, self.vocab, self.head, rows)

    def scores_to_logits(self, scores: torch.Tensor) -> torch.Tensor:
        return self.model.scores_to_logits(scores)


class HostEagleStep:
    """`TorchEagleStep`'s contract for an attention-free draft on a CPU, in NumPy.

    A proposal is ~20 small torch ops on vectors of 256; right after a target forward has evicted
    the caches each costs several µs of dispatch: on lab-v1 290 µs a proposal, against 140 µs for
    the same arithmetic as NumPy matrix-vector products (most of it reading the draft's 2 MB of
    weights back from memory). The weights are NumPy views of the draft's and the target's own
    float32 tensors (the embedding rows and the head), so nothing is copied; results agree with
    `TorchEagleStep` to float32 rounding (tests/test_eagle.py)."""

    def __init__(self, draft: EagleDraft, target: Llama, vocab, max_length: int):
        if not self.suits(draft, target):
            raise ValueError("the host EAGLE step runs an attention-free float32 draft on a CPU target")
        self.model, self.vocab, self.acceptance = target, vocab, draft.acceptance
        self.temperature_scales = draft.temperature_scales
        self.max_length = max_length  # slots the proposer may address (no cache: rows are independent)
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.hidden_size = draft.state_size  # the width of the target's rows it reads
        self.digits = target.digits if target.samples_digits else 0
        view = lambda t: None if t is None else t.detach().numpy()  # noqa: E731
        self.fuse = None if draft.fuse is None else view(draft.fuse.weight)  # [D, (k + 1) D]
        mlp = draft.block.mlp
        self.fc = view(draft.fc.weight)  # [D, 2D]
        self.gate, self.up, self.down = view(mlp.gate_proj.weight), view(mlp.up_proj.weight), view(mlp.down_proj.weight)
        self.biases = [view(mlp.gate_proj.bias), view(mlp.up_proj.bias), view(mlp.down_proj.bias)]
        self.norms = [(view(n.weight), n.eps) for n in (draft.block.post_attention_layernorm, draft.norm)]
        self.embed, self.head = view(target.embed_tokens.weight), view(target.head.weight)
        self.proposal_head = proposal_head_for(target)  # a large dense head: its cheap stand-in
        self.draft = draft  # several streams' rows at once run as torch products (`run_rows`)

    stateless = True  # no cache: several streams' proposals can be made in one call

    def run_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`TorchEagleStep.run_rows` (matrix products, where `run`'s vectors gain nothing from NumPy)."""
        return last_rows(self.draft, self.model, self.vocab, self.proposal_head or self.model.head_scores, rows)

    @staticmethod
    def suits(draft: EagleDraft, target: Llama) -> bool:
        """An attention-free float32 draft on a CPU target whose head is a float matrix (an int8 head,
        `int8.Int8Linear`, has none: the torch step runs the head as the target does)."""
        head = getattr(target.head, "weight", None)
        if head is None or getattr(target.head, "bias", None) is not None:
            return False
        tensors = [p for p in draft.parameters()] + [target.embed_tokens.weight, head]
        return not draft.attention and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)

    def run(self, states: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.vocab
        index = int(tokens[-1])
        token_id = v.stop_id if index == v.stop_index else index + v.speech_offset
        state = states[-1].detach().to(torch.float32).numpy()
        if self.fuse is not None and state.size != self.fc.shape[0]:  # a target row: fuse its layers
            state = self.fuse @ state
        x = self.fc @ np.concatenate([state, self.embed[token_id]])
        h = _rms_norm(x, *self.norms[0])
        gate, up = _linear(self.gate, h, self.biases[0]), _linear(self.up, h, self.biases[1])
        x = x + _linear(self.down, gate / (1.0 + np.exp(-gate)) * up, self.biases[2])
        f = torch.from_numpy(_rms_norm(x, *self.norms[1]).astype(np.float32, copy=False))
        if self.proposal_head is not None:
            return f, self.proposal_head(f)
        return f, torch.from_numpy((self.head @ f.numpy()).astype(np.float32, copy=False))

    def scores_to_logits(self, scores: torch.Tensor) -> torch.Tensor:
        return self.model.scores_to_logits(scores)


class CompiledEagleChain:
    """An attention-free float32 draft's `count` proposals, each drawn digit by digit, in one
    compiled call: the proposer of a compiled CPU target (`proposers.EagleProposer`).

    Step by step, a proposal on lab-v1 costs ~0.25 ms right after a target forward: the fixed
    costs of ~25 NumPy and torch calls and a draw in Python on cold caches. One graph per count
    runs the whole chain (the block, the target's digit head, the draw, the next token's
    embedding) in one call, compiled ahead of time by AOTInductor with the
    weights as inputs (`runtime/aot.py`: a package per shape, built once per machine, ~17 s a
    count; called through its loader, 3 proposals after a target pass take ~0.40 ms against ~0.60
    through torch.compile's wrappers); where a package cannot be built, through torch.compile.
    The draws read the uniforms `sampling.sample_by_digits` would (one [count, digits + 1]
    torch.rand, the same stream as count draws of digits + 1) in float64 as
    `digit_head.draw_digit_code` does, so a chain proposes what `HostEagleStep` and that draw do, up
    to float rounding (tests/test_compiled.py).

    __call__(state [D], token [] (restricted index), uniforms [count, digits + 1], temperature)
    -> (proposals [count] int64, the head's scores of each [count, W] float32)."""

    def __init__(self, draft: EagleDraft, target: Llama, vocab):
        if not HostEagleStep.suits(draft, target) or not target.samples_digits:
            raise ValueError("a compiled EAGLE chain runs an attention-free float32 draft with a digit head on a CPU")
        self.body = _Chain(draft, target, vocab)
        self._names = self.body.weight_names()
        self._weights = [self.body.get_parameter(name).detach() for name in self._names]
        self._graphs: dict[int, object] = {}  # count -> the compiled chain

    def __call__(self, state: torch.Tensor, token: torch.Tensor, uniforms: torch.Tensor,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(uniforms)
        if count not in self._graphs:
            self._graphs[count] = self._compile(state, token, uniforms)
        return self._graphs[count](state, token, uniforms, aot.f64_scalar(temperature))

    def _compile(self, state: torch.Tensor, token: torch.Tensor, uniforms: torch.Tensor):
        """The chain for `len(uniforms)` proposals: its package (built on first use), or torch.compile's graph."""
        from pcgtts.runtime.lm import digit_head, llama
        from pcgtts.runtime.text import vocab

        count, body, weights = len(uniforms), self.body, self._weights
        v, draft = body.vocab, body.draft
        key = (f"{count}|{body.digits}|{tuple(state.shape)}|{[tuple(w.shape) for w in weights]}|"
               f"{draft.norm.eps}|{draft.block.post_attention_layernorm.eps}|{v.stop_index},{v.stop_id},{v.speech_offset}")
        sources = tuple(Path(m.__file__) for m in (aot, digit_head, llama, vocab)) + (Path(__file__),)
        path = aot.cache_dir("eagle-chains") / aot.package_name(f"chain-{count}", sources, key)
        example = (state, token, uniforms, torch.tensor(1.0, dtype=torch.float64), *weights)
        try:
            run = aot.load_or_build(path, lambda: torch.export.export(_WeightsAsInputs(body, self._names), example),
                                    what="the EAGLE draft's proposal chain")
        except Exception as err:  # noqa: BLE001 - any build failure leaves torch.compile's graph
            log.warning("the EAGLE chain could not be compiled ahead of time (%s); torch.compile runs it", err)
            return compile_for_cpu(lambda *args: body(*args), dynamic=False)
        return lambda *args: tuple(run(*args, *weights))


class _Chain(nn.Module):
    """The chain's body over the draft and the target (submodules, so that `torch.func.functional_call`
    can swap their weights for inputs): forward(state, token, uniforms, temperature) as
    `CompiledEagleChain.__call__`."""

    def __init__(self, draft: EagleDraft, target: Llama, vocab):
        super().__init__()
        self.draft, self.model, self.vocab, self.digits = draft, target, vocab, target.digits

    def weight_names(self) -> list[str]:
        """The weights the chain reads: the draft's, the target's embedding and (digit) head."""
        return [f"draft.{name}" for name, _ in self.draft.named_parameters()] + ["model.embed_tokens.weight",
                                                                                 "model.head.weight"]

    def forward(self, state: torch.Tensor, token: torch.Tensor, uniforms: torch.Tensor,
                temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model, proposals, rows = self.model, [], []
        for u in uniforms:  # unrolled: one graph per count
            embed = model.embed_tokens(self.vocab.restricted_to_token_ids(token).reshape(1))
            state = self.draft.features(state[None], embed, None, None, None, cached=False)[0]
            scores = model.head_scores(state)
            token = sample_digit_codes(scores, self.digits, temperature, u, precision=torch.float64)
            proposals.append(token)
            rows.append(scores)
        return torch.stack(proposals), torch.stack(rows)


class _WeightsAsInputs(nn.Module):
    """`_Chain` with the weights it reads as trailing inputs (in `names`' order): what is exported, so
    that the package holds no weights (the target's embedding alone is 67 MB on the built-in voice)."""

    def __init__(self, body: _Chain, names: list[str]):
        super().__init__()
        self._body = (body,)  # not a submodule: torch.export would lift its weights into the program
        self.names = names

    def forward(self, state, token, uniforms, temperature, *weights):
        return torch.func.functional_call(self._body[0], dict(zip(self.names, weights)),
                                          (state, token, uniforms, temperature))


def checked_feature_layers(layers, num_layers: int | None = None) -> tuple[int, ...]:
    """`layers` as a tuple, or a ValueError unless they are distinct, ascending, >= 0 and (given the
    target's `num_layers`) below its last layer, whose state the draft reads anyway."""
    layers = tuple(layers)
    top = None if num_layers is None else num_layers - 2
    if list(layers) != sorted(set(layers)) or any(i < 0 or (top is not None and i > top) for i in layers):
        below = "" if top is None else f" (0..{top})"
        raise ValueError(f"feature_layers must be distinct ascending target layers below the last{below}, "
                         f"got {list(layers)}")
    return layers


def eagle_feature_layers(path: str | Path) -> tuple[int, ...]:
    """The target layers an EAGLE draft file reads besides the last (its metadata only; () for most)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            text = (f.metadata() or {}).get("feature_layers", "")
        return tuple(int(i) for i in text.split(",")) if text else ()
    except Exception as err:  # a damaged file: the full load says what is wrong
        raise ValueError(f"{path}: not a readable EAGLE draft ({err})") from None


@torch.inference_mode()
def last_rows(draft: EagleDraft, target: Llama, vocab, head, rows: list[tuple[torch.Tensor, torch.Tensor]]):
    """An attention-free draft over the last (state, token) of each of `rows` [(states [k, ·], tokens
    [k])], all in one pass -> (f [n, D], head(f) [n, W]). A target's row (its tapped layers with it)
    is fused, those of several streams together; a row the draft fed back passes as it is."""
    width = draft.norm.weight.shape[0]
    states = [s[-1] for s, _ in rows]
    wide = [i for i, state in enumerate(states) if state.shape[-1] != width]
    if wide:
        fused = draft.fused(torch.stack([states[i] for i in wide]))
        for j, i in enumerate(wide):
            states[i] = fused[j]
    tokens = torch.stack([t[-1] for _, t in rows])
    embeds = target.embed_tokens(vocab.restricted_to_token_ids(tokens))
    f = draft.features(torch.stack(states), embeds, None, None, None, cached=False)
    return f, head(f.to(target.dtype))


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.dot(x, x) / x.size + eps))


def _linear(weight: np.ndarray, x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return weight @ x if bias is None else weight @ x + bias


__all__ = ["BLOCKS", "CompiledEagleChain", "EagleDraft", "EAGLE_FILE", "HostEagleStep", "ResidualMLP",
           "TorchEagleStep", "checked_feature_layers", "eagle_feature_layers", "last_rows"]
