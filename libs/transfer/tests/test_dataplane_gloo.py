"""Real two-rank gloo group in spawned processes (one run, several assertions)."""

from pathlib import Path
from typing import Any

import pytest

from spindle_transfer.testing import ROUND_TRIP_CASES, run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks("two_rank_checks", 2, Path(tmp_path_factory.mktemp("gloo")), timeout=90)


def test_bitwise_round_trips(results: list[dict[str, Any]]) -> None:
    receiver = results[1]
    assert [receiver.get(f"roundtrip_{i}") for i in range(len(ROUND_TRIP_CASES))] == [True] * len(ROUND_TRIP_CASES)


def test_concurrent_transfers_with_different_tags(results: list[dict[str, Any]]) -> None:
    assert results[1]["concurrent"] is True


def test_header_mismatch_rejected_on_both_sides(results: list[dict[str, Any]]) -> None:
    sender, receiver = results
    for tag in (301, 302):
        assert receiver[f"mismatch_receiver_{tag}"] == "HeaderMismatchError"
        assert sender[f"mismatch_sender_{tag}"] == "HeaderMismatchError"
    assert receiver["after_mismatch"] is True


def test_cancel_and_timeout_do_not_hang_or_break_the_group(results: list[dict[str, Any]]) -> None:
    sender, receiver = results
    outcome, seconds, _ = receiver["cancel"]
    assert outcome == "TransferError" and seconds < 2
    outcome, seconds, message = receiver["timeout"]
    assert outcome == "TransferError" and 0.4 < seconds < 2 and "timed out" in message
    for tag in (401, 402, 405):  # late senders to abandoned receives are refused quickly
        outcome, seconds, message = sender[f"late_send_{tag}"]
        assert outcome == "TransferError" and seconds < 2 and "cancelled" in message
    outcome, seconds, _ = sender["sender_timeout"]
    assert outcome == "TransferError" and seconds < 2
    outcome, seconds, message = receiver["late_recv_403"]  # the abandoned send aborts rather than hangs
    assert outcome == "TransferError" and seconds < 2 and "gave up" in message
    assert receiver["after_cancel"] is True


def test_dead_peer_fails_fast(results: list[dict[str, Any]]) -> None:
    outcome, seconds, _ = results[1]["dead_peer"]
    assert outcome == "TransferError" and seconds < 10
