"""Trace files: vLLM custom-dataset JSONL and Vidur-style CSV, both round-tripping ``TraceRequest`` lists.

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
from collections.abc import Callable, Iterable
from pathlib import Path

from .workloads import TraceRequest

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


def read_jsonl(path: str | Path, count_tokens: Callable[[str], int] | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                item = json.loads(text)
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
                out.append(TraceRequest(arrived_at, prefill, int(item["output_tokens"]), service_class))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e!r}") from e
    return out
