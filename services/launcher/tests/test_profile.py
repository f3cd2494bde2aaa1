"""`spindle profile` in quick mode on a tiny random model: measures, fits, and the JSON loads back (through the
scheduler's `profile_data`, which reads it without the engine)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from spindle_costmodel import CostModel
from spindle_costmodel.hardware import hardware_from_dict
from spindle_launcher.cli import main as spindle_main
from spindle_launcher.profile import QUICK, ProfileConfig, run_profile
from spindle_launcher.profile import cli as profile_cli
from spindle_launcher.profile.cli import build_parser, config_from_args
from spindle_launcher.profile.device import model_shape
from spindle_model import LlamaModel
from spindle_model.testing import tiny_llama
from spindle_policy.latency import LatencyModel
from spindle_policy.profile_data import load_profile, load_profile_hardware, write_profile


@pytest.fixture(scope="module")
def tiny_model() -> LlamaModel:
    return tiny_llama(0)[1]


def test_quick_profile_round_trip(
    tiny_model: LlamaModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = run_profile(QUICK, model=tiny_model, progress=False)
    out = tmp_path / "profile.json"
    write_profile(doc, out)

    data = json.loads(out.read_text())
    assert {"machine", "samples", "model", "fit_error", "not_measured"} <= set(data)
    assert data["machine"]["cpu_count"] >= 1
    prefill_rows = data["samples"]["prefill"]["rows"]
    assert {(r[1], r[2]) for r in prefill_rows} == {(0, 8), (8, 16), (0, 32), (32, 8), (40, 16)}
    assert len(data["samples"]["decode"]["rows"]) == len(QUICK.decode_batches) * len(QUICK.decode_kv_tokens)
    assert [r[0] for r in data["samples"]["transfer"]["rows"]] == list(QUICK.transfer_bytes)
    assert all(r[-1] > 0 for kind in ("prefill", "decode", "transfer") for r in data["samples"][kind]["rows"])
    assert "prefill_sp_gt_1" in data["not_measured"]
    assert set(data["fit_error"]["prefill"]) == {"1"}

    model = load_profile(out)
    assert LatencyModel.from_json(model.to_json()) == model
    assert model.prefill is not None and model.prefill.sp_sizes() == [1]
    assert model.prefill.predict(1, 16, 16) > 0
    assert model.decode is not None and model.decode.predict(2, 64) > 0
    if model.transfer is not None:  # on a noisy machine tiny transfers may not fit; then it says why
        assert model.transfer.predict(2**20) > 0
    else:
        assert "transfer" in data["not_measured"]

    # the cost model's device: measured peaks, efficiencies fitted to the same samples, validated on half
    device = data["device"]
    assert device["measured"]["matmul_flops"] > 1e9 and device["measured"]["copy_bandwidth"] > 1e8
    hw = hardware_from_dict(load_profile_hardware(out))
    assert hw.peak_flops == device["measured"]["matmul_flops"] and hw.mem_bytes == device["measured"]["mem_bytes"]
    if model.transfer is not None:
        assert hw.intra.bandwidth == model.transfer.bandwidth_bytes_per_s
    rows = device["validation"]
    assert len(rows) == len(prefill_rows) + len(data["samples"]["decode"]["rows"])
    assert {r["split"] for r in rows} == {"train", "heldout"} and all(r["predicted_s"] > 0 for r in rows)
    held = [abs(r["error"]) for r in rows if r["split"] == "heldout"]
    assert device["heldout_mean_abs_error"] == pytest.approx(sum(held) / len(held))
    assert CostModel(model_shape("tiny", tiny_model.config, "float32"), hw).decode(2, 64).total_s > 0

    monkeypatch.setattr(profile_cli, "run_profile", lambda cfg, progress: doc)  # the CLI prints the table
    assert profile_cli.main(["--out", str(tmp_path / "cli.json"), "--quick", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "cost-model device" in printed and f"mean |error| {device['heldout_mean_abs_error']:.1%}" in printed


def test_profile_without_transfer(tiny_model: LlamaModel) -> None:
    cfg = replace(QUICK, transfer=False, decode_batches=(1, 3), decode_kv_tokens=(8, 40), warmup=0)
    doc = run_profile(cfg, model=tiny_model, progress=False)
    assert doc["not_measured"]["transfer"] == "disabled"
    assert doc["model"]["transfer"] is None
    assert LatencyModel.from_json(json.dumps(doc["model"])).decode.predict(3, 120) > 0


def test_cli_flags() -> None:
    args = build_parser().parse_args(["--out", "x.json", "--quick", "--chunks", "4,8", "--no-transfer"])
    cfg = config_from_args(args)
    assert cfg.chunks == (4, 8) and cfg.histories == QUICK.histories and not cfg.transfer
    assert config_from_args(build_parser().parse_args(["--out", "x.json"])) == ProfileConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--out", "x.json", "--chunks", "a,b"])


def test_spindle_profile_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        spindle_main(["profile", "--help"])
    assert e.value.code == 0 and "--sp-sizes" in capsys.readouterr().out


def test_bad_config(tiny_model: LlamaModel) -> None:
    with pytest.raises(ValueError):
        ProfileConfig(chunks=())
    with pytest.raises(ValueError):
        ProfileConfig(repeats=0)
    with pytest.raises(ValueError, match="context"):
        run_profile(replace(QUICK, histories=(0, 500), transfer=False), model=tiny_model, progress=False)


def test_sp_sizes_are_measured_on_real_sp_groups(tmp_path: Path) -> None:
    hf, _ = tiny_llama(0)
    hf.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    cfg = replace(QUICK, model=str(tmp_path / "tiny"), transfer=False, sp_sizes=(1, 2))
    doc = run_profile(cfg, progress=False)
    rows = doc["samples"]["prefill"]["rows"]
    sp2 = {(r[1], r[2]) for r in rows if r[0] == 2}
    assert sp2 == {(0, 8), (8, 16), (0, 32), (32, 8), (40, 16)} and all(r[3] > 0 for r in rows)
    assert "prefill_sp_gt_1" not in doc["not_measured"]
    assert load_profile_from(doc).prefill.sp_sizes() == [1, 2]
    assert doc["device"]["params"][-1] == "ring_step_s" and {r["sp"] for r in doc["device"]["validation"]} == {1, 2}
    with pytest.raises(ValueError, match="including 1"):
        ProfileConfig(sp_sizes=(2,))


def load_profile_from(doc: dict) -> LatencyModel:
    return LatencyModel.from_json(json.dumps(doc["model"]))
