"""`TorchLM`: the `LM` protocol (`runtime/lm/protocol.py`) on the lean torch LLaMA, with CUDA graphs.

Logits are over the restricted vocabulary (`runtime/text/vocab.py`). On CUDA the 1-token (draft)
and (L+1)-token (verify) steps replay captured graphs; every step returns logits the caller owns.
On a CPU, `compiled=True` runs the decoder of every step of up to `COMPILED_MAX_TOKENS` tokens
through torch.compile (inductor's C++ kernels, the weights read in place): one graph whose token count
and cache length are symbolic serves 1-token steps and verifies alike, compiled at load (the
demo shape: ~52 s on 2 cores the first time, ~17 s from torch's on-disk caches). A step then
costs about two thirds of an eager one on small models, whose step time is mostly per-op
overhead; prefills stay eager. On a CPU, in float32, compiled or not, the
decoder weights are laid out [in, out] in memory (`lay_out_for_cpu_steps`), the layout MKL
multiplies fastest at several tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
import torch

from pcgtts.runtime.config import MAX_DRAFT_LENGTH
from pcgtts.runtime.lm.checkpoint import load_llama, load_tokenizer, resolve_dtype
from pcgtts.runtime.lm.llama import Llama
from pcgtts.runtime.lm.protocol import SequenceMixin, check_fits
from pcgtts.runtime.text.vocab import SpeechVocab

log = logging.getLogger(__name__)

COMPILED_MAX_TOKENS = MAX_DRAFT_LENGTH + 1  # a compiled step: a draft step or a verify of up to L + 1 tokens


class TorchLM(SequenceMixin):
    """`LM` on the lean torch model; on CUDA the 1-token and (L+1)-token steps replay CUDA graphs."""

    def __init__(self, model: Llama, vocab: SpeechVocab, max_length: int, graph_sizes: tuple[int, ...] = (),
                 tokenizer=None, model_dir: str | Path | None = None, compiled: bool = False):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        self.model = model
        self.vocab = vocab
        self.tokenizer = tokenizer
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.max_length = max_length
        self.device = model.embed_tokens.weight.device
        self.length = 0
        if graph_sizes and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.graph_sizes = tuple(graph_sizes)
        self._graphs: dict[int, _StepGraph] = {}
        self._fingerprint: str | None = None
        if self.device.type == "cpu" and model.embed_tokens.weight.dtype == torch.float32:
            lay_out_for_cpu_steps(model)
        self._compiled_hidden = _compile_hidden(model) if compiled else None
        self.ensure_cache()
        if compiled:
            self._warm_up_compiled()

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu", dtype: str | torch.dtype = "float32",
             max_length: int = 4096, cuda_graphs: bool | None = None, graph_token_counts: tuple[int, ...] = (1, 4),
             tokenizer=None, digit_head: bool = True, quantize: str = "none", compiled: bool = False) -> "TorchLM":
        """graph_token_counts: the step sizes captured as CUDA graphs (a draft step is 1 token, a
        verify pass draft_length + 1); ignored unless `cuda_graphs` (default: on for CUDA).
        digit_head=False computes a digit-factorised head row by row (benchmarks compare the two).
        quantize="int8": int8 linear layers on a CPU (`runtime/lm/int8.py`). compiled: steps
        through torch.compile on a CPU (float32, no int8: see the module's docstring)."""
        if compiled:
            if torch.device(device).type != "cpu" or quantize != "none":
                raise ValueError("compiled steps run the torch backend on a CPU without int8 layers "
                                 "(on a GPU the steps replay CUDA graphs)")
            check_compiler()
        tokenizer = tokenizer or load_tokenizer(model_dir)
        vocab = SpeechVocab.from_tokenizer(tokenizer)
        model = load_llama(model_dir, vocab, resolve_dtype(dtype), device, digit_head=digit_head)
        if quantize == "int8":
            from pcgtts.runtime.lm.int8 import quantize_int8

            quantize_int8(model)
        elif quantize != "none":
            raise ValueError(f"quantize must be 'none' or 'int8', got {quantize!r}")
        if cuda_graphs is None:
            cuda_graphs = torch.device(device).type == "cuda"
        sizes = tuple(sorted(set(graph_token_counts))) if cuda_graphs else ()
        return cls(model, vocab, max_length, graph_sizes=sizes, tokenizer=tokenizer, model_dir=model_dir,
                   compiled=compiled)

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        graph = None if last_only else self._graphs.get(ids.numel())
        if graph is None:
            return self.model.logits(self._hidden(ids, last_only))
        check_fits(self.length, graph.n, self.max_length)
        out = graph.run(ids.to(self.device).view(1, -1), self.length).clone()  # its buffer is rewritten next replay
        self.length += graph.n
        return out

    def _hidden(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Forward of ids [T] (not through a CUDA graph) -> final-normed hidden states [T, D]
        (the last one only, [1, D], with `last_only`)."""
        ids = ids.to(self.device).view(1, -1)
        n = ids.shape[1]
        check_fits(self.length, n, self.max_length)
        # compiled: a step (not a prefill's last-only block), whose cache end is past slot 1 (an end
        # of 0 or 1 would make torch.compile specialise and compile again)
        if self._compiled_hidden is not None and n <= COMPILED_MAX_TOKENS and not last_only and self.length + n > 1:
            if not self.model.max_length:  # its guards are off: a freed cache would not be noticed
                raise RuntimeError("the KV cache was released: call ensure_cache() first")
            # a fresh inference tensor at offset 0, as the graph was compiled for (else a recompile)
            states = self._compiled_hidden(ids.clone(), self.length + n)[0]
        else:
            positions = torch.arange(self.length, self.length + n, device=self.device)
            states = self.model.hidden(ids, positions, self.length + n, last_only)[0]
        self.length += n
        return states

    @torch.inference_mode()
    def _warm_up_compiled(self) -> None:
        """Compile the step graph now rather than in the first utterance, its token count unbacked
        (no size is special: 1-token steps and verifies run one graph). The slots written here are
        rewritten before they are read."""
        log.info("compiling the LM's steps with torch.compile (about a minute the first time, less from the cache)")
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        torch._dynamo.decorators.mark_unbacked(ids, 1)
        self._compiled_hidden(ids, 2)
        self.forget_prefix()

    def tap_layers(self, layers: tuple[int, ...]) -> None:
        """Have every step also return these layers' outputs (`Llama.taps`: an EAGLE draft that
        reads several layers). A compiled step is compiled again: its graph does not guard the model."""
        layers = tuple(layers)
        if layers == self.model.taps:
            return
        if self.model.taps:
            raise ValueError(f"this target already returns layers {list(self.model.taps)} for another draft")
        self.model.taps = layers
        if self._compiled_hidden is not None:
            self._compiled_hidden = _compile_hidden(self.model)
            self._warm_up_compiled()

    @torch.inference_mode()
    def forward_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `forward`, also returning the final-normed hidden states that multi-token heads
        read: ids [T] -> (logits [T, V_r], hidden [T, D]). Eager (no CUDA graph)."""
        hidden = self._hidden(ids)
        return self.model.logits(hidden), hidden

    @property
    def drawable_digits(self) -> int:
        """n > 0 when a step's token can be drawn digit by digit from `forward_scores`
        (`digit_head.sample_digit_codes`): a digit head without a used-codes mask, stepped eagerly."""
        return self.model.digits if self.model.samples_digits and not self._graphs else 0

    @torch.inference_mode()
    def forward_scores(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Like `forward_hidden`, but with the head's raw scores [T, 1 + 4 * digits + 1] in place
        of the logits (eager): what a digit-by-digit draw needs."""
        hidden = self._hidden(ids)
        return self.model.head_scores(hidden), hidden

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the speech-token embedding rows: what a group table is checked against."""
        if self._fingerprint is None:
            from pcgtts.groups.build import embedding_fingerprint

            v = self.vocab
            self._fingerprint = embedding_fingerprint(self.model.embed_tokens.weight[v.speech_offset:v.speech_offset + v.num_speech])
        return self._fingerprint

    @property
    def compiled(self) -> bool:
        """Whether steps run through torch.compile (`compiled=True`)."""
        return self._compiled_hidden is not None

    def release(self) -> None:
        """Free the KV cache and graphs (the weights stay loaded)."""
        self._graphs.clear()
        self.model.free_cache()
        self.length = 0
        self.forget_prefix()

    def ensure_cache(self) -> None:
        """(Re)allocate the cache and capture the step graphs after `release()`."""
        if self.model.max_length != self.max_length:
            self.model.setup_cache(self.max_length)
            self._graphs = {n: _StepGraph(self.model, n) for n in self.graph_sizes}


def check_compiler() -> None:
    """A one-line error, before any model loads, when torch.compile has no C++ compiler for its CPU kernels."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:  # torch moved these: its own error will come at the first compile
        return
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler:
        raise ValueError("compile needs a C++ compiler for torch.compile's CPU kernels (g++, or one named by "
                         "$CXX): install one (apt install g++) or leave compile off") from None


def lay_out_for_cpu_steps(model: Llama) -> None:
    """Store each decoder projection's weight transposed in memory: the same [out, in] tensor with
    strides (1, out), so that `F.linear` multiplies by a contiguous W^T. MKL's sgemm switches kernel
    at 4 rows of x: with the row-major [out, in] weights as loaded, a 4-token verify of the trained
    target cost 1.42x a 1-token step; laid out so, 1.23x, a 1-token step within ~2 % and a prefill
    ~20 % cheaper. One layout for every step size: a second, transposed copy beside
    the loaded one was faster for 2-3 tokens, but two copies did not fit the CPU's caches together,
    and a step after one of the other size cost ~0.5 ms more (an adaptive draft length switches).
    Values, shapes and the state dict's keys are unchanged."""
    for module in model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.data = module.weight.data.t().contiguous().t()


def _compile_hidden(model: Llama):
    """`model.hidden` of a step's ids [1, T] ending at cache slot `end`, through torch.compile for a
    CPU: inductor's C++ wrapper (no Python between kernels); T and `end` symbolic.

    - One graph for every T in 1..COMPILED_MAX_TOKENS (T unbacked, see `_warm_up_compiled`). A graph
      specialised to T = 1 views its [1, 1, D] states as [1, D] with a row stride of 0, which
      aten's matmul copies before every projection (~60 copies a step on the demo shape).
    - The positions are made inside the graph from T and `end`, so that they share T's symbol.
    - No guards on the model's modules: their weights and cache keep their shapes for the LM's
      life, and checking ~140 tensors cost ~0.3 ms a step.
    - Weights not frozen into the graph: frozen, they ran no faster on the demo and lab-v1 shapes,
      and they kept AOTAutograd's cache from sparing a later process the trace."""

    def hidden(input_ids: torch.Tensor, end: int) -> torch.Tensor:
        t = input_ids.shape[1]
        torch._check(t >= 1)
        torch._check(t <= COMPILED_MAX_TOKENS)
        torch._check(end >= t)
        return model.hidden(input_ids, torch.arange(end - t, end, device=input_ids.device), end, False)

    return compile_for_cpu(hidden, dynamic=True)


def compile_for_cpu(fn, dynamic: bool):
    """`fn` through torch.compile for a CPU: one whole graph, inductor's C++ wrapper (no Python
    between kernels), no guards on the modules it reads (callers keep their weights' shapes fixed).

    dynamo keeps compiled graphs per code object, so `fn` gets one of its own: a draft and a target
    never share a graph (with the modules' guards off, nothing would stop a graph compiled for one
    model's shapes from running another's) or evict each other's."""
    fn.__code__ = fn.__code__.replace()
    return torch.compile(fn, fullgraph=True, dynamic=dynamic,
                         options={"cpp_wrapper": True,
                                  "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


class _StepGraph:
    """One captured forward of `n` tokens attending over the whole (masked) static cache."""

    def __init__(self, model: Llama, n: int):
        dev = model.embed_tokens.weight.device
        self.ids = torch.zeros(1, n, dtype=torch.long, device=dev)
        self.positions = torch.arange(n, device=dev)
        self.n = n
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up kernels/allocator outside the capture
                model(self.ids, self.positions)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = model(self.ids, self.positions)[0]
        # The warm-up wrote garbage into slots [0, n); harmless: slots are rewritten before use.

    def run(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        self.ids.copy_(ids)
        torch.arange(start, start + self.n, out=self.positions)
        self.graph.replay()
        return self.logits
