"""What of the GPU path can be checked without a GPU: every tensor the cost model makes follows the device and dtype
of the model that reads it (checked on `meta`, where a tensor made on the CPU is refused as it would be on CUDA),
every clock waits for the models' devices through one function, pacer's CPU kernels refuse a tensor elsewhere with
a clear error, and every check of `generate` runs before the cost measurement. The CUDA tests are in tests/gpu/."""

import pytest
import torch

import modeling_pacer.costs as costs
from modeling_pacer import CostModel, ExpectedThroughput
from modeling_pacer.custom_generate import generate as loop
from modeling_pacer.custom_generate.policies import DraftView, OnlineCalibration

from conftest import make_head, make_model, make_pair

PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.fixture
def synced(monkeypatch):
    """The devices `torch.accelerator.synchronize` was asked to wait for."""
    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append(torch.device(device)))
    return calls


def test_the_clock_waits_for_accelerators_only(synced):
    clock = costs.device_clock("cpu", "meta", torch.device("cuda", 0), "cuda:0", "cuda:1")
    clock()
    assert synced == [torch.device("cuda", 0), torch.device("cuda", 1)]  # each device once, no CPU or meta
    synced.clear()
    costs.interleaved_medians([lambda: None, lambda: None], repeats=2, clock=clock)
    # two devices at every reading: each call's start, and its end but in the warm-up round (whose end the next
    # start waits for)
    assert len(synced) == 2 * (2 + 2 * 2 * 2)


def test_the_loop_timer_waits_for_the_device_of_the_model_it_times(synced):
    stats = loop.PacerStats()
    with loop._Timer(stats, "draft", torch.device("cpu")):
        pass
    assert synced == []
    with loop._Timer(stats, "draft", torch.device("cuda", 1)):
        pass
    assert synced == [torch.device("cuda", 1)] * 2 and stats.draft_time >= 0


def test_cost_model_follows_the_models_device_and_dtype():
    """On `meta` a tensor made on the CPU is refused as on CUDA: the head's probe input was made there (the bug a
    GPU user met). Models and a head on meta, the head in bf16 with draft features: the curve is measured (its
    seconds mean nothing on meta) and every clock reading goes through the models' devices."""
    target, draft = (make_model("qwen2", seed=s).to("meta") for s in (1, 2))
    head = make_head(make_model("qwen2", seed=2), use_draft_features=True, max_draft_length=4).to("meta", torch.bfloat16)
    prefix = costs.fixed_prefix(target, 16, draft)
    assert prefix.device.type == "meta"
    curve = costs.measure_costs(target, draft, head, prefix, max_tokens=3, repeats=1)
    assert sorted(curve.target_forward) == [1, 2, 3] and curve.head_call >= 0.0
    assert costs.model_devices(target, None, head) == (torch.device("meta"),)


def test_cost_prefix_uses_ids_every_model_embeds():
    """A draft whose vocabulary stops short of the target's padded one (Qwen2.5-7B's 152064 against 0.5B's 151936):
    the fixed prefix stays inside both."""
    target, draft = make_model("llama", seed=1, vocab=97), make_model("llama", seed=2, vocab=50)
    prefix = costs.fixed_prefix(target, 128, draft)
    assert int(prefix.max()) < 50 and int(costs.fixed_prefix(target, 128).max()) >= 50


def test_cost_cache_key_names_the_accelerator(monkeypatch):
    model = make_model("llama", seed=1)
    assert "device_name" not in costs.describe_model(model)  # a CPU's key is what it was
    monkeypatch.setattr(costs, "device_name", lambda device: "NVIDIA H200")
    assert costs.describe_model(model)["device_name"] == "NVIDIA H200"


def test_online_calibration_reads_estimates_of_any_device_and_dtype():
    """The fit lives on the CPU in float64; the rule hands it the draft's probabilities as they come (on the GPU,
    in the model's dtype)."""
    rule = ExpectedThroughput(CostModel({n: 1.0 for n in range(1, 10)}, 0.1), calibration=4.0, max_draft_length=8)
    view = DraftView(torch.tensor([0.9, 0.8, 0.3], dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))
    rule.reset()
    assert rule.stop_reason(view) in (None, "throughput")
    rule.update(view, 2)
    fit = OnlineCalibration()
    p = fit.probability(torch.zeros(2, 1, dtype=torch.bfloat16))
    assert p.dtype == torch.float64 and p.device.type == "cpu"


def test_pacer_kernels_refuse_tensors_off_the_cpu():
    """A model pacer quantized or fused for the CPU, then moved: a clear error naming the way out, never a raw pointer
    to device memory handed to the CPU kernels."""
    from modeling_pacer.cpu import kernels
    from modeling_pacer.cpu.quantization import Int4Linear, Int8Linear

    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    for quantized in (Int4Linear.from_linear(layer), Int8Linear.from_linear(layer)):
        moved = quantized.to("meta")
        with pytest.raises(RuntimeError, match="run on the CPU only.*quantize_draft=False.*tensor on meta"):
            moved(torch.zeros(1, 64, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(RuntimeError, match="tensor on meta"):
        kernels.require_cpu(torch.zeros(1), None, torch.zeros(1, device="meta"))
    kernels.require_cpu(torch.zeros(1), None)
    if kernels.available():
        with pytest.raises(RuntimeError, match="tensor on meta"):
            kernels.QuantizedRows(torch.zeros(1, 64, device="meta"), block=32)


def test_load_pair_refuses_a_cpu_quantization_on_a_gpu_before_loading(monkeypatch):
    from modeling_pacer.pairs import load_pair

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr("modeling_pacer.pairs.loading.load_model", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(ValueError, match="quantize_draft='int4' runs on the CPU only.*quantize_draft=False"):
        load_pair(device_map="cuda", quantize_draft="int4")


@pytest.fixture
def no_measurement(monkeypatch):
    """Fails the test if a cost curve is measured or read."""
    monkeypatch.setattr(costs, "host_costs", lambda *a, **k: pytest.fail("costs measured before the checks"))


@pytest.mark.parametrize("bad, message", [("batch", "padded on the right"), ("empty", "input_ids is empty"),
                                          ("prefilled", "needs an empty cache"), ("vocabulary", "vocabulary"),
                                          ("recurrent", "LinearAttentionLayer")])
def test_every_check_runs_before_the_cost_measurement(no_measurement, monkeypatch, bad, message):
    """A head whose default rule is cost-aware and no curve: a bad call is refused before anything is measured and
    before any forward of the loop."""
    from transformers import DynamicCache, MambaConfig, MambaForCausalLM

    from modeling_pacer import enable_pacer

    target, draft = make_pair("llama", "llama", "noisy")
    ids, kwargs = PROMPT, {}
    if bad == "batch":  # a right-padded batch
        ids, kwargs = PROMPT.repeat(2, 1), {"attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]),
                                            "pad_token_id": 0}
    elif bad == "empty":
        ids = PROMPT[:, :0]
    elif bad == "prefilled":
        cache = DynamicCache(config=target.config)
        target(input_ids=PROMPT[:, :2], use_cache=True, **loop.cache_kwargs(target, cache))  # the name this version takes
        kwargs["past_key_values"] = cache
    elif bad == "recurrent":  # a state-space model: its cache cannot be rolled back after a rejected draft
        config = MambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=2)
        target, draft = enable_pacer(MambaForCausalLM(config).eval()), MambaForCausalLM(config).eval()
    else:
        draft = make_model("llama", seed=2, vocab=50)
    head = make_head(draft, stopping_rule="throughput", throughput_estimate="draft")
    for name in ("model_forward", "rows_forward"):
        monkeypatch.setattr(loop, name, lambda *a, **k: pytest.fail("a forward ran before the checks"))
    with pytest.raises(ValueError, match=message):
        target.generate(ids, assistant_model=draft, pacer_head=head, max_new_tokens=4, **kwargs)


def test_head_checks_a_draft_longer_than_it_reads_without_reading_a_tensor():
    head = make_head(make_model("llama", seed=2), max_draft_length=4)
    head.acceptance_probabilities(torch.zeros(1, 4, 32))
    with pytest.raises(ValueError, match="a draft of 5 tokens is beyond the head's max_draft_length"):
        head.acceptance_probabilities(torch.zeros(1, 5, 32))
