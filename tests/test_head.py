"""The head: shapes, causality inside a draft, packing masks, and save/load round trips through a
local folder (trust_remote_code) and an offline Hub cache, with identical outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel

from modeling_pacer import PacerConfig, PacerHead

# The same weights loaded two ways may land at differently aligned addresses, and the CPU matmul kernels choose
# their blocking (and so their summation order) by alignment and shape: float32 outputs can then differ in the
# last bits (seen: 1e-8). The round trips below compare the weights bitwise and the outputs within this bound.
OUTPUTS = dict(rtol=1e-5, atol=1e-6)


def assert_same_head(loaded, original, x, **inputs):
    """Bitwise-equal weights, and outputs equal up to float32 summation order."""
    theirs, ours = loaded.state_dict(), original.state_dict()
    assert theirs.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    torch.testing.assert_close(loaded(x, **inputs).logits, original(x, **inputs).logits, **OUTPUTS)


SMALL = dict(draft_hidden_size=24, hidden_size=16, num_attention_heads=2, intermediate_size=32, max_draft_length=8)


@pytest.fixture
def head():
    torch.manual_seed(0)
    return PacerHead(PacerConfig(**SMALL)).eval()


def test_output_shape_and_probabilities(head):
    x = torch.randn(2, 5, 24)
    out = head(x)
    assert out.logits.shape == (2, 5) and out.loss is None
    p = head.acceptance_probabilities(x)
    assert ((p > 0) & (p < 1)).all()


def test_causal_inside_a_draft(head):
    """A token's prediction never depends on later draft tokens: decoding can score a growing draft."""
    x = torch.randn(1, 7, 24)
    full = head(x).logits
    for k in range(1, 8):
        torch.testing.assert_close(head(x[:, :k]).logits, full[:, :k])


def test_block_diagonal_mask_equals_separate_drafts(head):
    """Two drafts packed in one row with a block-diagonal causal mask and restarting positions give
    the same predictions as the two drafts scored alone."""
    a, b = torch.randn(1, 3, 24), torch.randn(1, 4, 24)
    packed = torch.cat([a, b], dim=1)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    mask = torch.zeros(1, 7, 7, dtype=torch.bool)
    mask[0, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    mask[0, 3:, 3:] = torch.ones(4, 4, dtype=torch.bool).tril()
    out = head(packed, draft_positions=positions, attention_mask=mask).logits
    torch.testing.assert_close(out[:, :3], head(a).logits)
    torch.testing.assert_close(out[:, 3:], head(b).logits)


def test_position_embedding_matters_and_can_be_ablated():
    torch.manual_seed(0)
    with_pos = PacerHead(PacerConfig(**SMALL)).eval()
    x = torch.randn(1, 1, 24).expand(1, 4, 24)  # the same state at every draft position
    logits = with_pos(x).logits[0]
    assert not torch.allclose(logits[0], logits[3])
    without = PacerHead(PacerConfig(**SMALL, use_position_embedding=False)).eval()
    assert without.position_embedding is None
    assert sum(p.numel() for p in without.parameters()) < sum(p.numel() for p in with_pos.parameters())


def test_loss_ignores_negative_labels(head):
    x = torch.randn(1, 4, 24)
    logits = head(x).logits
    labels = torch.tensor([[1.0, 0.0, -100.0, -100.0]])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[0, :2], labels[0, :2])
    torch.testing.assert_close(head(x, labels=labels).loss, expected)


def test_wrong_hidden_size_is_a_clear_error(head):
    with pytest.raises(ValueError, match="hidden size 24"):
        head(torch.randn(1, 3, 32))


def test_position_beyond_max_draft_length_is_a_clear_error(head):
    with pytest.raises(ValueError, match="max_draft_length"):
        head(torch.randn(1, 9, 24))


def test_draft_features_head_shapes_and_errors():
    """A head with use_draft_features reads (batch, draft_len, 2) features beside the hidden states, stays causal,
    and refuses to run without them or with features of another shape."""
    torch.manual_seed(0)
    head = PacerHead(PacerConfig(**SMALL, use_draft_features=True)).eval()
    assert head.feature_proj.in_features == 2 and not head.feature_proj.bias.any()  # initialised as the others
    assert head.feature_proj.weight.std() < 4 * head.config.initializer_range
    x, features = torch.randn(2, 5, 24), torch.rand(2, 5, 2)
    out = head(x, draft_features=features)
    assert out.logits.shape == (2, 5)
    assert head.acceptance_probabilities(x, draft_features=features).shape == (2, 5)
    assert not torch.allclose(out.logits, head(x, draft_features=torch.zeros(2, 5, 2)).logits)  # they are read
    torch.testing.assert_close(head(x[:, :3], draft_features=features[:, :3]).logits, out.logits[:, :3])
    with pytest.raises(ValueError, match=r"use_draft_features=True.*draft_features of shape \(batch, draft_len, 2\)"):
        head(x)
    with pytest.raises(ValueError, match=r"\(2, 5, 2\).*got \(2, 4, 2\)"):
        head.acceptance_probabilities(x, draft_features=features[:, :4])
    with pytest.raises(ValueError, match=r"got \(2, 5, 3\)"):
        head(x, draft_features=torch.rand(2, 5, 3))


def test_head_without_draft_features_ignores_them(head):
    """One collator serves both kinds of head: a head without use_draft_features ignores the features."""
    assert head.feature_proj is None and not head.config.use_draft_features
    x = torch.randn(2, 5, 24)
    assert torch.equal(head(x, draft_features=torch.rand(2, 5, 2)).logits, head(x).logits)


def test_save_pretrained_writes_a_hub_ready_folder(head, tmp_path):
    head.save_pretrained(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert files == ["config.json", "configuration_pacer.py", "model.safetensors", "modeling_pacer.py"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_pacer.PacerConfig", "AutoModel": "modeling_pacer.PacerHead"}
    assert config["model_type"] == "pacer" and config["draft_hidden_size"] == 24


def test_round_trip_local_folder(head, tmp_path):
    head.save_pretrained(tmp_path)
    x = torch.randn(1, 6, 24)
    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(remote).__name__ == "PacerHead" and type(remote) is not PacerHead  # the shipped code ran
    assert_same_head(remote, head, x)
    assert AutoConfig.from_pretrained(tmp_path, trust_remote_code=True).block_size == head.config.block_size
    assert_same_head(PacerHead.from_pretrained(tmp_path).eval(), head, x)


def test_round_trip_draft_features_head(tmp_path):
    """A features head saves its switch and its feature projection, and loads both ways with the same outputs."""
    torch.manual_seed(0)
    head = PacerHead(PacerConfig(**SMALL, use_draft_features=True)).eval()
    head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_draft_features"] is True
    x, features = torch.randn(1, 6, 24), torch.rand(1, 6, 2)
    for loaded in (AutoModel.from_pretrained(tmp_path, trust_remote_code=True), PacerHead.from_pretrained(tmp_path)):
        assert torch.equal(loaded.state_dict()["feature_proj.weight"], head.feature_proj.weight)
        torch.testing.assert_close(loaded.eval()(x, draft_features=features).logits,
                                   head(x, draft_features=features).logits, **OUTPUTS)


def _offline_hub_snapshot(folder: Path, hf_home: Path, repo_id: str) -> None:
    """Lay out `folder` as huggingface_hub's cache keeps a downloaded repo."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())


OFFLINE_LOADER = """
import sys, torch
from transformers import AutoModel
from modeling_pacer import PacerHead
x = torch.load(sys.argv[1])
remote = AutoModel.from_pretrained("pacer-org/pacer-head-test", trust_remote_code=True).eval()
local = PacerHead.from_pretrained("pacer-org/pacer-head-test").eval()
torch.save({"remote": remote(x).logits, "local": local(x).logits, "cls": type(remote).__module__,
            "remote_weights": remote.state_dict(), "local_weights": local.state_dict()}, sys.argv[2])
"""


def test_round_trip_offline_hub_cache(head, tmp_path):
    """The real Hub loading code (huggingface_hub's cache, HF_HUB_OFFLINE=1), in a fresh process so that
    the environment variables are read at import as they would be for a user."""
    head.save_pretrained(tmp_path / "saved")
    _offline_hub_snapshot(tmp_path / "saved", tmp_path / "hf_home", "pacer-org/pacer-head-test")
    x = torch.randn(1, 6, 24)
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    subprocess.run([sys.executable, "-c", OFFLINE_LOADER, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, cwd=tmp_path)
    out = torch.load(tmp_path / "out.pt")
    assert out["cls"].startswith("transformers_modules")
    for side in ("remote", "local"):
        for name, tensor in head.state_dict().items():
            assert torch.equal(out[f"{side}_weights"][name], tensor), (side, name)
        torch.testing.assert_close(out[side], head(x).logits, **OUTPUTS)


def test_committed_heads_load_both_ways_identically():
    """Every committed head folder (its own copy of the code, as on the Hub) loads through
    trust_remote_code and through the package with identical outputs, and its card has the Hub metadata."""
    heads = sorted((Path(__file__).resolve().parent.parent / "heads").glob("*/config.json"))
    assert heads, "no committed head found"
    for config_file in heads:
        folder = config_file.parent
        local = PacerHead.from_pretrained(folder).eval()
        remote = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 5, local.config.draft_hidden_size, generator=g)
        features = torch.rand(1, 5, 2, generator=g) if local.config.use_draft_features else None
        assert_same_head(remote, local, x, draft_features=features)
        card = (folder / "README.md").read_text()
        assert card.startswith("---\n") and "library_name: transformers" in card and "pacer-train" in card


def test_draft_prior_head_starts_from_the_drafts_cumulative_probability():
    """With `draft_prior`, a head whose own output is zero predicts exactly the product of the draft's token
    probabilities over the draft so far, restarting with every draft packed in a training row."""
    torch.manual_seed(0)
    head = PacerHead(PacerConfig(draft_hidden_size=8, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                 max_draft_length=8, use_draft_features=True, draft_prior=True)).eval()
    with torch.no_grad():
        head.classifier.weight.zero_()
        head.classifier.bias.zero_()
    p = torch.tensor([[0.9, 0.5, 0.8, 0.3, 0.6]])
    features = torch.stack([p, torch.rand(1, 5)], -1)
    predicted = head.acceptance_probabilities(torch.randn(1, 5, 8), draft_features=features)
    torch.testing.assert_close(predicted, torch.cumprod(p, -1), atol=1e-5, rtol=1e-4)
    # two drafts packed in one row (3 + 2 tokens): the product restarts with the second
    mask = torch.zeros(1, 5, 5, dtype=torch.bool)
    mask[0, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    mask[0, 3:, 3:] = torch.ones(2, 2, dtype=torch.bool).tril()
    logits = head(torch.randn(1, 5, 8), draft_positions=torch.tensor([[0, 1, 2, 0, 1]]), attention_mask=mask,
                  draft_features=features).logits
    expected = torch.cat([torch.cumprod(p[:, :3], -1), torch.cumprod(p[:, 3:], -1)], -1)
    torch.testing.assert_close(torch.sigmoid(logits), expected, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="draft_prior needs use_draft_features"):
        PacerConfig(draft_hidden_size=8, draft_prior=True)
