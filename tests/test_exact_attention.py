"""`attn_implementation="pacer_exact"` (modeling_pacer/cpu/exact_attention.py): a k-token forward after a cached
prefix gives bitwise the logits of k single-token decoding steps, in bf16 and float32, so that verification
computes exactly what plain decoding computes; `sdpa` does not on a realistic shape; PACER's greedy output
with such a bf16 target is token for token the target's own."""

import copy

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import modeling_pacer
from modeling_pacer import FixedLength, enable_pacer
from modeling_pacer.custom_generate.generate import model_forward
from modeling_pacer.cpu.exact_attention import NAME
from modeling_pacer.cpu.exact_linear import exact_linears
from modeling_pacer.exact import make_exact

from conftest import VOCAB, make_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _mistral(seed: int, layers: int = 2, hidden: int = 32, sliding_window: int = 8):
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=sliding_window,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return MistralForCausalLM(config).eval()


def _model(arch: str, seed: int = 1):
    return _mistral(seed) if arch == "mistral-sw8" else make_model(arch, seed=seed)


def _block_and_steps(model, ids, prefix: int, max_k: int):
    """Logits of ids[prefix:prefix+k] fed as one block after a cached prefix, for k in 1..max_k, and of the
    same tokens fed one by one (the steps' logits for k are the first k of those for max_k)."""
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model_forward(model, ids[:, :prefix], cache, 1)
        steps_cache = copy.deepcopy(cache)
        steps = torch.cat([model_forward(model, ids[:, prefix + j:prefix + j + 1], steps_cache, 1)[0]
                           for j in range(max_k)], dim=1)
        blocks = {}
        for k in range(1, max_k + 1):
            block_cache = copy.deepcopy(cache)
            blocks[k] = model_forward(model, ids[:, prefix:prefix + k], block_cache, k)[0]
    return blocks, steps


def test_registered_by_importing_modeling_pacer():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert NAME == "pacer_exact"
    assert NAME in AttentionInterface._global_mapping and NAME in AttentionMaskInterface._global_mapping
    model = make_model("llama", seed=1)
    model.set_attn_implementation("pacer_exact")
    assert model.config._attn_implementation == "pacer_exact"
    assert modeling_pacer.cpu.exact_attention.exact_attention_forward is AttentionInterface._global_mapping[NAME]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sw8"])
def test_block_bitwise_equals_steps(arch, dtype):
    """(a) For k = 1..8 and prefixes shorter and longer than the sliding window, no tolerance."""
    model = make_exact(_model(arch).to(DTYPES[dtype]))
    assert model.config._attn_implementation == "pacer_exact"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 40), generator=g)
    for prefix in (1, 5, 13, 23):
        blocks, steps = _block_and_steps(model, ids, prefix, 8)
        for k, logits in blocks.items():
            assert torch.equal(logits, steps[:, :k]), (arch, dtype, prefix, k, (logits - steps[:, :k]).abs().max())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_attention_rows_bitwise_on_a_realistic_shape(dtype):
    """The attention function alone, on Qwen2-1.5B's attention shape (12 query heads, 2 key/value heads, head
    dim 128, 300 cached keys): each row of a block is bitwise the single-query call's output."""
    module = _attention_module()
    g = torch.Generator().manual_seed(0)
    past, k_max = 300, 8
    q = torch.randn(1, 12, k_max, 128, generator=g).to(DTYPES[dtype])
    key = torch.randn(1, 2, past + k_max, 128, generator=g).to(DTYPES[dtype])
    value = torch.randn(1, 2, past + k_max, 128, generator=g).to(DTYPES[dtype])
    fn = modeling_pacer.cpu.exact_attention.exact_attention_forward
    for k in range(1, k_max + 1):
        block, _ = fn(module, q[:, :, :k], key[:, :, :past + k], value[:, :, :past + k], None, scaling=128**-0.5)
        assert block.shape == (1, k, 12, 128)
        for i in range(k):
            step, _ = fn(module, q[:, :, i:i + 1], key[:, :, :past + i + 1], value[:, :, :past + i + 1], None,
                         scaling=128**-0.5)
            assert torch.equal(block[:, i], step[:, 0]), (dtype, k, i)


def _attention_module():
    class Attention(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 6

    return Attention()


def _realistic_qwen2(seed: int = 0):
    """Qwen2-1.5B's attention shape (hidden 1536, 12 heads, 2 key/value heads), one layer, a small MLP and vocab."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=1536, intermediate_size=64, num_hidden_layers=1, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval().to(torch.bfloat16)


def test_sdpa_is_not_invariant_but_pacer_exact_is_on_a_realistic_shape():
    """(b) The control: the same bf16 model, row-invariant linear layers, 300 cached tokens. With `sdpa` some
    block's logits differ from the steps' (so the comparison above can fail); with `pacer_exact` none does."""
    model = exact_linears(_realistic_qwen2())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 308), generator=g)
    model.set_attn_implementation("sdpa")
    blocks, steps = _block_and_steps(model, ids, 300, 8)
    assert any(not torch.equal(logits, steps[:, :k]) for k, logits in blocks.items())
    model.set_attn_implementation("pacer_exact")
    blocks, steps = _block_and_steps(model, ids, 300, 8)
    assert all(torch.equal(logits, steps[:, :k]) for k, logits in blocks.items())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sw8"])
def test_pacer_greedy_equals_bf16_target(arch):
    """(c) PACER with a bf16 `pacer_exact` target: token for token the same target's plain greedy `generate`."""
    target = enable_pacer(make_exact(_model(arch).to(torch.bfloat16)))
    draft = _model(arch)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    drafted = 0
    for n in (1, 6, 19):
        ids = torch.randint(0, VOCAB, (1, n), generator=g)
        for new in (7, 33):
            expected = target.generate(ids, do_sample=False, max_new_tokens=new)
            for policy in (FixedLength(3), FixedLength(8), "svip"):
                out = target.generate(ids, assistant_model=draft, stopping_policy=policy, do_sample=False,
                                      max_new_tokens=new, return_dict_in_generate=True)
                assert out.sequences.tolist() == expected.tolist(), (arch, n, new, policy)
                drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert drafted > 0


def test_padding_at_batch_size_1_is_refused():
    model = make_exact(make_model("llama", seed=1).to(torch.bfloat16))
    ids = torch.randint(0, VOCAB, (1, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    with torch.no_grad(), pytest.raises(ValueError, match="padding"):
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():  # an all-ones mask is no padding
        model(input_ids=ids, attention_mask=torch.ones_like(mask))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral-sw8"])
def test_left_padded_batch_is_each_sequence_alone(arch, dtype):
    """A left-padded batch (how pacer-train records many prompts at once) computes every sequence's logits
    bitwise as that sequence alone does, so batched greedy generation is each prompt's own greedy output."""
    model = make_exact(_model(arch).to(DTYPES[dtype]))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 11, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate derives them from the mask
        batched = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14, pad_token_id=0)
        for row, p in enumerate(prompts):
            alone = model(input_ids=p[None]).logits[0]
            assert torch.equal(batched[row, width - len(p):], alone), (arch, dtype, row)
            expected = model.generate(p[None], do_sample=False, max_new_tokens=14, pad_token_id=0)[0, len(p):]
            assert out[row, width:].tolist() == expected.tolist(), (arch, dtype, row)


def test_a_batch_that_is_not_left_padded_is_refused():
    model = make_exact(make_model("llama", seed=1))
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad(), pytest.raises(ValueError, match="after left padding"):
        model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]))


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_exact_linears_rows_do_not_depend_on_the_row_count(dtype, threads):
    """The CPU-kernel property `exact_linears` relies on, on Qwen2-1.5B's linear shapes (q/o, k/v, MLP up and
    down, a slice of the LM head): row j of a call with M rows is bitwise row j of a call with 16 rows (and
    of the row fed alone), for M = 1..16, with this process's thread count and with 2 threads."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for fan_in, fan_out in [(1536, 1536), (1536, 256), (1536, 8960), (8960, 1536), (1536, 4096)]:
            torch.manual_seed(0)
            lin = exact_linears(torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out)).to(DTYPES[dtype]))[0]
            x = torch.randn(1, 16, fan_in, generator=g).to(DTYPES[dtype])
            with torch.no_grad():
                full = lin(x)
                alone = torch.cat([lin(x[:, j:j + 1]) for j in range(16)], dim=1)
                assert torch.equal(alone, full), (dtype, fan_in, fan_out)
                for m in range(1, 16):
                    assert torch.equal(lin(x[:, :m]), full[:, :m]), (dtype, fan_in, fan_out, m)
    finally:
        torch.set_num_threads(previous)
