"""pacer-bench's opt-in `llama.cpp` method: chosen only by name, a clear usage error before any model loads
when llama-cpp-python is missing, its output reported with its own numerics (never a mismatch), and (where
llama-cpp-python and the default pair's GGUF are on the machine) a short real greedy run."""

import copy
import inspect
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from modeling_pacer.benchmarks import llamacpp, runner
from modeling_pacer.benchmarks.methods import all_methods, run_method, select_methods
from modeling_pacer.benchmarks.report import markdown_table, summarize, write_report
from modeling_pacer.pairs.registry import GGUFParts, ModelSource, cache_root, gguf_path
from modeling_pacer.replay import CostModel

from conftest import VOCAB, make_pair

NEW = 12
REAL_GGUF = cache_root() / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))


def test_default_selection_excludes_it_naming_it_selects_it(fake_llama_cpp):
    available = all_methods()
    assert "llama.cpp" in available and available["llama.cpp"].family == "llamacpp"
    assert "llama.cpp" not in [m.name for m in select_methods(None, available)]
    assert "llama.cpp" not in [m.name for m in select_methods([], available)]
    assert [m.name for m in select_methods(["target", "llama.cpp"], available)] == ["target", "llama.cpp"]
    assert [m.name for m in select_methods(["llama.cpp-l*"], available)] == ["llama.cpp-lookup"]


def test_missing_library_is_a_clear_error_at_selection(no_llama_cpp):
    with pytest.raises(ImportError, match=r'pip install -e "\.\[llamacpp\]"'):
        select_methods(["target", "llama.cpp"], all_methods())
    assert isinstance(pytest.raises(ValueError, llamacpp.require_llama_cpp).value, ImportError)
    select_methods(None, all_methods())  # not chosen: nothing to import


def test_missing_library_fails_pacer_bench_before_any_model_loads(no_llama_cpp, monkeypatch, capsys, tmp_path):
    from modeling_pacer.benchmarks import cli

    monkeypatch.setattr("modeling_pacer.pairs.loading.load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--quick", "--methods", "target", "llama.cpp", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert 'pip install -e ".[llamacpp]"' in capsys.readouterr().err


def test_a_target_without_gguf_fails_before_any_model_loads(fake_llama_cpp, monkeypatch, capsys, tmp_path):
    from modeling_pacer.benchmarks import cli

    if "check_target_args" not in inspect.getsource(cli.validate):
        pytest.skip("cli.validate does not call llamacpp.check_target_args yet (then the error comes after loading)")
    monkeypatch.setattr("modeling_pacer.pairs.loading.load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--target", "org/big", "--draft", "org/small", "--methods", "target", "llama.cpp",
                  "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "llama.cpp needs the target as a GGUF file" in capsys.readouterr().err


def test_where_the_gguf_is(tmp_path):
    local = tmp_path / "model" / "m-q4_k_m.gguf"
    local.parent.mkdir()
    local.write_bytes(b"GGUF")
    source = ModelSource.from_string(local)
    assert llamacpp.target_gguf(source) == local
    llamacpp.check_target(source)
    for source in (ModelSource(path="org/big"), ModelSource(path=str(tmp_path), gguf_file="absent.gguf")):
        with pytest.raises(ValueError, match="llama.cpp needs the target as a GGUF file"):
            llamacpp.target_gguf(source)
        with pytest.raises(ValueError, match="llama.cpp needs the target as a GGUF file"):
            llamacpp.check_target(source)
    # a registered pair's: the assembled file in the pacer cache, else its parts (the error names the command)
    parts = GGUFParts("x.gguf", "no-such-part{i}", "no_such_part{i}", "0.1", 2, "0" * 64)
    with pytest.raises(ValueError, match="pacer-pairs install"):
        llamacpp.check_target(ModelSource(parts=parts), tmp_path / "cache")
    gguf_path(parts, tmp_path / "cache").parent.mkdir(parents=True)
    gguf_path(parts, tmp_path / "cache").write_bytes(b"GGUF")
    llamacpp.check_target(ModelSource(parts=parts), tmp_path / "cache")


class FakeRunner:
    """Stands in for LlamaCppRunner: the target's greedy output with its last token changed (from a copy of
    the target, which the benchmark's forward meters do not see, as they do not see llama.cpp)."""

    def __init__(self, target):
        self.target, self.calls = copy.deepcopy(target), 0

    def generate(self, input_ids, max_new_tokens):
        self.calls += 1
        out = target_generate(self.target, input_ids, max_new_tokens).clone()
        out[0, -1] = (out[0, -1] + 1) % VOCAB
        return out


def target_generate(target, input_ids, max_new_tokens):
    from transformers import GenerationMixin

    return GenerationMixin.generate(target, input_ids, max_new_tokens=max_new_tokens, do_sample=False)


@pytest.fixture(scope="module")
def pair():
    target, draft = make_pair("llama", "llama", "noisy")
    return types.SimpleNamespace(target=target, draft=draft)


def test_run_live_records_own_numerics_never_a_mismatch(pair, fake_llama_cpp, tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = [("toy", str(i), torch.randint(0, VOCAB, (1, 5 + 2 * i), generator=g)) for i in range(2)]
    methods = select_methods(["target", "fixed-2", "llama.cpp"], all_methods())
    fake = FakeRunner(pair.target)
    records, traces = runner.run_live(pair, None, methods, prompts, NEW, llamacpp=fake)
    assert fake.calls == 1 + len(prompts)  # the warm-up, then each prompt once
    by_method = {m.name: [r for r in records if r.method == m.name] for m in methods}
    assert all(r.matches_target is True and r.agree_prefix == NEW for r in by_method["target"] + by_method["fixed-2"])
    for r in by_method["llama.cpp"]:
        assert r.matches_target is None and r.agree_prefix == NEW - 1 and r.new_tokens == NEW
        assert r.target_forwards == 0 and r.draft_forwards == 0
    costs = CostModel({n: 1.0 + 0.1 * n for n in range(1, 10)}, 0.2)
    report = write_report(tmp_path, [r.to_dict() for r in records], runner.oracle_records(traces, costs, 8),
                          dict(command="test"))
    assert "own numerics (n/a)" in report["table"] and "MISMATCH" not in report["table"]
    row = next(r for r in report["summary"] if r["method"] == "llama.cpp" and r["dataset"] == "all")
    assert row["mismatches"] == 0 and row["own_numerics"] and row["agree_prefix"] == NEW - 1
    assert row["tokens_per_s"] > 0 and row["tau"] is None and row["of_oracle"] is None
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {r["matches_target"] for r in saved["records"] if r["method"] == "llama.cpp"} == {None}


def test_run_method_and_run_live_need_a_runner_and_a_gguf(pair):
    method = all_methods()["llama.cpp"]
    with pytest.raises(ValueError, match="needs a LlamaCppRunner"):
        run_method(method, pair.target, pair.draft, None, torch.zeros(1, 3, dtype=torch.long), 4)
    not_gguf = types.SimpleNamespace(target=pair.target, draft=pair.draft, name="x",
                                     target_source=ModelSource(path="org/big"))
    with pytest.raises(ValueError, match="llama.cpp needs the target as a GGUF file"):
        runner.run_live(not_gguf, None, [all_methods()["target"], method],
                        [("toy", "0", torch.zeros(1, 3, dtype=torch.long))], 4)


def _record(method, prompt_id, seconds, matches, **extra):
    return dict(dataset="d", prompt_id=prompt_id, method=method, seconds=seconds, new_tokens=8, target_forwards=8,
                draft_forwards=0, matches_target=matches, head_seconds=0.0, draft_lengths=[], accepted=[], **extra)


def test_report_and_merge_with_a_none_match_row_and_old_records(tmp_path):
    from modeling_pacer.benchmarks.cli import main

    # old records (no agree_prefix, no forward times) beside a llama.cpp record
    records = [_record("target", "0", 4.0, True), _record("llama.cpp", "0", 1.0, None, agree_prefix=5)]
    rows = {(r["dataset"], r["method"]): r for r in summarize(records, [])}
    assert rows[("d", "target")]["agree_prefix"] is None and rows[("d", "llama.cpp")]["agree_prefix"] == 5
    assert rows[("d", "llama.cpp")]["tokens_per_s"] == 8.0 and rows[("d", "llama.cpp")]["speedup"] == 4.0
    table = markdown_table(list(rows.values()))
    assert "| d | llama.cpp | 4.00x | 8.00 | – | – | – | – | – | own numerics (n/a) |" in table
    assert "| d | target | 1.00x | 2.00 | 1.00 | 1.00 | 0.00 | 0.0% | – | yes |" in table
    paths = []
    for part, prompt_id in (("a", "0"), ("b", "1")):
        rs = [dict(r, prompt_id=prompt_id) for r in records]
        oracle = [dict(dataset="d", prompt_id=prompt_id, method="oracle", seconds=2.0, target_alone_seconds=4.0,
                       draft_lengths=[2], accepted=[2], new_tokens=8)]
        write_report(tmp_path / part, rs, oracle, dict(command=part))
        paths.append(str(tmp_path / part / "results.json"))
    assert main(["merge", *paths, "--out", str(tmp_path / "all")]) == 0  # own numerics: not a failure
    merged = json.loads((tmp_path / "all" / "results.json").read_text())
    row = next(r for r in merged["summary"] if r["method"] == "llama.cpp" and r["dataset"] == "all")
    assert row["prompts"] == 2 and row["mismatches"] == 0 and row["own_numerics"]


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"the default pair's GGUF is not at {REAL_GGUF}")
def test_real_greedy_run_on_the_default_target():
    pytest.importorskip("llama_cpp")
    eos = [151645, 151643]  # Qwen2.5-Coder-Instruct's <|im_end|>, <|endoftext|>
    engine = llamacpp.LlamaCppRunner(REAL_GGUF, n_ctx=64, eos_token_id=eos, n_threads=1)
    # Qwen2.5's token ids of "def fibonacci(n):" and "x = 1" (llama.cpp now runs in a child process)
    ids = torch.tensor([[750, 75698, 1445, 1648]])
    out = engine.generate(ids, 8)
    assert out[:, : ids.shape[1]].equal(ids) and ids.shape[1] < out.shape[1] <= ids.shape[1] + 8
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 8 or new[-1] in eos and not set(new[:-1]) & set(eos)
    other = torch.tensor([[87, 284, 220, 16]])
    assert engine.generate(other, 4).shape[1] <= other.shape[1] + 4  # another prompt in between
    assert engine.generate(ids, 8).equal(out)  # greedy, every call from an empty cache: the same output
    assert engine.generate(ids, 3).equal(out[:, : ids.shape[1] + 3]) or out.shape[1] < ids.shape[1] + 3
    assert engine.generate(ids, 0).equal(ids)


CRASHING_LLAMA_CPP = '''
import os, signal

class Llama:
    """Loads, then dies with SIGILL on the first evaluation, as a native build with instructions the CPU
    lacks does."""

    def __init__(self, **kwargs):
        self._n_ctx = kwargs["n_ctx"]

    def n_ctx(self):
        return self._n_ctx

    def reset(self):
        pass

    def generate(self, prompt, **kwargs):
        os.kill(os.getpid(), signal.SIGILL)
        yield 0
'''


def test_a_crash_of_llama_cpp_is_a_reported_failure_not_a_dead_benchmark(pair, monkeypatch, tmp_path):
    """llama.cpp runs in a child process: a SIGILL there raises LlamaCppFailed naming the signal and the build
    flags, and run_live drops that method, keeps every other row and says why in `failures`."""
    (tmp_path / "llama_cpp.py").write_text(CRASHING_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned child gets this sys.path too
    # recorded whether or not it is there, so that the crashing module imported below leaves with the test (a
    # later test's importorskip once found it and ran llama.cpp's real tests where llama-cpp-python is absent)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    del sys.modules["llama_cpp"]
    crashing = llamacpp.LlamaCppRunner(tmp_path / "model.gguf", n_ctx=64, n_threads=1)
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(llamacpp.LlamaCppFailed, match=r"signal 4 \(SIGILL\).*GGML_NATIVE=OFF"):
        crashing.generate(ids, 4)
    with pytest.raises(llamacpp.LlamaCppFailed, match="SIGILL"):  # and says so again, without hanging
        crashing.generate(ids, 4)

    prompts = [("toy", str(i), torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(i)))
               for i in range(2)]
    methods = select_methods(["target", "fixed-2", "llama.cpp"], all_methods())
    failures = {}
    runner_ = llamacpp.LlamaCppRunner(tmp_path / "model.gguf", n_ctx=64, n_threads=1)
    records, _ = runner.run_live(pair, None, methods, prompts, NEW, llamacpp=runner_, failures=failures)
    assert list(failures) == ["llama.cpp"] and "SIGILL" in failures["llama.cpp"]
    assert sorted({r.method for r in records}) == ["fixed-2", "target"] and len(records) == 2 * len(prompts)
    report = write_report(tmp_path / "out", [r.to_dict() for r in records], [], dict(command="x", failed=failures))
    assert "**llama.cpp failed** (no rows): llama.cpp failed: its process died with signal 4 (SIGILL)" in report["table"]


def test_each_llama_cpp_method_gets_its_own_runner(pair, fake_llama_cpp, monkeypatch):
    """llama.cpp and its prompt-lookup decoding run in one benchmark, each on a runner of its own (built once, with
    the method's lookup setting, closed with the run), both reported with their own numerics."""
    built = []

    class Built(FakeRunner):
        def close(self):
            self.closed = True

    def for_pair(cls, pair_, prompts, max_new_tokens, pacer_cache=None, lookup=0):
        runner_ = Built(pair.target)
        built.append((lookup, runner_))
        return runner_

    monkeypatch.setattr(llamacpp.LlamaCppRunner, "for_pair", classmethod(for_pair))
    prompts = [("toy", "0", torch.tensor([[3, 1, 4, 1, 5, 3, 1]]))]
    methods = select_methods(["target", "llama.cpp", "llama.cpp-lookup"], all_methods())
    records, _ = runner.run_live(pair, None, methods, prompts, NEW)
    assert sorted(lookup for lookup, _ in built) == [0, 10]
    assert all(r.calls == 2 and r.closed for _, r in built)  # the warm-up and the prompt, then closed
    assert {r.method for r in records if r.matches_target is None} == {"llama.cpp", "llama.cpp-lookup"}


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"the default pair's GGUF is not at {REAL_GGUF}")
def test_real_prompt_lookup_run_on_the_default_target():
    """llama.cpp's prompt-lookup decoding gives llama.cpp's own greedy output (its verification is its greedy
    sampler's), on a prompt that repeats."""
    pytest.importorskip("llama_cpp")
    eos = [151645, 151643]
    ids = torch.tensor([[750, 75698, 1445, 1648, 750, 75698, 1445, 1648, 750]])
    plain = llamacpp.LlamaCppRunner(REAL_GGUF, n_ctx=64, eos_token_id=eos, n_threads=1)
    lookup = llamacpp.LlamaCppRunner(REAL_GGUF, n_ctx=64, eos_token_id=eos, n_threads=1, lookup=10)
    try:
        assert lookup.generate(ids, 12).equal(plain.generate(ids, 12))
    finally:
        plain.close()
        lookup.close()


class FakeBatchedRunner:
    """A batched runner standing in for llama.cpp: each row the target alone's greedy tokens, the last one changed
    (its own numerics); records the calls and that it was closed."""

    def __init__(self, target, sequences):
        self.target, self.sequences, self.calls, self.closed = target, sequences, [], False

    def generate_rows(self, prompts, max_new_tokens):
        self.calls.append([len(p) for p in prompts])
        assert len(prompts) <= self.sequences
        rows = []
        for p in prompts:
            ids = torch.tensor([p])
            new = target_generate(self.target, ids, max_new_tokens)[0, ids.shape[1]:].tolist()
            rows.append(new[:-1] + [(new[-1] + 1) % VOCAB])
        return rows

    def close(self):
        self.closed = True


def test_batch_bench_llama_cpp_rows_batched_with_their_own_numerics(pair, fake_llama_cpp, monkeypatch):
    """`pacer-bench batch --methods ... llama.cpp`: one batched runner a batch size (that many sequences, closed after
    it), every group's prompts given without their padding, its rows reported against the target alone with their
    own numerics: counted, not a failure of the run."""
    from modeling_pacer.benchmarks import batch
    from conftest import word_tokenizer

    built = []

    def for_pair(cls, pair_, prompts, max_new_tokens, pacer_cache=None, lookup=0, sequences=None):
        built.append(FakeBatchedRunner(pair_.target, sequences))
        return built[-1]

    monkeypatch.setattr(llamacpp.LlamaCppRunner, "for_pair", classmethod(for_pair))
    tokenizer = word_tokenizer()
    tokenizer.pad_token = "[0]"
    g = torch.Generator().manual_seed(1)
    prompts = [("toy", str(i), torch.randint(1, VOCAB, (1, 2 + 3 * i), generator=g)) for i in range(3)]
    bench_pair = types.SimpleNamespace(target=pair.target, draft=pair.draft, tokenizer=tokenizer)
    records, references = batch.run_batches(bench_pair, None, prompts, [1, 2], ["target", "llama.cpp"], 6)
    assert [r.sequences for r in built] == [1, 2] and all(r.closed for r in built)
    # B = 2: the warm-up's two groups (2 rows, then the last, 1 row), then the groups; each prompt without padding
    assert built[1].calls == [[2, 5], [8], [2, 5], [8]]
    ours = [r for r in records if r.method == "llama.cpp"]
    assert len(ours) == 3 + 2 and all(not any(r.matches_target) for r in ours)
    assert all(a == 5 for r in ours for a in r.agree_prefix) and all(n == 6 for r in ours for n in r.new_tokens)
    rows = batch.summarize_batches([r.to_dict() for r in records])
    assert [r["method"] for r in rows] == ["target", "llama.cpp"] * 2 and "llama.cpp" in batch.OWN_NUMERICS


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"the default pair's GGUF is not at {REAL_GGUF}")
def test_real_batched_run_on_the_default_target():
    """llama.cpp's batched decoding (every row's step in one llama_decode): each row ends on its own, a request is
    decoded from an empty cache (the same request twice gives the same rows), a row's length and EOS as the single
    runner's rules say (whether a row's bits depend on its neighbours is llama.cpp's kernels' choice: not asserted)."""
    pytest.importorskip("llama_cpp")
    eos = [151645, 151643]
    engine = llamacpp.LlamaCppRunner(REAL_GGUF, n_ctx=64, eos_token_id=eos, n_threads=1, sequences=3)
    try:
        prompts = [[750, 75698, 1445, 1648], [87, 284, 220, 16], [750]]
        rows = engine.generate_rows(prompts, 8)
        assert len(rows) == 3
        for row in rows:
            assert 0 < len(row) <= 8 and (len(row) == 8 or row[-1] in eos) and not set(row[:-1]) & set(eos)
        assert engine.generate_rows(prompts, 8) == rows
        assert len(engine.generate_rows(prompts[:1], 3)[0]) <= 3  # fewer rows than sequences
        with pytest.raises(ValueError, match="decodes 3 sequences together; got 4"):
            engine.generate_rows(prompts + prompts[:1], 4)
        with pytest.raises(ValueError, match="decodes by generate_rows"):
            engine.generate(torch.tensor([prompts[0]]), 4)
    finally:
        engine.close()


def test_llama_costs_refused_without_the_library_before_any_work(no_llama_cpp, capsys, tmp_path):
    from modeling_pacer.benchmarks import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["llama-costs", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and 'pip install -e ".[llamacpp]"' in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_llama_costs_writes_each_gguf_curve_with_its_ratios(fake_llama_cpp, monkeypatch, tmp_path):
    """`pacer-bench llama-costs`: the target's and the draft's GGUF timed (here a stand-in for the timing), the table
    in ms with each size's ratio to one token."""
    from modeling_pacer.benchmarks import cli

    timed = []

    def fake_costs(path, sizes, n_threads=None, prefix=128, repeats=5):
        timed.append((Path(path).name, tuple(sizes), repeats))
        return {n: 0.010 * (1 + 0.5 * (n - 1)) for n in sizes}

    monkeypatch.setattr(llamacpp, "llama_cpp_costs", fake_costs)
    monkeypatch.setattr(llamacpp, "target_gguf", lambda source, pacer_cache=None, pair_name=None: tmp_path / "t.gguf")
    monkeypatch.setattr("modeling_pacer.pairs.gguf.source_gguf",
                        lambda source, pacer_cache=None, pair_name=None: tmp_path / "d.gguf")
    monkeypatch.setattr(llamacpp, "check_target_args", lambda args, draft=False: None)
    assert cli.main(["llama-costs", "--sizes", "1", "4", "--repeats", "2", "--out", str(tmp_path / "out")]) == 0
    assert timed == [("t.gguf", (1, 4), 2), ("d.gguf", (1, 4), 2)]
    table = (tmp_path / "out" / "llama-costs.md").read_text()
    assert "| target (t.gguf) | 10.0 (1.00x) | 25.0 (2.50x) |" in table and "| draft (d.gguf) |" in table
    saved = json.loads((tmp_path / "out" / "llama-costs.json").read_text())
    assert saved["curves"]["target"]["4"] == pytest.approx(0.025)


def test_llama_cpp_costs_refuses_sizes_that_cannot_be_timed(fake_llama_cpp):
    with pytest.raises(ValueError, match="must be positive"):
        llamacpp.llama_cpp_costs("x.gguf", sizes=(0, 2))
    with pytest.raises(ValueError, match="must be positive"):
        llamacpp.llama_cpp_costs("x.gguf", repeats=0)


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"the default pair's GGUF is not at {REAL_GGUF}")
def test_real_llama_cpp_costs_on_the_default_target():
    pytest.importorskip("llama_cpp")
    curve = llamacpp.llama_cpp_costs(REAL_GGUF, sizes=(1, 2), n_threads=2, prefix=16, repeats=1)
    assert set(curve) == {1, 2} and all(seconds > 0 for seconds in curve.values())
