"""A latency profile's data: the `LatencyModel` fitted to samples measured on the engine, written as JSON and
read back.

`spindle profile` (`spindle_launcher.profile`) runs the engine and measures; what it measured comes here as
sample rows, each ending in median seconds. The document it writes is {machine, config, samples, not_measured,
model, fit_error, wall_s, device}; `model` is the fitted `LatencyModel`, all that `load_profile` reads. `device`
(absent from older profiles) is this machine as a cost-model device: {measured, hardware (a
`spindle_costmodel` `hardware_to_dict`), params, validation, heldout_mean_abs_error, heldout_max_abs_error,
fit_mean_abs_error}, which `load_profile_hardware` reads; its validation rows are {kind, sp, history and tokens
(prefill) or batch and kv_tokens (decode, per request, where the decode samples count the whole batch's),
measured_s, predicted_s, error, split}. Numpy only: using a profile never needs the engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spindle_costmodel.hardware import hardware_from_dict

from .latency import BatchPrefillModel, DecodeStepModel, LatencyModel, PrefillLatencyModel, TransferModel

SP_NOT_MEASURED = "prefill for SP > 1 not measured (pass sp_sizes / --sp-sizes, e.g. 1,2,4)"
SAMPLE_COLUMNS = {
    "prefill": ["sp", "history", "chunk", "seconds"],
    "decode": ["tp", "kvp", "batch", "kv_tokens", "seconds"],
    "transfer": ["bytes", "seconds"],
}

Rows = Sequence[Sequence[float]]


@dataclass(frozen=True)
class ProfileFit:
    """The fitted model, its mean relative errors on its own samples, and what was not measured (and why)."""

    latency: LatencyModel
    fit_error: dict[str, Any]
    not_measured: dict[str, str]


def transfer_error(model: TransferModel, rows: Rows) -> float:
    """Mean relative error of `model` on [[bytes, seconds], ...]."""
    return float(np.mean([abs(model.predict(b) - s) / s for b, s in rows]))


def fit_profile(
    prefill_rows: Rows, decode_rows: Rows, transfer_rows: Rows, *, source: str, transfer_measured: bool = True
) -> ProfileFit:
    """Least-squares fit of the prefill (per SP size), decode and transfer models to measured samples.

    Rows are laid out as `SAMPLE_COLUMNS`. A transfer fit that fails (sizes too small to rise above the noise)
    leaves the transfer model out and says why in `not_measured`."""
    prefill = PrefillLatencyModel.fit([tuple(r) for r in prefill_rows])
    decode = DecodeStepModel.fit([tuple(r) for r in decode_rows])
    measured_sp = any(int(r[0]) > 1 for r in prefill_rows)
    not_measured = {} if measured_sp else {"prefill_sp_gt_1": SP_NOT_MEASURED}
    transfer = None
    if not transfer_measured:
        not_measured["transfer"] = "disabled"
    else:
        try:
            transfer = TransferModel.fit([tuple(r) for r in transfer_rows])
        except ValueError as e:
            not_measured["transfer"] = f"fit failed: {e}"
    whole = [(int(r[0]), [r[2]], r[3]) for r in prefill_rows if r[1] == 0]  # whole prompts: Eq. 7 per SP size
    try:
        batch = BatchPrefillModel.fit(whole)
    except ValueError as e:
        batch, not_measured["batch_prefill"] = None, f"fit failed: {e}"
    latency = LatencyModel(prefill=prefill, batch_prefill=batch, decode=decode, transfer=transfer, source=source)
    fit_error: dict[str, Any] = {
        "prefill": {str(sp): e for sp, e in prefill.fit_error().items()},
        "decode": {f"tp{tp}_kvp{kvp}": e for (tp, kvp), e in decode.fit_error().items()},
        "transfer": transfer_error(transfer, transfer_rows) if transfer else None,
    }
    return ProfileFit(latency=latency, fit_error=fit_error, not_measured=not_measured)


def profile_document(
    *,
    machine: dict[str, Any],
    config: dict[str, Any],
    prefill_rows: Rows,
    decode_rows: Rows,
    transfer_rows: Rows,
    fit: ProfileFit,
    wall_s: float,
    device: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The profile JSON document (what `write_profile` writes and `load_profile` reads the model of); `device`,
    when given, is its cost-model device section."""
    rows = {"prefill": prefill_rows, "decode": decode_rows, "transfer": transfer_rows}
    doc = {
        "machine": machine,
        "config": config,
        "samples": {kind: {"columns": SAMPLE_COLUMNS[kind], "rows": rows[kind]} for kind in SAMPLE_COLUMNS},
        "not_measured": fit.not_measured,
        "model": json.loads(fit.latency.to_json()),
        "fit_error": fit.fit_error,
        "wall_s": wall_s,
    }
    if device is not None:
        if not isinstance(device.get("hardware"), dict):
            raise ValueError("a profile's device section needs a 'hardware' dict")
        doc["device"] = device
    return doc


def write_profile(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1))


def _read(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "model" not in doc:
        raise ValueError(f"{path} is not a spindle profile (no 'model' key)")
    return doc


def load_profile(path: str | Path) -> LatencyModel:
    """The `LatencyModel` of a profile JSON written by `spindle profile`."""
    model = _read(path)["model"]
    return LatencyModel.from_json(model if isinstance(model, str) else json.dumps(model))


def load_profile_hardware(path: str | Path) -> dict[str, Any] | None:
    """The cost-model device a profile fitted (`spindle_costmodel.hardware.hardware_from_dict` builds it), or None
    for a profile written before it had one."""
    device = _read(path).get("device")
    if device is None:
        return None
    hardware = device.get("hardware") if isinstance(device, dict) else None
    if not isinstance(hardware, dict):
        raise ValueError(f"{path}: the device section has no 'hardware' description")
    hardware_from_dict(hardware)  # ValueError when it does not describe one
    return hardware
