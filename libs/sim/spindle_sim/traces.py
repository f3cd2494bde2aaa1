"""Trace files, read into (and written from) ``TraceRequest`` lists: Spindle's own JSONL (vLLM's custom dataset with
extra keys) and CSV (Vidur's columns), and the public formats users record their traffic in: the Mooncake / AIPerf
JSONL trace and BurstGPT's CSV. ``read_trace`` tells them apart by their fields; ``replay`` takes N requests of a
trace at a chosen mean rate (the simulator's ``trace:PATH`` workload, ``spindle sim --trace FILE``).

JSONL: ``vllm bench serve --dataset-name custom --dataset-path F.jsonl`` reads only ``"prompt"`` (text, which it
tokenizes itself) and the optional ``"output_tokens"`` (used when ``--custom-output-len`` is -1 or unset); it
has no token-id field, so a trace cannot carry exact token ids. Each line therefore holds a filler ``"prompt"``
of about ``num_prefill_tokens`` tokens (one ``" hello"`` word each, ~1 token in common BPE vocabularies; vLLM
adds the chat template unless ``--skip-chat-template``), ``"output_tokens"``, and three extra keys vLLM ignores
but Spindle's load generator and simulator read back exactly: ``"num_prefill_tokens"``, ``"arrived_at"`` and
``"service_class"`` (``"interactive"`` or ``"batch"``).
vLLM shuffles custom datasets (seed 0) unless ``--disable-shuffle`` and applies its own ``--request-rate``;
replay with ``--disable-shuffle`` to keep the file order. Files without ``num_prefill_tokens`` (plain vLLM
datasets) need ``count_tokens``; lines without ``arrived_at`` get 0.0, without ``service_class``
``"interactive"``.

CSV: header ``arrived_at,num_prefill_tokens,num_decode_tokens,service_class``: Vidur's request-trace columns
(readers that pick columns by name, as Vidur does, skip the fourth) and the service class; times are written with
``repr`` so floats round-trip exactly. Files without the ``service_class`` column (older traces, plain Vidur
ones) read as interactive.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

SERVICE_CLASSES = ("interactive", "batch")  # spindle_protocol's ServiceClass


@dataclass(frozen=True)
class TraceRequest:
    arrived_at: float
    num_prefill_tokens: int
    num_decode_tokens: int
    service_class: str = "interactive"  # "batch": throughput work without a latency SLO
    # a Mooncake trace's block hashes of the prompt (equal ids: equal prompt blocks), read and written, not used yet
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrived_at) and self.arrived_at >= 0):
            raise ValueError(f"arrived_at must be finite and >= 0, got {self.arrived_at}")
        if self.num_prefill_tokens < 1 or self.num_decode_tokens < 1:
            raise ValueError(f"token counts must be >= 1, got {self.num_prefill_tokens}, {self.num_decode_tokens}")
        if self.service_class not in SERVICE_CLASSES:
            raise ValueError(f"service_class must be one of {SERVICE_CLASSES}, got {self.service_class!r}")


CSV_COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens", "service_class")
REQUIRED_CSV_COLUMNS = CSV_COLUMNS[:3]


def filler_prompt(num_tokens: int) -> str:
    return " ".join(["hello"] * num_tokens)


def write_csv(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in requests:
            writer.writerow([repr(r.arrived_at), r.num_prefill_tokens, r.num_decode_tokens, r.service_class])


def read_csv(path: str | Path) -> list[TraceRequest]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(REQUIRED_CSV_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: CSV lacks columns {sorted(missing)}")
        try:
            return [
                TraceRequest(
                    float(row["arrived_at"]),
                    int(row["num_prefill_tokens"]),
                    int(row["num_decode_tokens"]),
                    row.get("service_class") or "interactive",
                )
                for row in reader
            ]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: bad row at line {reader.line_num}: {e}") from e


def write_jsonl(
    path: str | Path, requests: Iterable[TraceRequest], prompt_fn: Callable[[int], str] = filler_prompt
) -> None:
    with open(path, "w") as f:
        for r in requests:
            line = {
                "prompt": prompt_fn(r.num_prefill_tokens),
                "output_tokens": r.num_decode_tokens,
                "num_prefill_tokens": r.num_prefill_tokens,
                "arrived_at": r.arrived_at,
                "service_class": r.service_class,
            }
            f.write(json.dumps(line) + "\n")


def _json_lines(path: str | Path, parse: Callable[[dict], TraceRequest]) -> list[TraceRequest]:
    """`parse` of every non-blank line's JSON object, a bad line named by its number."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
                if not isinstance(item, dict):
                    raise ValueError("a line must be a JSON object")
                out.append(parse(item))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e!r}") from e
    return out


def read_jsonl(path: str | Path, count_tokens: Callable[[str], int] | None = None) -> list[TraceRequest]:
    def parse(item: dict) -> TraceRequest:
        prompt = item["prompt"]
        if "output_tokens" not in item:
            raise ValueError("no 'output_tokens'")
        if "num_prefill_tokens" in item:
            prefill = int(item["num_prefill_tokens"])
        elif count_tokens is not None:
            prefill = count_tokens(prompt)
        else:
            raise ValueError("no 'num_prefill_tokens' and no count_tokens given")
        arrived_at, service_class = float(item.get("arrived_at", 0.0)), item.get("service_class", "interactive")
        return TraceRequest(arrived_at, prefill, int(item["output_tokens"]), service_class)

    return _json_lines(path, parse)


# ---- Mooncake / AIPerf JSONL ----
# One request a line: "timestamp" (arrival, milliseconds), "input_length", "output_length" (tokens) and optionally
# "hash_ids" (one id per prompt block: requests sharing a prefix share its first ids). Mooncake's FAST'25 traces,
# AIPerf's `--custom-dataset-type mooncake_trace` and Dynamo's benchmarks use it.
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")


def write_mooncake(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            line = {"timestamp": round(r.arrived_at * 1000.0, 3), "input_length": r.num_prefill_tokens,
                    "output_length": r.num_decode_tokens, "hash_ids": list(r.hash_ids)}  # fmt: skip
            f.write(json.dumps(line) + "\n")


def read_mooncake(path: str | Path) -> list[TraceRequest]:
    def parse(item: dict) -> TraceRequest:
        if "timestamp" not in item and "delay" in item:
            raise ValueError("multi-turn session lines (delay, no timestamp) are not supported: give each request "
                             "its arrival timestamp")  # fmt: skip
        if missing := [k for k in MOONCAKE_KEYS if k not in item]:
            raise ValueError(f"no {', '.join(repr(k) for k in missing)}")
        hashes = item.get("hash_ids") or ()
        if not isinstance(hashes, list | tuple) or not all(isinstance(h, int) for h in hashes):
            raise ValueError("'hash_ids' must be a list of integers")
        at = float(item["timestamp"]) / 1000.0
        return TraceRequest(at, int(item["input_length"]), int(item["output_length"]), hash_ids=tuple(hashes))

    return _json_lines(path, parse)


# ---- BurstGPT CSV ----
# Columns "Timestamp" (seconds since the trace began), "Model", "Request tokens", "Response tokens", "Total tokens",
# "Log Type". Rows with 0 request or response tokens are the trace's failed requests: they are skipped.
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def read_burstgpt(path: str | Path) -> list[TraceRequest]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(BURSTGPT_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: a BurstGPT CSV needs the columns {', '.join(sorted(missing))}")
        out: list[TraceRequest] = []
        for row in reader:
            try:
                at, prompt, output = float(row["Timestamp"]), int(row["Request tokens"]), int(row["Response tokens"])
                if prompt < 1 or output < 1:
                    continue  # a failed request of the trace
                out.append(TraceRequest(at, prompt, output))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: bad row at line {reader.line_num}: {e}") from e
    return out


def read_trace(path: str | Path, count_tokens: Callable[[str], int] | None = None) -> list[TraceRequest]:
    """Any trace file this module reads, told apart by its fields: a `.jsonl` / `.json` whose first line has
    "input_length" is a Mooncake trace, else Spindle's / vLLM's JSONL (`read_jsonl`, `count_tokens` for lines
    without "num_prefill_tokens"); a `.csv` with a "Request tokens" column is BurstGPT's, else Spindle's / Vidur's."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        with open(path, newline="") as f:
            first = next((line for line in f if line.strip()), "")
    except OSError as e:
        raise ValueError(f"cannot read the trace {path}: {e}") from e
    if suffix in (".jsonl", ".json"):
        try:
            mooncake = "input_length" in json.loads(first) if first else False
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:1: not JSON: {e}") from e
        return read_mooncake(path) if mooncake else read_jsonl(path, count_tokens)
    if suffix == ".csv":
        return read_burstgpt(path) if "Request tokens" in first else read_csv(path)
    raise ValueError(f"{path}: a trace must be .jsonl (Mooncake / AIPerf, or vLLM's custom dataset) or .csv "
                     "(BurstGPT, or Vidur's columns)")  # fmt: skip


def replay(trace: Sequence[TraceRequest], num_requests: int, rate: float | None = None) -> list[TraceRequest]:
    """`num_requests` requests of `trace` in arrival order, the first arriving at 0: the file repeated after itself
    when it is shorter (each copy one mean gap after the last), and the arrival times scaled so the mean rate is
    `rate` req/s (None: as recorded; inf: all at once). The lengths, classes and hash ids are the trace's."""
    if not trace:
        raise ValueError("the trace has no requests")
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if rate is not None and (math.isnan(rate) or rate <= 0):
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    ordered = sorted(trace, key=lambda r: r.arrived_at)
    t0 = ordered[0].arrived_at
    span = ordered[-1].arrived_at - t0
    gap = span / (len(ordered) - 1) if len(ordered) > 1 and span > 0 else 1.0
    period = span + gap
    times = [(k // len(ordered)) * period + ordered[k % len(ordered)].arrived_at - t0 for k in range(num_requests)]
    if rate is not None and num_requests:
        if math.isinf(rate):
            times = [0.0] * num_requests
        elif times[-1] > 0:
            scale = (num_requests - 1) / (times[-1] * rate)  # the wanted mean gap over the recorded one
            times = [t * scale for t in times]
        else:  # recorded all at once: spread evenly at the rate
            times = [k / rate for k in range(num_requests)]
    return [replace(ordered[k % len(ordered)], arrived_at=t) for k, t in enumerate(times)]
