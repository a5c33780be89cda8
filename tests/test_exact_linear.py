"""Row invariance measured where it runs (modeling_pacer/cpu/exact_linear.py): the probe finds the row counts in
which a layer computes each row alike, every call is padded or chunked into that range, and so a row's result
depends on the row alone, whether it comes as a decoding step, a verification block or a 300-token prefill.

The property is checked on whatever CPU runs the tests, with the host's own probed ranges, and with each layer
kept to the bottom 4 row counts of its probed range (`narrow_rows`), so that the padded and chunked paths run
on every host, including one where the kernels happen to agree on every size probed."""

import copy

import pytest
import torch
from transformers import DynamicCache

from modeling_pacer import FixedLength, enable_pacer, exact_linears, make_exact
from modeling_pacer.custom_generate.generate import model_forward
from modeling_pacer.cpu.exact_linear import RowRange, choose_range, host_row_range, row_runs
from modeling_pacer.cpu.quantization import Int4Linear, Int8Linear

from conftest import VOCAB, make_model, narrow_rows

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# the default target's (Qwen2.5-1.5B) linear shapes: q/o, k/v, MLP up/gate, MLP down, a slice of the LM head
SHAPES = [(1536, 1536), (1536, 256), (1536, 8960), (8960, 1536), (1536, 4096)]
# what a prefill feeds: every count up to well past any chunk, then prompt-sized calls
COUNTS = list(range(1, 49)) + [64, 100, 128, 200, 256, 300]


def test_chunks_cover_the_rows_inside_the_range():
    span = RowRange(4, 8)
    assert span.chunks(3) == [(0, 3, 4)]
    assert span.chunks(8) == [(0, 8, 8)]
    assert span.chunks(19) == [(0, 8, 8), (8, 8, 8), (16, 3, 4)]
    assert span.chunks(21) == [(0, 8, 8), (8, 8, 8), (16, 5, 5)]
    with pytest.raises(ValueError, match="lo <= hi"):
        RowRange(5, 4)


class SwitchingLinear(torch.nn.Linear):
    """A layer whose kernel sums in another order from 9 rows on (row by row, one matrix-vector product of one
    shape each, so invariant but for the switch)."""

    def forward(self, x):
        w = self.weight
        if x.shape[0] < 9:
            return torch.stack([w @ row for row in x])
        return torch.stack([w.flip(-1) @ row.flip(-1) for row in x])  # the same sums, added in another order


def test_row_runs_find_where_a_kernel_changes_path():
    """The probe splits 1..8 from 9..16, and the choice takes the run that starts lowest among the long enough
    ones; where no two sizes agree there is no range (one row per call)."""
    runs = row_runs(SwitchingLinear(256, 64, bias=False), max_rows=16)
    assert runs == [RowRange(1, 8), RowRange(9, 16)]
    assert choose_range(runs) == RowRange(1, 8)
    assert choose_range([RowRange(1, 1), RowRange(2, 3), RowRange(4, 40)]) == RowRange(4, 40)
    assert choose_range([RowRange(m, m) for m in range(1, 9)]) is None


def _rows_alone_equal_rows_in_calls(layer, fan_in, dtype, counts):
    """Every row of calls of each count in `counts` is bitwise the row fed alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(counts), fan_in, generator=g).to(dtype)
    with torch.no_grad():
        alone = torch.cat([layer(x[j:j + 1]) for j in range(x.shape[0])])
        for m in counts:
            assert torch.equal(layer(x[:m]), alone[:m]), m


@pytest.mark.parametrize("narrow", [False, True], ids=["probed", "narrow"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_linear_rows_do_not_depend_on_the_call_on_real_shapes(dtype, narrow):
    """The default target's linear shapes, calls of 1..48 rows and prefill-sized ones up to 300, with 2 threads
    (how pacer-bench runs): row for row what the row alone gives, with this host's probed ranges and forced."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for fan_in, fan_out in SHAPES:
            torch.manual_seed(0)
            layer = exact_linears(torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out)).to(DTYPES[dtype]))
            layer = (narrow_rows(layer) if narrow else layer)[0]
            counts = COUNTS if fan_in * fan_out <= 1536 * 4096 else COUNTS[:48] + [100, 300]
            _rows_alone_equal_rows_in_calls(layer, fan_in, DTYPES[dtype], counts)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear], ids=["int4", "int8"])
def test_packed_kernels_rows_do_not_depend_on_the_call(kind):
    """pacer's int4/int8 weight layers (the 4-bit target's, the int4 draft's) are probed and chunked alike."""
    for fan_in, fan_out in [(1536, 256), (8960, 1536)]:
        torch.manual_seed(0)
        layer = exact_linears(torch.nn.Sequential(kind.from_linear(torch.nn.Linear(fan_in, fan_out))))[0]
        _rows_alone_equal_rows_in_calls(layer, fan_in, torch.bfloat16, list(range(1, 41)) + [100])
        assert host_row_range(layer) is not None


def test_the_probe_is_cached_per_host_and_layer(tmp_path):
    layer = torch.nn.Linear(32, 48).to(torch.bfloat16)
    first = host_row_range(layer, folder=tmp_path, refresh=True)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    assert host_row_range(layer, folder=tmp_path) == first
    previous = torch.get_num_threads()
    torch.set_num_threads(previous + 1)  # another thread count splits the work otherwise: probed again
    try:
        host_row_range(layer, folder=tmp_path)
    finally:
        torch.set_num_threads(previous)
    assert len(list(tmp_path.glob("*.json"))) == 2


def _prefill_vs_steps(model, ids, split):
    """Logits of `ids` `(1, L)` as one prefill, against a prefill of `split` tokens then one token a step."""
    with torch.no_grad():
        whole = model_forward(model, ids, DynamicCache(config=model.config), ids.shape[1])[0]
        cache = DynamicCache(config=model.config)
        parts = [model_forward(model, ids[:, :split], cache, split)[0]]
        parts += [model_forward(model, ids[:, i:i + 1], cache, 1)[0] for i in range(split, ids.shape[1])]
    return whole, torch.cat(parts, dim=1)


@pytest.mark.parametrize("narrow", [False, True], ids=["probed", "narrow"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_long_prefill_is_bitwise_the_steps(arch, dtype, narrow):
    """A 60-token prompt (longer than any chunk of a narrowed range, so its prefill is chunked) gives in one
    forward bitwise the logits of a short prefill followed by single-token steps."""
    model = make_exact(make_model(arch, seed=1).to(DTYPES[dtype]))
    model = narrow_rows(model) if narrow else model
    ids = torch.randint(0, VOCAB, (1, 60), generator=torch.Generator().manual_seed(2))
    for split in (1, 5, 37):
        whole, steps = _prefill_vs_steps(model, ids, split)
        assert torch.equal(whole, steps), (arch, dtype, split)


@pytest.mark.parametrize("narrow", [False, True], ids=["probed", "narrow"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_transformers_assisted_generation_is_the_target_alone(dtype, narrow):
    """transformers' own assisted generation feeds the prompt and its first candidates in one forward, then
    blocks of up to 20 candidates: with an exact target (prompts longer than a narrowed range's chunk) its
    greedy output is token for token the target alone's, and so is PACER's."""
    target = make_exact(make_model("qwen2", seed=1).to(DTYPES[dtype]))
    target = enable_pacer(narrow_rows(target) if narrow else target)
    draft = make_model("qwen2", seed=1)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    g = torch.Generator().manual_seed(5)
    for n in (3, 19, 45):
        ids = torch.randint(0, VOCAB, (1, n), generator=g)
        expected = target.generate(ids, do_sample=False, max_new_tokens=40)
        draft.generation_config.num_assistant_tokens = 20
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        assisted = target.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=40)
        assert assisted.tolist() == expected.tolist(), (dtype, narrow, n)
        pacer = target.generate(ids, assistant_model=draft, stopping_policy=FixedLength(6), do_sample=False,
                                max_new_tokens=40)
        assert pacer.tolist() == expected.tolist(), (dtype, narrow, n)


def test_a_forced_range_pads_and_chunks(monkeypatch):
    """With a forced (4, 8), the wrapped layer's own forward sees only calls of 4..8 rows."""
    seen = []
    real = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: (seen.append(x.shape[0]), real(self, x))[1])
    layer = exact_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)), (4, 8))[0]  # binds the layer's own forward
    with torch.no_grad():
        for m in (1, 3, 8, 9, 19):
            assert layer(torch.randn(1, m, 16)).shape == (1, m, 8)
    assert seen == [4, 4, 8, 8, 4, 8, 8, 4]
