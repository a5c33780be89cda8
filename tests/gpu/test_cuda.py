"""pacer on a CUDA device: every method token for token the exact target's own greedy output in bf16 and float32, the
sampled distribution the target's, the exact probe at the Qwen2.5 shapes, the cost model measured there, streaming,
a batch's rows each the target's own output alone.
Skipped where CUDA is absent (CI); run on a lent GPU by tests/gpu/device-check.sh. `PACER_GPU_TESTS_DEVICE=cpu`
runs the same tests on the CPU (the tests' own logic, not the GPU's numerics)."""

import os

import pytest
import torch

from modeling_pacer import CostModel, ExpectedThroughput, make_exact
from modeling_pacer.costs import describe_model, host_costs

from conftest import make_head, make_pair

CUDA = torch.device(os.environ.get("PACER_GPU_TESTS_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 512  # more near-ties than the CPU tests' 97
PROMPT_LENGTHS = (1, 19, 57)
NEW_TOKENS = (1, 9, 48)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (1, n), generator=g).to(CUDA) for n in PROMPT_LENGTHS]


def _pair(dtype):
    """A tiny Qwen2 pair (hidden 256, 4 layers) on CUDA: the target made exact there, a noisy copy as the draft."""
    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=256, layers=4, vocab=VOCAB)
    target = make_exact(target.to(CUDA, dtype))
    return target, draft.to(CUDA, dtype)


def _methods(draft):
    from test_greedy import POLICIES

    head = make_head(draft).to(CUDA)
    # the default head's rule: cost-aware on the draft's probability, its costs measured here (on CUDA)
    default_rule = make_head(draft, stopping_rule="throughput", throughput_estimate="draft", max_draft_length=12,
                             use_draft_features=True, draft_prior=True).to(CUDA)
    methods = {name: dict(pacer_head=head, stopping_policy=make()) for name, make in POLICIES.items()}
    methods.update({
        "default head rule (costs measured on CUDA)": dict(pacer_head=default_rule),
        "throughput by name (costs measured on CUDA)": dict(stopping_policy="throughput"),
        "pacer block rule": dict(pacer_head=head, stopping_policy="pacer"),
        "transformers' assisted generation": dict(),
    })
    return methods


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_method_is_the_exact_target_on_cuda(dtype):
    target, draft = _pair(dtype)
    assert target._pacer_exact is not None, "no exact verification found on this device"
    failures, drafted = [], 0
    alone = {(i, new): target.generate(ids, max_new_tokens=new, do_sample=False)
             for i, ids in enumerate(_prompts()) for new in NEW_TOKENS}
    for name, kwargs in _methods(draft).items():
        for i, ids in enumerate(_prompts()):
            for new in NEW_TOKENS:
                want = alone[i, new]
                out = target.generate(ids, assistant_model=draft, max_new_tokens=new, do_sample=False,
                                      return_dict_in_generate=True, **kwargs)
                if not torch.equal(out.sequences, want):
                    failures.append((name, ids.shape[1], new))
                stats = getattr(out, "pacer_stats", None)
                if stats is not None:
                    assert stats.target_exact == target._pacer_exact
                    drafted += sum(s.drafted for s in stats.steps)
    assert not failures, f"{len(failures)} runs differ from the target alone: {failures[:10]}"
    assert drafted > 0


def test_sampled_distribution_is_the_targets_on_cuda():
    import test_sampling as s

    target, draft = make_pair("llama", "llama", "random", vocab=s.V)
    target_probs, draft_probs = s._exact_distribution(target), s._exact_distribution(draft)
    target, draft = target.to(CUDA), draft.to(CUDA)
    head = make_head(draft, max_draft_length=8).to(CUDA)
    for make in s.POLICIES.values():
        counts, drafted, accepted = {}, 0, 0
        for seed in range(s.RUNS):
            torch.manual_seed(seed)
            out = target.generate(s.PROMPT.to(CUDA), assistant_model=draft, pacer_head=head, stopping_policy=make(),
                                  return_dict_in_generate=True, **s.SETTINGS)
            outcome = tuple(out.sequences[0, s.PROMPT.shape[1]:].tolist())
            counts[outcome] = counts.get(outcome, 0) + 1
            drafted += sum(step.drafted for step in out.pacer_stats.steps)
            accepted += sum(step.accepted for step in out.pacer_stats.steps)
        assert 0 < accepted < drafted
        assert s._chi_square_p_value(counts, target_probs, s.RUNS) > 1e-3
        assert s._chi_square_p_value(counts, draft_probs, s.RUNS) < 1e-6


@pytest.mark.parametrize("shape", ["0.5b", "1.5b"])
def test_exact_verification_at_the_qwen_shapes(shape):
    """The done-when: rows of 1..16-token calls (and a prefill) bitwise those of single steps, on the exact target,
    checked after prefixes other than the ones make_exact chose by."""
    from modeling_pacer.benchmarks.device import random_model
    from modeling_pacer.exact import probe_exact

    model = make_exact(random_model(shape, torch.bfloat16, CUDA), verify_rows=16)
    assert model._pacer_exact is not None
    assert probe_exact(model, 16, prefixes=(5, 130, 611)) == 0.0


def test_cost_model_on_cuda():
    target, draft = _pair(torch.bfloat16)
    head = make_head(draft, use_draft_features=True).to(CUDA, torch.bfloat16)
    costs = host_costs(target, draft, head, max_tokens=9, refresh=True)
    assert all(t > 0 for t in costs.target_forward.values()) and costs.draft_forward > 0 and costs.head_call > 0
    if CUDA.type == "cuda":
        assert "NVIDIA" in describe_model(target)["device_name"]


def test_cpu_kernels_refuse_a_layer_moved_to_cuda():
    from modeling_pacer.cpu.quantization import Int4Linear

    if CUDA.type == "cpu":
        pytest.skip("the layer is on the CPU")
    layer = Int4Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16)).to(CUDA)
    with pytest.raises(RuntimeError, match="run on the CPU only"):
        layer(torch.zeros(1, 64, dtype=torch.bfloat16, device=CUDA))


def test_streaming_on_cuda():
    class Collect:
        def __init__(self):
            self.tokens = []

        def put(self, value):
            self.tokens.extend(value.flatten().tolist())

        def end(self):
            pass

    target, draft = _pair(torch.bfloat16)
    ids = _prompts()[1]
    streamer = Collect()
    costs = CostModel({n: 1.0 for n in range(1, 14)}, 0.1)
    out = target.generate(ids, assistant_model=draft, stopping_policy=ExpectedThroughput(costs), streamer=streamer,
                          max_new_tokens=30)
    assert streamer.tokens == out[0].tolist()


# captured steps: CUDA graphs over static caches (modeling_pacer.capture). "cudagraphs" records the eager kernels and
# compiles in seconds; inductor (capture's default, mode="reduce-overhead") fuses them and compiles for longer: one
# policy runs with it
CUDAGRAPHS = dict(fullgraph=True, dynamic=False, backend="cudagraphs")


def _captured_pair(dtype, backend):
    from transformers import CompileConfig

    from modeling_pacer import capture
    from modeling_pacer.gpu.fixed_rows import fixed_rows

    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=256, layers=4, vocab=VOCAB)
    target, draft = fixed_rows(target.to(CUDA, dtype), 16), draft.to(CUDA, dtype)
    config = CompileConfig(**CUDAGRAPHS) if backend == "cudagraphs" else CompileConfig(fullgraph=True, dynamic=False)
    return capture(target, compile_config=config), capture(draft, compile_config=config)


@pytest.mark.parametrize("backend, dtype", [("cudagraphs", torch.bfloat16), ("cudagraphs", torch.float32),
                                            ("inductor", torch.bfloat16)])
def test_captured_steps_are_the_target_alone_on_cuda(backend, dtype):
    """Every method with the target's and the draft's steps captured, token for token the captured exact target
    alone (plain decoding through the same fixed-row graph, over a static cache of the same size); drafts rejected
    and rolled back on the static caches; the steps really ran as graphs."""
    from modeling_pacer import captured_calls, new_cache

    target, draft = _captured_pair(dtype, backend)
    every = _methods(draft)  # a few of them: graphs are recorded per model, and the run has minutes
    names = ("fixed4", "svip", "pacer-b3", "throughput-draft", "throughput by name (costs measured on CUDA)")
    methods = {name: every[name] for name in (names if backend == "cudagraphs" else names[-1:])}
    failures, drafted, rejected = [], 0, 0
    for ids in _prompts():
        for new in NEW_TOKENS:
            alone = target.generate(ids, max_new_tokens=new, do_sample=False,
                                    past_key_values=new_cache(target, ids.shape[1] + new))
            for name, kwargs in methods.items():
                out = target.generate(ids, assistant_model=draft, max_new_tokens=new, do_sample=False,
                                      return_dict_in_generate=True, **kwargs)
                if not torch.equal(out.sequences, alone):
                    failures.append((name, ids.shape[1], new))
                drafted += sum(s.drafted for s in out.pacer_stats.steps)
                rejected += sum(s.drafted > s.accepted for s in out.pacer_stats.steps)
    assert not failures, f"{len(failures)} runs differ from the target alone: {failures[:10]}"
    assert drafted > 0 and rejected > 0
    assert captured_calls(target)["graph", 16] > 0 and captured_calls(draft)["graph", 1] > 0


def test_processors_shortcuts_are_transformers_scores_on_cuda():
    """top-p's and min_new_tokens' shortcuts (custom_generate/processing.py) give transformers' scores bit for bit on
    the device too: its sort's values, its softmax and cumulative sum."""
    from transformers import MinNewTokensLengthLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

    from modeling_pacer.custom_generate.processing import min_new_tokens, top_p

    ids = torch.tensor([[3, 17, 250]], device=CUDA)
    g = torch.Generator().manual_seed(0)
    for vocab in (1000, 151936):
        logits = (torch.randn(1, vocab, generator=g) * 4).to(CUDA)
        for row in (logits, logits.to(torch.bfloat16).float(), TopKLogitsWarper(40)(ids, logits)):
            for p in (0.5, 0.9, 0.95):
                warper = TopPLogitsWarper(p)
                assert torch.equal(top_p(warper, ids, row).view(torch.int32), warper(ids, row).view(torch.int32))
        processor = MinNewTokensLengthLogitsProcessor(1, 5, [2, 7], device=str(CUDA))
        assert torch.equal(min_new_tokens(processor, ids, logits), processor(ids, logits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_is_each_row_alone_on_cuda(dtype):
    """A left-padded batch of the prompts over the target made exact by rows alone on the device: each row token for
    token the target's own greedy output alone, for a fixed draft, the cost-aware rule and SVIP. Where make_exact chose
    a fixed row shape there, a batch is refused before any work (a packed call cannot keep that shape)."""
    from test_greedy import POLICIES

    from modeling_pacer import FixedLength
    from modeling_pacer.exact import exact_candidates, undo_exact

    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=256, layers=4, vocab=VOCAB)
    target, draft = target.to(CUDA, dtype), draft.to(CUDA, dtype)
    prompts = _prompts()
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=CUDA)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1]:], mask[row, width - p.shape[1]:] = p[0], 1
    attention = target.config._attn_implementation
    chosen = make_exact(target)._pacer_exact
    if chosen in ("fixed-rows", "fixed-rows-eager"):
        with pytest.raises(ValueError, match="fixed number of rows"):
            target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy="fixed", max_new_tokens=4,
                            pad_token_id=0)
    if chosen != "rows-alone":
        undo_exact(target, attention)
        exact_candidates(16)["rows-alone"](target)
    failures, drafted = [], 0
    for new in NEW_TOKENS:
        alone = [target.generate(p, max_new_tokens=new, do_sample=False, pad_token_id=0) for p in prompts]
        for name, policy in (("fixed-3", lambda: FixedLength(3)), ("throughput-draft", POLICIES["throughput-draft"]),
                             ("svip", POLICIES["svip"])):
            out = target.generate(ids, attention_mask=mask, assistant_model=draft, stopping_policy=policy(),
                                  max_new_tokens=new, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
            drafted += sum(s.drafted for s in out.pacer_stats.steps)
            for row, (p, want) in enumerate(zip(prompts, alone)):
                got = out.sequences[row, width:width + want.shape[1] - p.shape[1]]
                if got.tolist() != want[0, p.shape[1]:].tolist():
                    failures.append((name, new, row))
    assert not failures, f"{len(failures)} rows differ from the target alone: {failures[:10]}"
    assert drafted > 0
