"""A head folder that is not exactly a saved PACER head never loads, both ways in (`PacerHead.from_pretrained`
and `AutoModel.from_pretrained(..., trust_remote_code=True)`, which runs the folder's own copy of the code):
a clear ValueError naming the problem, never a silently random head or an error about something else."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from modeling_pacer import PacerConfig, PacerHead

SMALL = dict(draft_hidden_size=24, hidden_size=16, num_attention_heads=2, intermediate_size=32, max_draft_length=8)


def _load_package(folder):
    return PacerHead.from_pretrained(folder)


def _load_auto(folder):
    return AutoModel.from_pretrained(folder, trust_remote_code=True)


LOADERS = pytest.mark.parametrize("load", [_load_package, _load_auto], ids=["PacerHead", "AutoModel"])


@pytest.fixture
def saved(tmp_path):
    """A freshly saved head and its folder."""
    torch.manual_seed(0)
    head = PacerHead(PacerConfig(**SMALL)).eval()
    folder = tmp_path / "head"
    head.save_pretrained(folder)
    return head, folder


def _rewrite_weights(folder, edit):
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _rewrite_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@LOADERS
def test_a_saved_head_still_loads_exactly(saved, load):
    head, folder = saved
    loaded = load(folder)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_loading_info_is_still_returned_on_request(saved):
    _, folder = saved
    head, info = PacerHead.from_pretrained(folder, output_loading_info=True)
    assert isinstance(head, PacerHead) and not info["missing_keys"] and not info["unexpected_keys"]


@LOADERS
def test_pickle_weights_only_are_refused(saved, load):
    """A pickle `pytorch_model.bin` (unpickling can run code) is never read: safetensors only."""
    _, folder = saved
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    os.remove(folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"no model\.safetensors.*pytorch_model\.bin.*safetensors only"):
        load(folder)


def test_asking_for_pickle_weights_is_refused(saved):
    _, folder = saved
    with pytest.raises(ValueError, match="safetensors only"):
        PacerHead.from_pretrained(folder, use_safetensors=False)


@LOADERS
def test_missing_tensors_are_refused(saved, load):
    """Today's failure: a missing tensor was initialised at random, with only a log line."""
    _, folder = saved
    _rewrite_weights(folder, lambda w: w.pop("classifier.weight"))
    with pytest.raises(ValueError, match=r"missing.*classifier\.weight"):
        load(folder)


@LOADERS
def test_unexpected_tensors_are_refused(saved, load):
    _, folder = saved
    _rewrite_weights(folder, lambda w: w.update({"extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected.*extra\.weight"):
        load(folder)


@LOADERS
def test_tensors_of_another_shape_are_refused(saved, load):
    _, folder = saved
    _rewrite_config(folder, lambda c: c.update(intermediate_size=64))  # config.json no longer describes the weights
    with pytest.raises(ValueError, match=r"shape.*layer\.linear1\.weight"):
        load(folder)


@LOADERS
def test_wrong_model_type_is_refused(saved, load):
    _, folder = saved
    _rewrite_config(folder, lambda c: c.update(model_type="llama"))
    with pytest.raises(ValueError, match=r"model_type 'llama'.*'pacer'"):
        load(folder)


@LOADERS
def test_missing_model_type_is_refused(saved, load):
    _, folder = saved
    _rewrite_config(folder, lambda c: c.pop("model_type"))
    with pytest.raises(ValueError, match=r"model_type None.*'pacer'"):
        load(folder)


def test_missing_config_is_refused(saved):
    """Today's failure: the default config was used, then a size mismatch against the weights was reported."""
    _, folder = saved
    os.remove(folder / "config.json")
    with pytest.raises(ValueError, match=r"no config\.json"):
        PacerHead.from_pretrained(folder)


def test_missing_config_through_automodel_is_a_value_error_about_config_json(saved):
    """Without config.json transformers cannot find the folder's code at all, so the head's classes never run:
    the error is transformers' own (a ValueError about config.json), checked here so that it stays one."""
    _, folder = saved
    os.remove(folder / "config.json")
    with pytest.raises(ValueError, match=r"config\.json"):
        _load_auto(folder)


def test_an_explicit_config_needs_no_config_json(saved):
    head, folder = saved
    os.remove(folder / "config.json")
    loaded = PacerHead.from_pretrained(folder, config=head.config)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
