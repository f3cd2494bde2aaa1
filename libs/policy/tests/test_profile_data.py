"""A profile's data without the engine: samples fit to a `LatencyModel`, the document written and read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle_costmodel.hardware import CPU, hardware_from_dict, hardware_to_dict
from spindle_policy.latency import LatencyModel
from spindle_policy.profile_data import (
    SAMPLE_COLUMNS,
    SP_NOT_MEASURED,
    fit_profile,
    load_profile,
    load_profile_hardware,
    profile_document,
    write_profile,
)

PREFILL = {1: (1e-3, 2e-5, 1e-9, 3e-9), 2: (2e-3, 1e-5, 6e-10, 2e-9)}  # (a, b, c, d) of Tetris Eq. 1
DECODE = (2e-3, 1e-4, 1e-7)  # (e, f, g)
TRANSFER = (1e-4, 1e9)  # latency s, bytes/s


def prefill_rows(sizes: tuple[int, ...] = (1,)) -> list[list[float]]:
    rows = []
    for sp in sizes:
        a, b, c, d = PREFILL[sp]
        for hist in (0, 256, 1024):
            for chunk in (64, 256, 512):
                rows.append([sp, hist, chunk, a + b * chunk + c * hist * chunk + d * chunk**2])
    return rows


def decode_rows() -> list[list[float]]:
    e, f, g = DECODE
    return [[1, 1, b, b * kv, e + f * b + g * b * kv] for b in (1, 4, 8) for kv in (256, 1024, 2048)]


def transfer_rows() -> list[list[float]]:
    latency, bandwidth = TRANSFER
    return [[n, latency + n / bandwidth] for n in (2**16, 2**20, 2**24)]


def test_fit_recovers_the_models_behind_the_samples() -> None:
    fit = fit_profile(prefill_rows((1, 2)), decode_rows(), transfer_rows(), source="test")
    latency = fit.latency
    assert latency.source == "test" and latency.prefill is not None and latency.prefill.sp_sizes() == [1, 2]
    for sp, (a, b, c, d) in PREFILL.items():
        assert latency.prefill.predict(sp, 512, 128) == pytest.approx(a + b * 128 + c * 512 * 128 + d * 128**2)
    assert latency.decode is not None
    assert latency.decode.predict(3, 3000) == pytest.approx(DECODE[0] + DECODE[1] * 3 + DECODE[2] * 3000)
    assert latency.transfer is not None and latency.transfer.predict(2**22) == pytest.approx(1e-4 + 2**22 / 1e9)
    assert fit.not_measured == {}
    assert latency.batch_prefill is not None and sorted(latency.batch_prefill.coeffs) == [1, 2]  # Eq. 7 (LoongServe)
    for sp, (a, b, _, d) in PREFILL.items():  # whole prompts: Eq. 7 of one request is Eq. 1 without history
        assert latency.batch_prefill.predict(sp, [700]) == pytest.approx(a + b * 700 + d * 700**2, rel=1e-6)
    assert set(fit.fit_error["prefill"]) == {"1", "2"} and set(fit.fit_error["decode"]) == {"tp1_kvp1"}
    assert max(fit.fit_error["prefill"].values()) < 1e-6 and fit.fit_error["transfer"] < 1e-6


def test_fit_says_what_was_not_measured() -> None:
    fit = fit_profile(prefill_rows(), decode_rows(), [], source="test", transfer_measured=False)
    assert fit.not_measured == {"prefill_sp_gt_1": SP_NOT_MEASURED, "transfer": "disabled"}
    assert fit.latency.transfer is None and fit.fit_error["transfer"] is None

    shrinking = [[2**12, 3e-3], [2**20, 2e-3], [2**24, 1e-3]]  # noise: bigger is faster
    fit = fit_profile(prefill_rows(), decode_rows(), shrinking, source="test")
    assert fit.latency.transfer is None and fit.not_measured["transfer"].startswith("fit failed:")


def test_document_round_trip(tmp_path: Path) -> None:
    rows = prefill_rows(), decode_rows(), transfer_rows()
    fit = fit_profile(*rows, source="test")
    doc = profile_document(
        machine={"node": "here"},
        config={"model": "tiny"},
        prefill_rows=rows[0],
        decode_rows=rows[1],
        transfer_rows=rows[2],
        fit=fit,
        wall_s=1.5,
    )
    assert list(doc) == ["machine", "config", "samples", "not_measured", "model", "fit_error", "wall_s"]
    assert {kind: doc["samples"][kind]["columns"] for kind in SAMPLE_COLUMNS} == SAMPLE_COLUMNS
    out = tmp_path / "profile.json"
    write_profile(doc, out)
    assert json.loads(out.read_text())["samples"]["decode"]["rows"] == rows[1]
    assert load_profile(out) == fit.latency

    out.write_text(json.dumps({"model": fit.latency.to_json()}))  # the model as a JSON string reads too
    assert load_profile(out) == fit.latency
    out.write_text(json.dumps({"samples": {}}))
    with pytest.raises(ValueError, match="not a spindle profile"):
        load_profile(out)
    assert isinstance(LatencyModel.from_json(json.dumps(doc["model"])), LatencyModel)


def test_device_section_round_trip(tmp_path: Path) -> None:
    rows = prefill_rows(), decode_rows(), transfer_rows()
    fit = fit_profile(*rows, source="test")
    fitted = CPU.with_efficiency(gemm=0.5)
    device = {"hardware": hardware_to_dict(fitted), "validation": [], "heldout_mean_abs_error": 0.1}
    common = dict(machine={}, config={}, prefill_rows=rows[0], decode_rows=rows[1], transfer_rows=rows[2], fit=fit)
    doc = profile_document(**common, wall_s=1.0, device=device)
    assert list(doc)[-1] == "device"
    out = tmp_path / "profile.json"
    write_profile(doc, out)
    hardware = load_profile_hardware(out)
    assert hardware is not None and hardware_from_dict(hardware) == fitted
    assert load_profile(out) == fit.latency

    write_profile(profile_document(**common, wall_s=1.0), out)  # an older profile: no device section
    assert load_profile_hardware(out) is None and load_profile(out) == fit.latency
    with pytest.raises(ValueError, match="hardware"):
        profile_document(**common, wall_s=1.0, device={"validation": []})
    out.write_text(json.dumps({"model": doc["model"], "device": {"hardware": {"name": "cpu"}}}))
    with pytest.raises(ValueError, match="hardware"):
        load_profile_hardware(out)
    out.write_text(json.dumps({"samples": {}}))
    with pytest.raises(ValueError, match="not a spindle profile"):
        load_profile_hardware(out)
