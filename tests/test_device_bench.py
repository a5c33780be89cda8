"""`pacer-bench device` on the CPU with the tiny shape: the code a GPU runs, in seconds."""

import json

import pytest
import torch

from modeling_pacer.benchmarks import cli
from modeling_pacer.benchmarks.device import QWEN25_SHAPES, random_model


def test_device_report_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "device"
    assert cli.main(["device", "--shapes", "tiny", "--device", "cpu", "--rows", "4", "--prefixes", "5", "20",
                     "--repeats", "1", "--capture-backend", "cudagraphs", "--out", str(out)]) == 0
    report = json.loads((out / "device.json").read_text())
    settings = report["shapes"]["tiny"]
    assert {"plain", "fixed-rows", "fixed-rows-eager", "rows-alone", "captured", "fixed-rows-captured"} <= set(settings)
    for r in settings.values():
        if isinstance(r, dict):
            assert set(r["curve_ms"]) == {"1", "2", "3", "4"} and all(v > 0 for v in r["curve_ms"].values())
            assert set(r["agreement"]) == {"5", "20"} and set(r["agreement"]["5"]) == {"1", "2", "3", "4", "prefill"}
    assert settings["rows-alone"]["exact"]  # each row computed alone: exact by construction on a CPU
    assert all(r["kernel_ms"] == {"1": None, "4": None} for r in settings.values() if isinstance(r, dict))
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


def test_end_to_end_on_the_cpu():
    """The device run's end-to-end measurement, on the CPU: PACER over the exact target alone, eager and captured
    (torch's "cudagraphs" backend, without CUDA graphs here), every output the target alone's."""
    from modeling_pacer.benchmarks.device import end_to_end

    report = end_to_end("tiny", device="cpu", draft_layers=1, noise=0.3, prompts=2, prompt_tokens=9, new_tokens=24,
                        rows=4, capture_backend="cudagraphs", log=lambda line: None)
    assert set(report["modes"]) == {"eager", "captured"}
    for result in report["modes"].values():
        assert result["identical"] == "2/2" and result["drafted"] > 0
        assert all(v > 0 for v in result["tokens_per_s"].values())


def test_pair_costs_price_the_exact_target_and_the_draft():
    """The cost models a GPU run leaves for projections: the exact target's curve and the 0.5B draft's step, in
    each mode both were measured in, with the plain target's step as the baseline."""
    from modeling_pacer.benchmarks.device import pair_costs

    def setting(*ms):
        return dict(curve_ms={str(k): v for k, v in enumerate(ms, 1)})

    report = dict(shapes={
        "0.5b": dict(plain=setting(15.0, 15.5), captured=setting(2.0, 2.1)),
        "7b": {"plain": setting(22.0, 22.5), "fixed-rows": setting(24.0, 24.0), "captured": setting(9.0, 9.5),
               "fixed-rows-captured": setting(10.0, 10.0), "build_seconds": 3.0},
        "1.5b": dict(plain=setting(19.0, 19.5)),  # no exact setting measured: no cost model
    })
    costs = pair_costs(report)
    assert set(costs) == {"7b-0.5b-captured", "7b-0.5b-eager"}
    assert costs["7b-0.5b-captured"] == dict(target_forward={1: 0.010, 2: 0.010}, draft_forward=0.002, head_call=0.0,
                                             alone_ms=9.0)
    assert costs["7b-0.5b-eager"]["draft_forward"] == 0.015 and costs["7b-0.5b-eager"]["alone_ms"] == 22.0


def test_layer_draft_is_the_targets_first_layers():
    from modeling_pacer.benchmarks.device import layer_draft

    target = random_model("tiny", torch.float32)
    draft = layer_draft(target, 1)
    assert len(draft.model.layers) == 1 and draft.config.num_hidden_layers == 1 and len(target.model.layers) == 2
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    assert draft.model.layers[0].mlp.up_proj.weight.data_ptr() != target.model.layers[0].mlp.up_proj.weight.data_ptr()
    noisy = layer_draft(target, 1, noise=0.3)
    assert not torch.equal(noisy.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    ids = torch.zeros(1, 5, dtype=torch.long)
    assert draft(input_ids=ids).logits.shape == target(input_ids=ids).logits.shape
