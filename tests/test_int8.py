"""int8 linear layers for the LM on a CPU (runtime/lm/int8.py): close to float, batch-invariant (so a
verify pass's rows equal one-token steps' and greedy speculation still equals greedy decoding),
and refused where they would not run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pcgtts.runtime.config import DecodeConfig, DeviceConfig, SamplingConfig
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats
from pcgtts.runtime.lm.int8 import Int8Linear, onednn_int8
from pcgtts.runtime.lm.torch_lm import TorchLM
from pcgtts.runtime.text.prompt import build_prompt


KERNELS = ["fbgemm"] + (["onednn"] if onednn_int8() else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_int8_linear_is_close_to_float_and_each_row_is_computed_alone(rows, kernel):
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False)
    layer = Int8Linear(linear, kernel=kernel)
    x = torch.randn(1, rows, 256) * torch.logspace(-2, 2, rows).view(1, rows, 1)  # rows of very different scales
    with torch.inference_mode():
        out, reference = layer(x), linear(x)
        alone = torch.cat([layer(x[:, i:i + 1]) for i in range(rows)], dim=1)
    assert torch.equal(out, alone)  # bit-identical: the pass's other rows change nothing
    relative = (out - reference).abs().amax(-1) / reference.abs().amax(-1)
    assert relative.max() < 0.05  # int8 weights per channel, int8 activations per row
    if rows > 1 and kernel == "fbgemm":  # what the pinning fixes: fbgemm's own layer quantizes the whole call with one range
        from torch.ao.quantization import per_channel_dynamic_qconfig

        linear.qconfig = per_channel_dynamic_qconfig
        plain = torch.ao.nn.quantized.dynamic.Linear.from_float(linear)
        with torch.inference_mode():
            assert not torch.equal(plain(x), torch.cat([plain(x[:, i:i + 1]) for i in range(rows)], dim=1))


def test_quantized_model_keeps_greedy_speculation_equal_to_greedy(tiny_lms, tiny_groups):
    target = TorchLM.load(tiny_lms["target"], max_length=256, quantize="int8")
    draft = TorchLM.load(tiny_lms["draft"], max_length=256, quantize="int8", tokenizer=target.tokenizer)
    assert isinstance(target.model.layers[0].self_attn.o_proj, Int8Linear)
    assert isinstance(target.model.head, Int8Linear)  # a full head is quantized; a digit head is 34 rows
    float_target = TorchLM.load(tiny_lms["target"], max_length=256)
    prompt = build_prompt(target.tokenizer, target.vocab, "Quantized greedy speculation.")
    with torch.inference_mode():
        a, b = target.prefill(prompt), float_target.prefill(prompt)
    assert ((a - b).abs().max() / b.abs().max()) < 0.1

    def greedy(policy):
        config = DecodeConfig(policy=policy, max_new_tokens=40, draft_length=3, adaptive_draft=False,
                              sampling=SamplingConfig(temperature=0.0))
        stats = DecodeStats()
        out = [t for burst in decode(target, draft, prompt, config, torch.Generator().manual_seed(0), tiny_groups,
                                     stats) for t in burst]
        return out, stats

    reference, _ = greedy("ar")
    for policy in ("sd", "pcg"):
        out, stats = greedy(policy)
        assert out == reference, policy
        assert stats.accepted > 0, policy  # multi-token verify passes were compared


@pytest.mark.parametrize("settings", [dict(backend="onnxruntime"), dict(dtype="bfloat16"),
                                      dict(compute_device="cuda")])
def test_int8_is_refused_where_it_would_not_run(settings):
    with pytest.raises(ValueError, match="quantize='int8' runs on the torch backend on a CPU in float32"):
        DeviceConfig(quantize="int8", **settings)
    with pytest.raises(ValueError, match="quantize must be one of"):
        DeviceConfig(quantize="int4")


def test_synthesizer_speaks_with_int8(tiny_models):
    from pcgtts.runtime.synthesizer import Synthesizer

    synth = Synthesizer.from_pretrained(tiny_models["target"], codec=tiny_models["codec"], policy="ar",
                                        quantize="int8", max_length=256, seed=0, max_new_tokens=30)
    assert isinstance(synth.target.model.head, Int8Linear)
    assert synth.synthesize("Eight bit weights.").size > 0


def test_cpu_threads_one_stage_per_core_unless_the_user_chose():
    from pcgtts.runtime.config import cpu_threads

    cpu = DeviceConfig()
    assert cpu_threads(cpu, codec_thread=True, environ={}, cores=2) == 1  # LM and codec: a core each
    assert cpu_threads(cpu, codec_thread=False, environ={}, cores=2) == 2
    assert cpu_threads(cpu, codec_thread=True, environ={}, cores=16) == 8
    assert cpu_threads(cpu, codec_thread=True, environ={"OMP_NUM_THREADS": "3"}, cores=16) is None  # theirs stands
    assert cpu_threads(DeviceConfig(threads=3), codec_thread=True, environ={"OMP_NUM_THREADS": "1"}) == 3
    assert cpu_threads(DeviceConfig(compute_device="cuda"), codec_thread=True, environ={}) is None
    with pytest.raises(ValueError, match="threads must be >= 0"):
        DeviceConfig(threads=-1)


def test_small_layers_run_on_fbgemm_and_large_ones_on_onednn_where_it_runs():
    """oneDNN's call costs more than fbgemm's; it pays only where a layer's weights dominate."""
    assert Int8Linear(nn.Linear(256, 1024, bias=False)).kernel == "fbgemm"
    assert Int8Linear(nn.Linear(2048, 2048, bias=False)).kernel == ("onednn" if onednn_int8() else "fbgemm")
