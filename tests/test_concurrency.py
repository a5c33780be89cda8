"""One stopping-policy instance shared by concurrent `generate` calls: each call adapts its own copy, so the
calls neither crash nor steer each other, and the instance passed in is left as it was."""

import threading

import pytest
import torch

from modeling_pacer import Confidence, Heuristic, Pacer

from conftest import VOCAB, make_head, make_pair

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def setup():
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (6, 11)]
    greedy = [target.generate(p, do_sample=False, max_new_tokens=NEW_TOKENS) for p in prompts]
    return target, draft, head, prompts, greedy


def _run(setup, i, policy, **kwargs):
    target, draft, head, prompts, _ = setup
    return target.generate(prompts[i], assistant_model=draft, pacer_head=head, stopping_policy=policy,
                           do_sample=False, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True, **kwargs)


def _in_threads(work):
    """Runs `work(0)` and `work(1)` in two threads; re-raises the first exception either one raised."""
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a generate call hung"
    if errors:
        raise errors[0]


POLICIES = {
    "confidence": lambda: Confidence(threshold=0.3),
    "heuristic": lambda: Heuristic(initial_gamma=3),
    "pacer": lambda: Pacer(block_size=1, threshold=0.3, growth=1.5, max_draft_length=8),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_interleaved_calls_on_one_instance_match_calls_alone(setup, name):
    """The two calls take turns: each hands over to the other after every step (in its step callback) and in the
    middle of drafting (in every head forward), so each call's steps and draft decisions run between the
    other's. With the state on the shared instance, one call's reset and updates change the other's adapted
    threshold or draft length. Each call must draft exactly as it does alone with a fresh instance, and output
    the target's greedy tokens."""
    _, _, head, _, greedy = setup
    alone = [[s.drafted for s in _run(setup, i, POLICIES[name]()).pacer_stats.steps] for i in range(2)]

    shared = POLICIES[name]()
    turns = [threading.Semaphore(1), threading.Semaphore(0)]  # call 0 goes first
    finished = [False, False]
    me = threading.local()
    outs = [None, None]

    def hand_over(*_):
        i = me.index
        if not finished[1 - i]:
            turns[1 - i].release()
            turns[i].acquire()

    def take_turns(i):
        me.index = i
        turns[i].acquire()
        try:
            outs[i] = _run(setup, i, shared, pacer_step_callback=hand_over)
        finally:
            finished[i] = True
            turns[1 - i].release()

    hook = head.register_forward_hook(hand_over)
    try:
        _in_threads(take_turns)
    finally:
        hook.remove()
    for i in range(2):
        assert outs[i].sequences.tolist() == greedy[i].tolist()
        assert [s.drafted for s in outs[i].pacer_stats.steps] == alone[i], f"call {i} was steered by the other"
    assert len(alone[0]) > 2 and len(alone[1]) > 2  # both calls really took several turns


def test_free_running_calls_on_one_instance(setup):
    """The plain case of the issue: two threads, one `Confidence()`, several calls each, started together."""
    _, _, _, _, greedy = setup
    shared = Confidence(threshold=0.3)
    start = threading.Barrier(2)
    outs = [[], []]

    def work(i):
        for _ in range(3):
            start.wait(timeout=60)
            outs[i].append(_run(setup, i, shared).sequences.tolist())

    _in_threads(work)
    for i in range(2):
        assert outs[i] == [greedy[i].tolist()] * 3


def test_the_instance_passed_is_copied_and_the_copy_returned(setup):
    """generate adapts a copy (documented): the instance passed keeps its initial state, and the copy that
    decoded, with its adapted state, comes back as `out.pacer_policy`."""
    policy = Confidence(threshold=0.3)
    before = dict(vars(policy))
    out = _run(setup, 0, policy)
    assert vars(policy) == before
    used = out.pacer_policy
    assert isinstance(used, Confidence) and used is not policy
    assert used._probs and used._current != policy._current  # it adapted (threshold re-tuned from its steps)
