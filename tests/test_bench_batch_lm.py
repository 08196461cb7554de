"""benchmarks/bench_batch_lm.py on a tiny model: batched plain decoding's tokens/s and weight-read floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import benchmark_script

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    return benchmark_script("bench_batch_lm")


def test_batch_lm_reports_each_size_and_floor(tiny_lm_factory, tmp_path, capsys):
    bench = load_bench()
    target = tiny_lm_factory()
    out = tmp_path / "r" / "batch.json"
    assert bench.main(["--target", str(target), "--batch", "1,3", "--tokens", "4", "--runs", "2", "--warmup", "1",
                       "--bandwidth-gbs", "100", "--json", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(line)
    assert report == json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    assert report["rows"][0]["x_batch1"] == pytest.approx(1.0)
    for row in report["rows"]:
        assert len(row["step_ms_runs"]) == 2 and row["tok_s"] == pytest.approx(row["batch"] * 1000 / row["step_ms"])
        assert row["floor_step_ms"] == pytest.approx(report["weight_bytes"] / 100e9 * 1000)
        assert row["floor_share"] == pytest.approx(row["floor_step_ms"] / row["step_ms"])


def test_weight_bytes_leaves_out_the_embedding_table(tiny_lm_factory):
    from pcgtts.runtime.lm.torch_lm import TorchLM

    lm = TorchLM.load(tiny_lm_factory(), max_length=64, cuda_graphs=False)
    every = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    table = lm.model.embed_tokens.weight
    assert load_bench().weight_bytes(lm.model) == every - table.numel() * table.element_size()


@pytest.mark.parametrize("flags, message", [
    (["--batch", "0,2"], "distinct batch sizes"),
    (["--batch", "2,2"], "distinct batch sizes"),
    (["--quantize", "int8", "--dtype", "bfloat16"], "float32"),
    (["--device", "tpu"], "cpu, cuda or cuda:N"),
    (["--tokens", "0"], "--tokens"),
    (["--json", str(ROOT / "tests")], "not a file that can be written"),
])
def test_bad_flags_fail_before_loading(tiny_lm_factory, flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        load_bench().main(["--target", str(tiny_lm_factory()), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_folder_without_a_model_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_bench().main(["--target", str(tmp_path)])
    assert "not a model folder" in capsys.readouterr().err


def test_weight_bytes_counts_int8_layers_a_byte_a_weight(tiny_lm_factory):
    import torch

    from pcgtts.runtime.lm.torch_lm import TorchLM

    full = TorchLM.load(tiny_lm_factory(), max_length=64, cuda_graphs=False)
    int8 = TorchLM.load(tiny_lm_factory(), max_length=64, cuda_graphs=False, quantize="int8")
    linear = sum(m.weight.numel() for m in full.model.layers.modules() if isinstance(m, torch.nn.Linear))
    bench = load_bench()
    # every layer's linear weights go from 4 bytes to about 1 (plus a float scale a row)
    assert bench.weight_bytes(full.model) - bench.weight_bytes(int8.model) >= 2.5 * linear
