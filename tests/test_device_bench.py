"""`pacer-bench device` on the CPU with the tiny shape: the code a GPU runs, in seconds."""

import json

import pytest
import torch

from modeling_pacer.benchmarks import cli
from modeling_pacer.benchmarks.device import QWEN25_SHAPES, random_model


def test_device_report_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "device"
    assert cli.main(["device", "--shapes", "tiny", "--device", "cpu", "--rows", "4", "--prefixes", "5", "20",
                     "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads((out / "device.json").read_text())
    settings = report["shapes"]["tiny"]
    assert {"plain", "fixed-rows", "fixed-rows-eager", "rows-alone"} <= set(settings)
    for r in settings.values():
        if isinstance(r, dict):
            assert set(r["curve_ms"]) == {"1", "2", "3", "4"} and all(v > 0 for v in r["curve_ms"].values())
            assert set(r["agreement"]) == {"5", "20"} and set(r["agreement"]["5"]) == {"1", "2", "3", "4", "prefill"}
    assert settings["rows-alone"]["exact"]  # each row computed alone: exact by construction on a CPU
    assert "| tiny | rows-alone | yes |" in (out / "device.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_device_without_cuda_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["device", "--out", str(tmp_path / "x")])
    assert exit_.value.code == 2 and "no CUDA device here" in capsys.readouterr().err


def test_random_models_have_the_published_shapes():
    model = random_model("tiny", torch.float32)
    assert model.config.hidden_size == QWEN25_SHAPES["tiny"]["hidden_size"] and model.dtype == torch.float32
    assert QWEN25_SHAPES["7b"]["vocab_size"] == 152064 and QWEN25_SHAPES["0.5b"]["num_hidden_layers"] == 24
