"""`pacer-bench kernel-rows`: the per-layer row curve of pacer's quantized kernels (structure and arithmetic, not speed)."""

import json

import pytest

from modeling_pacer.benchmarks import cli
from modeling_pacer.benchmarks.kernel_rows import markdown, measure_rows
from modeling_pacer.cpu import kernels


@pytest.mark.skipif(not kernels.available(), reason=f"VNNI kernels: {kernels.unavailable_reason()}")
def test_kernel_rows_writes_each_layers_curve_and_its_bound(tmp_path):
    out = tmp_path / "rows"
    assert cli.main(["kernel-rows", "--shapes", "256x32", "--rows", "3", "--repeats", "2", "--stream-mb", "1",
                     "--threads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "kernel-rows.json").read_text())
    assert report["command"].startswith("pacer-bench kernel-rows --shapes 256x32")
    assert [(e["kind"], e["in_features"], e["out_features"]) for e in report["layers"]] == [("w4a8", 256, 32),
                                                                                         ("w8a8", 256, 32)]
    for entry in report["layers"]:
        ms = {int(r): v for r, v in entry["ms"].items()}
        assert sorted(ms) == [1, 2, 3] and all(v > 0 for v in ms.values())
        assert entry["copies"] >= 2  # 1 MB of copies of a layer of a few kB: the weights stream
        assert entry["ratio"]["1"] == 1.0
        rate = {int(r): v for r, v in entry["macs_per_ns"].items()}
        assert entry["peak_macs_per_ns"] == max(rate.values())
        for r in ms:  # the bound: the weights read once, the dot products at the best rate seen
            assert rate[r] == pytest.approx(256 * 32 * r / (ms[r] * 1e6))
            assert entry["bound"][str(r)] == pytest.approx(max(ms[1], 256 * 32 * r / (entry["peak_macs_per_ns"] * 1e6)) / ms[1])
            assert 1.0 <= entry["bound"][str(r)] <= max(1.0, entry["ratio"][str(r)]) + 1e-9  # the rate seen is <= peak
    table = (out / "kernel-rows.md").read_text()
    assert "| w4a8 256x32 |" in table
    # the instruction's own rate, once a run, and each layer's best rate as a share of it
    peak = report["vnni_peak_macs_per_ns"]
    assert peak > 0
    assert f"{report['layers'][0]['peak_macs_per_ns'] / peak:.0%} |" in table


def test_measure_rows_reports_the_bandwidth_of_one_row(monkeypatch):
    if not kernels.available():
        pytest.skip(f"VNNI kernels: {kernels.unavailable_reason()}")
    [entry] = measure_rows("w8a8", 256, 16, rows=2, repeats=1, stream_bytes=1)
    assert entry["copies"] == 1 and entry["path"] == "default"
    assert entry["gb_per_s"] == pytest.approx(entry["weight_bytes"] / (entry["ms"][1] * 1e6))
    assert markdown(dict(layers=[entry], command="c", host={"cpu": "x"}, threads=1, amx=False, vnni=True,
                           vnni_peak_macs_per_ns=100.0)).count("| w8a8 256x16 |") == 1


@pytest.mark.parametrize("shape, problem", [("100x64", "divisible by 256"), ("256x20", "out_features by 16"),
                                            ("1536by3", "expected IN x OUT"), ("0x16", "positive")])
def test_kernel_rows_refuses_shapes_the_kernels_do_not_take(shape, problem, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["kernel-rows", "--shapes", shape, "--out", str(tmp_path / "o")])
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "o" / "kernel-rows.json").exists()


@pytest.mark.skipif(not kernels.available(), reason=f"VNNI kernels: {kernels.unavailable_reason()}")
def test_kernel_rows_times_each_path_it_is_asked_for(tmp_path):
    """--paths vnni amx: one entry per layer and path, each labelled in the table (the paths run on any host: without
    AMX tiles both are the VNNI loops)."""
    out = tmp_path / "rows"
    assert cli.main(["kernel-rows", "--kinds", "w8a8", "--shapes", "256x32", "--rows", "2", "--repeats", "1",
                     "--stream-mb", "1", "--paths", "vnni", "amx", "--out", str(out)]) == 0
    report = json.loads((out / "kernel-rows.json").read_text())
    assert [e["path"] for e in report["layers"]] == ["vnni", "amx"]
    assert report["amx_tiles"] == kernels.amx_available()
    table = (out / "kernel-rows.md").read_text()
    assert "| w8a8 256x32 (vnni) |" in table and "| w8a8 256x32 (amx) |" in table


@pytest.mark.skipif(not kernels.available(), reason=f"VNNI kernels: {kernels.unavailable_reason()}")
def test_kernel_rows_times_the_attention_over_each_key_count(tmp_path):
    out = tmp_path / "attention"
    assert cli.main(["kernel-rows", "--kinds", "--attention-keys", "2", "40", "--attention-heads", "4", "2", "32",
                     "--rows", "3", "--repeats", "2", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads((out / "kernel-rows.json").read_text())
    assert report["layers"] == []
    assert [(e["keys"], e["heads"], e["kv_heads"], e["head_dim"]) for e in report["attention"]] == [(2, 4, 2, 32),
                                                                                                   (40, 4, 2, 32)]
    short, long = report["attention"]
    assert sorted(map(int, short["ms"])) == [1, 2] and sorted(map(int, long["ms"])) == [1, 2, 3]  # rows <= keys
    assert all(v > 0 for v in long["ms"].values()) and long["ratio"]["1"] == 1.0
    table = (out / "kernel-rows.md").read_text()
    assert "| 40 | " in table and "| 2 | " in table and "| w4a8" not in table
    assert "the 1.5B target's forward" not in table  # another shape than the target's: no layer count to multiply by


@pytest.mark.parametrize("args, problem", [(["--attention-heads", "12", "5", "128"], "divisible"),
                                           (["--attention-heads", "12", "2", "120"], "multiple of 16"),
                                           (["--kinds"], "times nothing")])
def test_kernel_rows_refuses_an_attention_it_cannot_time(args, problem, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["kernel-rows", *args, "--out", str(tmp_path / "o")])
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "o" / "kernel-rows.json").exists()
