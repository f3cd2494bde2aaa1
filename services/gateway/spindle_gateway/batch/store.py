"""The Batch API's persistent state in one SQLite file: uploaded files (bytes and metadata), batches, and each
batch line's result. A gateway restart opens the same file and finds every batch where it was: the lines that
ended keep their results, the others run again.

SQLite, not a dict: the state outlives the process. One connection, used from the gateway's event loop only (the
statements are small; file contents are read and written whole, bounded by the upload quota).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, created_at INTEGER NOT NULL,
    bytes INTEGER NOT NULL, content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, body TEXT NOT NULL  -- the Batch object as JSON, status and counts included
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, request TEXT NOT NULL,
    result TEXT, ok INTEGER,  -- NULL until the line has ended; ok: 1 to the output file, 0 to the error file
    PRIMARY KEY (batch_id, line)
);
"""

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # a runner owns these


@dataclass(frozen=True)
class Line:
    line: int
    custom_id: str
    request: dict[str, Any]  # {"method", "url", "body"}


class BatchStore:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)  # autocommit; multi-statement writes use BEGIN
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ---- files ----

    def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = "file-" + uuid.uuid4().hex
        created = int(time.time())
        self._db.execute(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", (file_id, purpose, filename, created, len(content), content)
        )
        return self.file(file_id)  # type: ignore[return-value]

    def file(self, file_id: str) -> dict[str, Any] | None:
        row = self._db.execute(
            "SELECT id, purpose, filename, created_at, bytes FROM files WHERE id = ?", (file_id,)
        ).fetchone()
        return None if row is None else _file_object(row)

    def files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, purpose, filename, created_at, bytes FROM files "
            "WHERE ?1 IS NULL OR purpose = ?1 ORDER BY rowid",
            (purpose,),
        )
        return [_file_object(r) for r in rows]

    def content(self, file_id: str) -> bytes | None:
        row = self._db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def delete_file(self, file_id: str) -> bool:
        return self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # ---- batches ----

    def add_batch(self, batch: dict[str, Any], lines: list[Line]) -> None:
        self._db.execute("BEGIN")
        try:
            self._db.execute("INSERT INTO batches VALUES (?, ?)", (batch["id"], json.dumps(batch)))
            self._db.executemany(
                "INSERT INTO lines (batch_id, line, custom_id, request) VALUES (?, ?, ?, ?)",
                [(batch["id"], x.line, x.custom_id, json.dumps(x.request)) for x in lines],
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        row = self._db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def batches(self) -> list[dict[str, Any]]:
        """Every batch, oldest first."""
        return [json.loads(r[0]) for r in self._db.execute("SELECT body FROM batches ORDER BY rowid")]

    def save_batch(self, batch: dict[str, Any]) -> None:
        self._db.execute("UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    def pending_lines(self, batch_id: str) -> list[Line]:
        rows = self._db.execute(
            "SELECT line, custom_id, request FROM lines WHERE batch_id = ? AND result IS NULL ORDER BY line",
            (batch_id,),
        )
        return [Line(r[0], r[1], json.loads(r[2])) for r in rows]

    def finish_line(self, batch_id: str, line: int, result: dict[str, Any], ok: bool) -> None:
        self._db.execute(
            "UPDATE lines SET result = ?, ok = ? WHERE batch_id = ? AND line = ? AND result IS NULL",
            (json.dumps(result), int(ok), batch_id, line),
        )

    def counts(self, batch_id: str) -> tuple[int, int, int]:
        """(total, completed, failed) lines."""
        row = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(ok = 1), 0), COALESCE(SUM(ok = 0), 0) FROM lines WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return int(row[0]), int(row[1]), int(row[2])

    def results(self, batch_id: str, ok: bool) -> bytes:
        """The output (ok) or error file's JSONL: the ended lines' results in input order."""
        rows = self._db.execute(
            "SELECT result FROM lines WHERE batch_id = ? AND ok = ? ORDER BY line", (batch_id, int(ok))
        )
        return b"".join(r[0].encode() + b"\n" for r in rows)


def _file_object(row: tuple) -> dict[str, Any]:
    file_id, purpose, filename, created, size = row
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }
