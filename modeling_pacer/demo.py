"""The pacer Space: watch PACER decide, side by side with the target alone.

The two generations run one after the other (the method first, then the target alone), each streaming as it
goes, so that each side's tokens/s is what it makes with the machine to itself. PACER's text shows how
every token came: drafted and accepted, drafted and rejected (struck through), or the target's own.

    pacer-demo                                     # the default pair, on localhost
    pacer-demo --target org/big --draft org/small --head org/pacer-head-...
    python demo/app.py                             # as a Hugging Face Space (settings from PACER_* variables)
"""

import argparse
import collections
import functools
import html
import logging
import os
import threading
import time
from dataclasses import dataclass, field

import gradio as gr
import pandas as pd
import torch
from transformers import GenerationMixin, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from modeling_pacer import SVIP, FixedLength, PacerHead
from modeling_pacer.custom_generate.generate import generate as pacer_generate

EXAMPLES = {
    "code": "Write a Python function `is_palindrome(s)` that ignores case and non-alphanumeric characters.",
    "maths": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?",
    "chat": "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions.",
}
# what the page offers: the README's comparison (method -> what decides the draft's length)
RULES = {
    "PACER": "the head's own rule; the shipped default head's is the cost-aware rule on the draft's own probability "
             "(keep drafting while a longer draft is expected to give more tokens per second, with this machine's "
             "measured costs), which does not run the head (without a head, the same rule by name); the rule that "
             "ran is named beside its result",
    "head's block rule": "the PACER paper's rule: the trained head's mean P(accept) over each block against a "
                         "threshold that grows per block",
    "SVIP": "SVIP: stop when the draft's distribution is too flat (its entropy)",
    "fixed γ": "always γ draft tokens",
    "transformers' assisted generation": "transformers' own assisted generation (its confidence-threshold schedule), "
                                         "as `target.generate(assistant_model=draft)` runs it",
}
METHODS = [*RULES, "target alone"]
MODES = ("greedy", "sampling")
# what one request may ask, enforced on the server: the sliders' ranges bind the page, not an API call
LIMITS = {"max new tokens": (8, 512), "γ": (1, 8), "temperature": (0.1, 1.5)}
MAX_PROMPT_CHARS = 4000
MAX_PROMPT_TOKENS = 1024
QUEUE_SIZE = 8  # requests waiting behind the one generating; more are turned away (memory stays bounded)
MAX_BATCH = 4  # requests of the same settings that wait are decoded together, this many at most: one batch


@dataclass
class _Job:
    run: object  # run(payloads): the work of every job taken with it, one payload each
    payload: object
    key: object  # jobs of one key (not None) may run together
    done: threading.Event = field(default_factory=threading.Event)


class GenerationWorker:
    """The one long-lived thread that runs every generation of the process, one at a time, in the order asked: on a
    CPU two generations at once share the cores and each runs at a fraction of its speed. With a thread started per
    request (and the whole text decoded at every refresh) the page's target alone ran at 0.90 of the same call outside
    it; with this worker (and each segment decoded once) at 0.99 (benchmarks/results/2026-12-04-space-truth).

    Jobs submitted with the same `key` that are waiting when the worker takes the first of them run together, up to
    `MAX_BATCH`: one call decodes them all, as rows of a batch."""

    def __init__(self):
        self._jobs: collections.deque[_Job] = collections.deque()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self.busy = threading.Event()  # set while a generation runs

    def submit(self, job, key=None, payload=None) -> threading.Event:
        """Run `job([payload, ...])` on the worker, with the payloads of the jobs of the same `key` (not None) that
        wait with it; the returned event is set once it has ended (returned or raised)."""
        entry = _Job(job, payload, key)
        with self._ready:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True, name="pacer-demo-generation")
                self._thread.start()
            self._jobs.append(entry)
            self._ready.notify()
        return entry.done

    def _take(self) -> list[_Job]:
        """The next job and the waiting ones of its key (in the order asked), at most MAX_BATCH."""
        with self._ready:
            while not self._jobs:
                self._ready.wait()
            first = self._jobs.popleft()
            group = [first]
            if first.key is not None:
                for job in list(self._jobs):
                    if len(group) < MAX_BATCH and job.key == first.key:
                        self._jobs.remove(job)
                        group.append(job)
            return group

    def _loop(self) -> None:
        while True:
            group = self._take()
            self.busy.set()
            try:
                group[0].run([job.payload for job in group])
            except Exception:  # noqa: BLE001 - logged; the worker lives on for the next job
                logging.getLogger(__name__).exception("pacer-demo: a generation job failed")
            finally:
                self.busy.clear()
                for job in group:
                    job.done.set()


WORKER = GenerationWorker()
CSS = """
.tok-accepted { background: #d3f5d3; border-radius: 3px; }
.tok-rejected { color: #b03030; text-decoration: line-through; opacity: 0.55; }
.tok-target { background: #d6e4ff; border-radius: 3px; }
.pacer-text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 14px; line-height: 1.5; }
.mark-ok { display: inline-block; width: 0.4em; height: 0.85em; margin: 0 0.6em 0.1em 0.3em;
           border: solid #2e7d32; border-width: 0 0.2em 0.2em 0; transform: rotate(45deg); }
.mark-bad { display: inline-block; color: #b03030; font-weight: bold; margin-right: 0.4em; }
"""
LEGEND = ('<span class="tok-accepted">drafted, accepted</span> · <span class="tok-rejected">drafted, rejected</span>'
          ' · <span class="tok-target">the target\'s own token</span>')


# --------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------
@dataclass
class DemoModels:
    target: object
    draft: object
    tokenizer: object
    head: PacerHead | None
    description: str


def load_models(target=None, draft=None, head=None, quantize_draft=None, target_bits=None, progress=None) -> DemoModels:
    """The pair (default: the embedded Qwen2.5-Coder 1.5B/0.5B) and a head (default: the one trained for
    that pair, when it is in the repo). On a GPU the models go there; `target_bits` 8 or 4 loads the
    target with bitsandbytes."""
    from modeling_pacer.pairs import DEFAULT_PAIR, default_head_path, load_pair, resolve_pair

    def step(fraction, text):
        if progress is not None:
            progress(fraction, desc=text)

    gpu = torch.cuda.is_available()
    # on CPU the pair's own setting (the default pair: bf16 exact target, int4 draft, as benchmarked); pacer's
    # draft quantizations are CPU kernels, so on a GPU the draft stays as it is
    quantize_draft = False if gpu and quantize_draft is None else quantize_draft
    kwargs = dict(device_map="auto" if gpu else None, quantize_draft=quantize_draft,
                  dtype=torch.bfloat16 if gpu else "auto")
    if target_bits == 8:
        kwargs["load_in_8bit_target"] = True
    elif target_bits == 4:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True)
    step(0.1, "loading the target and the draft")
    pair = load_pair(target or DEFAULT_PAIR, draft, **kwargs)
    step(0.8, "loading the PACER head")
    head_path = head or default_head_path(resolve_pair(target or DEFAULT_PAIR, draft))  # none for another draft
    head_model = PacerHead.from_pretrained(head_path).eval() if head_path else None
    step(1.0, "ready")
    return DemoModels(pair.target, pair.draft, pair.tokenizer, head_model, f"{pair.name} · head: {head_path or 'none'}")


class ModelHolder:
    """Loads once, on first use (so the page is up at once and shows the loading progress)."""

    def __init__(self, loader):
        self._loader, self._models, self._lock = loader, None, threading.Lock()

    def get(self, progress=None) -> DemoModels:
        with self._lock:
            if self._models is None:
                self._models = self._loader(progress)
            return self._models


# --------------------------------------------------------------------------------------------------
# two generations, one after the other
# --------------------------------------------------------------------------------------------------
@dataclass
class Side:
    """What one side has produced so far, for rendering, and the wall-clock time of its own generation."""

    name: str
    segments: list[tuple[list[int], str]] = field(default_factory=list)  # (tokens, kind)
    steps: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    started: float | None = None
    finished: float | None = None
    done: bool = False
    error: str | None = None
    rule: str = ""  # the stopping rule that ran, as the loop reports it (PACER's methods)
    batch: int = 1  # the requests decoded together with this one, itself included
    rendered: list[str] = field(default_factory=list)  # segments rendered so far: each is decoded once

    @property
    def seconds(self) -> float:
        """Its own generation's time so far (0 before it starts)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started


class _Streamer(BaseStreamer):
    """Receives emitted tokens and files them under the side (with the step that made them, for PACER)."""

    def __init__(self, side: Side, pending: list):
        self.side, self.pending, self.prompt_seen = side, pending, False

    def put(self, value):
        if not self.prompt_seen:  # transformers and pacer both put the prompt first
            self.prompt_seen = True
            return
        emitted = value.flatten().tolist()
        self.side.tokens.extend(emitted)
        if self.pending:  # a PACER step: split into accepted drafts, the target's token, rejected drafts
            drafted, accepted, reason = self.pending.pop()
            self.side.segments.append((emitted[:accepted], "accepted"))
            self.side.segments.append((drafted[accepted:], "rejected"))
            self.side.segments.append((emitted[accepted:], "target"))
            self.side.steps.append(dict(accepted=min(accepted, len(emitted)), rejected=len(drafted) - accepted, reason=reason))
        else:
            self.side.segments.append((emitted, "plain"))

    def end(self):
        pass


def _run(sides: list[Side], fn) -> None:
    """`fn()`, the generation of `sides` (one visitor's, or a batch's rows), timed for each."""
    started = time.perf_counter()
    for side in sides:
        side.started = started
    try:
        fn()
    except Exception as error:  # shown on the page rather than lost in a thread
        for side in sides:
            side.error = f"{type(error).__name__}: {error}"
    finally:
        finished = time.perf_counter()
        for side in sides:
            side.finished, side.done = finished, True


class _RowStreamer:
    """A batch's streamer for pacer's loop: the prompts by `put`, then each row's tokens by `put_row`, each to that
    row's own streamer."""

    def __init__(self, streamers: list):
        self.streamers = streamers

    def put(self, value):
        for row, streamer in enumerate(self.streamers):
            streamer.put(value[row])

    def put_row(self, row: int, value):
        self.streamers[row].put(value)

    def end(self):
        for streamer in self.streamers:
            streamer.end()


class _BatchStreamer(BaseStreamer):
    """A batch's streamer for transformers' `generate`: its prompts, then a token a row a step, each to that row's own
    streamer, up to the row's end (transformers pads the rows that ended)."""

    def __init__(self, streamers: list, eos: set[int]):
        self.streamers, self.eos, self.ended = streamers, eos, [False] * len(streamers)
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            for row, streamer in enumerate(self.streamers):
                streamer.put(value[row])
            return
        for row, token in enumerate(value.flatten().tolist()):
            if not self.ended[row]:
                self.streamers[row].put(torch.tensor([token]))
                self.ended[row] = token in self.eos

    def end(self):
        for streamer in self.streamers:
            streamer.end()


class _Cancelled(StoppingCriteria):
    """Ends a generation at its next step once every one of `events` is set (the requests that asked for it are
    gone: a batch goes on while one of its requests waits for it)."""

    def __init__(self, *events: threading.Event):
        self.events = events

    def __call__(self, input_ids, scores, **kwargs):
        gone = all(event.is_set() for event in self.events)
        return torch.full((input_ids.shape[0],), gone, dtype=torch.bool, device=input_ids.device)


@dataclass
class Comparison:
    """A running comparison: its sides, the event set once its generations have ended, and the one that stops them."""

    sides: dict[str, Side]
    done: threading.Event
    cancel: threading.Event

    def stop(self, timeout: float = 60.0) -> None:
        """End the generation (at its next step) and wait until it has."""
        self.cancel.set()
        self.done.wait(timeout)


def method_arguments(method: str, gamma: int, head) -> dict:
    """`generate`'s arguments for one of pacer's methods on the page."""
    if method == "PACER":  # the head's default rule, or by name where no head is loaded: the same rule
        return dict(pacer_head=head) if head is not None else dict(stopping_policy="throughput")
    if method == "head's block rule":
        return dict(pacer_head=head, stopping_policy="pacer")
    if method == "SVIP":
        return dict(stopping_policy=SVIP())
    if method == "fixed γ":
        return dict(stopping_policy=FixedLength(gamma))
    raise ValueError(f"no pacer method {method!r}")


def check_request(prompt, max_new_tokens, mode, temperature, method, gamma) -> dict:
    """The request's values, checked on the server (an API call can send anything): a ValueError naming the first
    that is out of bounds."""
    def number(name, value, integer):
        low, high = LIMITS[name]
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if not low <= number <= high or (integer and number != int(number)):
            raise ValueError(f"{name} must be {'an integer ' if integer else ''}between {low} and {high}, got {value!r}")
        return int(number) if integer else number

    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("Type a prompt first.")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"The prompt has {len(prompt)} characters; at most {MAX_PROMPT_CHARS}.")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if mode not in MODES:
        raise ValueError(f"decoding must be one of {list(MODES)}, got {mode!r}")
    return dict(prompt=prompt, max_new_tokens=number("max new tokens", max_new_tokens, True), mode=mode,
                temperature=number("temperature", temperature, False), method=method, gamma=number("γ", gamma, True))


@dataclass
class _Request:
    """One visitor's comparison as the worker runs it: its prompt and its sides."""

    input_ids: torch.Tensor
    sides: dict[str, Side]
    cancel: threading.Event


def start_comparison(models: DemoModels, input_ids, method: str, gamma: int, settings: dict) -> Comparison:
    """Run `method`, then the target alone, on the generation worker ([`WORKER`]); returns the comparison, its sides
    filled as they stream. `Comparison.stop()` ends the generation at its next step.

    One after the other, never at once: on a CPU two generations share the same cores and memory bandwidth, so
    side by side each would run at a fraction of its speed; in turn, each side's tokens/s is what it makes alone.
    Requests of the same method and settings that wait for the worker are decoded together ([`GenerationWorker`]):
    each side of theirs is one batched call, each visitor's rows its own output; `Side.batch` says how many."""
    names = ["target"] if method == "target alone" else ["method", "target"]
    request = _Request(input_ids, {n: Side(n) for n in names}, threading.Event())
    # transformers' assisted generation decodes one sequence a call: its requests run alone
    key = None if method == "transformers' assisted generation" else (
        id(models), method, gamma, tuple(sorted((k, str(v)) for k, v in settings.items())))
    run = functools.partial(_compare_together, models, method, gamma, settings, names)
    return Comparison(request.sides, WORKER.submit(run, key, request), request.cancel)


def _compare_together(models: DemoModels, method: str, gamma: int, settings: dict, names: list, requests: list) -> None:
    """`requests` (one or several visitors of the same method and settings): the method's side of all of them in one
    call, then the target alone's, each a left-padded batch where there are several. An error is shown on every side
    it leaves unfinished."""
    try:
        _compare(models, method, gamma, settings, names, requests)
    except Exception as error:
        for r in requests:
            for side in r.sides.values():
                if not side.done:
                    side.error, side.done = f"{type(error).__name__}: {error}", True
        raise


def _compare(models: DemoModels, method: str, gamma: int, settings: dict, names: list, requests: list) -> None:
    batched = len(requests) > 1
    # the id a batch's padding holds (masked: any id would do) and transformers pads the ended rows with
    pad = next((i for i in (models.tokenizer.pad_token_id, models.tokenizer.eos_token_id) if i is not None), 0)
    if batched:
        width = max(r.input_ids.shape[1] for r in requests)
        input_ids = torch.full((len(requests), width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, r in enumerate(requests):
            input_ids[row, width - r.input_ids.shape[1]:], mask[row, width - r.input_ids.shape[1]:] = r.input_ids[0], 1
        settings = dict(settings, attention_mask=mask.to(models.target.device), pad_token_id=pad)
    else:
        input_ids = requests[0].input_ids
    input_ids = input_ids.to(models.target.device)
    settings = dict(settings, stopping_criteria=StoppingCriteriaList([_Cancelled(*(r.cancel for r in requests))]))
    for r in requests:
        for side in r.sides.values():
            side.batch = len(requests)

    def target_alone():
        streamers = [_Streamer(r.sides["target"], []) for r in requests]
        eos = models.target.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        streamer = _BatchStreamer(streamers, eos) if batched else streamers[0]
        GenerationMixin.generate(models.target, input_ids, streamer=streamer, **settings)

    def speculative():
        if method == "transformers' assisted generation":  # its steps are not reported: its text is shown plain
            GenerationMixin.generate(models.target, input_ids, assistant_model=models.draft,
                                     streamer=_Streamer(requests[0].sides["method"], []), **settings)
            return
        pending = [[] for _ in requests]
        streamers = [_Streamer(r.sides["method"], pending[row]) for row, r in enumerate(requests)]

        def on_step(ids, draft, target_scores, accepted, row=0):
            pending[row].append((draft.tokens[0].tolist(), accepted, draft.stop_reason))

        out = pacer_generate(models.target, input_ids, assistant_model=models.draft,
                             streamer=_RowStreamer(streamers) if batched else streamers[0],
                             pacer_step_callback=on_step, return_dict_in_generate=True,
                             **method_arguments(method, gamma, models.head), **settings)
        for r in requests:
            r.sides["method"].rule = out.pacer_stats.policy

    runs = {"target": target_alone, "method": speculative}
    for name in names:
        sides = [r.sides[name] for r in requests]
        if all(r.cancel.is_set() for r in requests):
            for side in sides:
                side.done = True
            continue
        _run(sides, runs[name])


# --------------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------------
def render_side(side: Side, tokenizer) -> str:
    """The side's text as HTML. Segments only ever get appended, so each is decoded once: a refresh renders what
    arrived since the last one, and the page's work (under Python's lock, beside the generating thread) stays small
    whatever the text's length."""
    for tokens, kind in side.segments[len(side.rendered):]:  # a snapshot: the generating thread only appends
        text = html.escape(tokenizer.decode(tokens, skip_special_tokens=False)) if tokens else ""
        side.rendered.append(text if kind == "plain" or not text else f'<span class="tok-{kind}" title="{kind}">{text}</span>')
    body = "".join(side.rendered) or "…"
    if side.error:
        body += f'<p style="color:#b03030">error: {html.escape(side.error)}</p>'
    return f'<div class="pacer-text">{body}</div>'


def side_stats(side: Side, reference_rate: float | None) -> str:
    if side.started is None:
        return "waiting: the two run one after the other, so that each runs at its own speed"
    rate = shown_rate(side)
    text = f"**{len(side.tokens)} tokens · {rate:.2f} tokens/s**" + ("" if side.done else " (generating)")
    if reference_rate:  # the ratio of the two rates as shown
        text += f" · **{rate / reference_rate:.2f}x** the target alone"
    if side.steps:
        tau = len(side.tokens) / len(side.steps)
        text += f" · {len(side.steps)} target forwards · {tau:.2f} tokens per forward"
    if side.batch > 1:
        text += f"  \ndecoded together with {side.batch - 1} other request{'s' if side.batch > 2 else ''}, as one batch"
    if side.rule:
        text += f"  \nrule: `{side.rule}`"
    return text


def shown_rate(side: Side) -> float:
    """The side's tokens/s as the page shows it (two decimals), so that the speedup shown is their ratio."""
    seconds = side.seconds
    return round(len(side.tokens) / seconds, 2) if seconds > 0 else 0.0


def steps_chart(side: Side | None):
    """The per-step chart, its y-axis up to the longest draft so that every bar shows whole."""
    frame = steps_frame(side)
    longest = max((s["accepted"] + s["rejected"] for s in side.steps), default=0) if side else 0
    return gr.BarPlot(frame, y_lim=[0, max(4, longest + 1)])


def steps_frame(side: Side | None) -> pd.DataFrame:
    rows = []
    for i, step in enumerate(side.steps if side else [], start=1):
        rows.append(dict(step=i, tokens=step["accepted"], kind="accepted", stop=step["reason"]))
        rows.append(dict(step=i, tokens=step["rejected"], kind="rejected", stop=step["reason"]))
    return pd.DataFrame(rows, columns=["step", "tokens", "kind", "stop"])


def verdict(sides: dict, do_sample: bool) -> str:
    """The verdict as HTML; its mark is drawn by CSS (an emoji needs a font a headless browser may lack)."""
    if "method" not in sides:
        return "<p>Only the target ran.</p>"
    if not all(s.done for s in sides.values()):
        return "<p>Generating…</p>"
    if do_sample:
        return "<p>Sampling: the two outputs are different draws; PACER samples exactly the target's distribution.</p>"
    same = sides["target"].tokens == sides["method"].tokens
    return ('<p><span class="mark-ok"></span><strong>Identical</strong>: checked token for token, the method\'s output '
            "is the target's greedy output.</p>" if same else
            '<p><span class="mark-bad">×</span><strong>The outputs differ</strong>: this is a bug, please report it.</p>')


# --------------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------------
def build_demo(holder: ModelHolder, refresh_seconds: float = 0.25) -> gr.Blocks:
    def compare(prompt, max_new_tokens, mode, temperature, method, gamma, progress=gr.Progress()):
        try:  # every value checked here, before a model is touched: the page's sliders bind only the page
            request = check_request(prompt, max_new_tokens, mode, temperature, method, gamma)
        except ValueError as error:
            raise gr.Error(str(error)) from None
        models = holder.get(progress)
        if method == "head's block rule" and models.head is None:
            raise gr.Error("No PACER head is loaded for this pair: choose another method, or start the demo with --head.")
        from modeling_pacer.prompts import apply_chat_template

        input_ids = apply_chat_template(models.tokenizer, request["prompt"])
        if input_ids.shape[1] > MAX_PROMPT_TOKENS:
            raise gr.Error(f"The prompt is {input_ids.shape[1]} tokens long; at most {MAX_PROMPT_TOKENS}.")
        do_sample = mode == "sampling"
        settings = dict(max_new_tokens=request["max_new_tokens"], do_sample=do_sample)
        if do_sample:
            settings.update(temperature=request["temperature"], top_k=0, top_p=1.0)
        comparison = start_comparison(models, input_ids, method, request["gamma"], settings)
        sides = comparison.sides
        try:
            while True:
                finished = all(s.done for s in sides.values())
                target_side, method_side = sides["target"], sides.get("method")
                # the method's speedup once the target alone has finished (its rate before then is a partial one)
                reference = shown_rate(target_side) if target_side.done and target_side.seconds else None
                yield (
                    render_side(target_side, models.tokenizer),
                    side_stats(target_side, None),
                    render_side(method_side, models.tokenizer) if method_side else "",
                    side_stats(method_side, reference) if method_side else "",
                    steps_chart(method_side),
                    verdict(sides, do_sample),
                )
                if finished:
                    break
                time.sleep(refresh_seconds)
        finally:  # also when the client goes away (Gradio closes the generator): the generation ends with it
            comparison.stop()

    with gr.Blocks(title="PACER: speculative decoding with adaptive draft length") as demo:
        gr.Markdown("# PACER: watch speculative decoding decide\nA small draft model proposes tokens; a rule decides "
                    "when to stop drafting; the target checks the whole draft in one forward, so the output is the "
                    "target's own. Left: the target alone. Right: the method you choose; it runs first, then the target "
                    "alone, so that neither slows the other down. " + LEGEND + "\n\n**What decides the draft's length**: "
                    + " · ".join(f"**{name}**: {rule}" for name, rule in RULES.items()) + ".")
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", lines=3, value=EXAMPLES["code"])
                gr.Examples([[v] for v in EXAMPLES.values()], inputs=[prompt], example_labels=list(EXAMPLES))
            with gr.Column(scale=2):
                method = gr.Radio(METHODS, value="PACER", label="Method")
                gamma = gr.Slider(1, 8, value=2, step=1, label="γ (fixed γ only)")
                max_new_tokens = gr.Slider(8, 512, value=128, step=8, label="max new tokens")
                mode = gr.Radio(["greedy", "sampling"], value="greedy", label="Decoding")
                temperature = gr.Slider(0.1, 1.5, value=0.7, step=0.05, label="temperature (sampling)")
                run = gr.Button("Generate", variant="primary", elem_id="generate")
        verdict_md = gr.HTML(elem_id="verdict")
        with gr.Row():
            with gr.Column():
                gr.Markdown("### The target alone")
                target_stats = gr.Markdown(elem_id="target-stats")
                target_text = gr.HTML(elem_id="target-text")
            with gr.Column():
                gr.Markdown("### The chosen method")
                method_stats = gr.Markdown(elem_id="method-stats")
                method_text = gr.HTML(elem_id="method-text")
        chart = gr.BarPlot(steps_frame(None), x="step", y="tokens", color="kind", tooltip=["stop"],
                           title="Draft per decode step: accepted and rejected tokens (hover: why drafting stopped)",
                           color_map={"accepted": "#4caf50", "rejected": "#e57373"}, elem_id="steps-chart")
        run.click(compare, inputs=[prompt, max_new_tokens, mode, temperature, method, gamma],
                  outputs=[target_text, target_stats, method_text, method_stats, chart, verdict_md], api_name="compare",
                  concurrency_limit=MAX_BATCH)
    # one generation at a time on the worker, which decodes up to MAX_BATCH waiting requests of the same settings
    # together (so that many handlers wait on it at once); at most QUEUE_SIZE requests wait, more are refused at once
    return demo.queue(default_concurrency_limit=MAX_BATCH, max_size=QUEUE_SIZE)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="pacer-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=env("PACER_TARGET"), help="target repo id or folder (default: the embedded pair)")
    p.add_argument("--draft", default=env("PACER_DRAFT"), help="draft repo id or folder")
    p.add_argument("--head", default=env("PACER_HEAD"), help="PACER head repo id or folder (default: the pair's trained head)")
    p.add_argument("--target-bits", type=int, choices=[8, 4], default=int(env("PACER_TARGET_BITS", "0")) or None,
                   help="load the target in 8-bit or 4-bit with bitsandbytes")
    p.add_argument("--no-quantize-draft", action="store_true", help="keep the draft in full precision on CPU")
    p.add_argument("--host", default=env("GRADIO_SERVER_NAME", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("GRADIO_SERVER_PORT", "7860")))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    holder = ModelHolder(lambda progress: load_models(
        args.target, args.draft, args.head, quantize_draft=False if args.no_quantize_draft else None,
        target_bits=args.target_bits, progress=progress))
    build_demo(holder).launch(server_name=args.host, server_port=args.port, css=CSS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
