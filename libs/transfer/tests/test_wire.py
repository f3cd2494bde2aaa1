import threading

import pytest
import torch

from spindle_protocol import TensorHeader, header_for
from spindle_transfer import DataPlane, header_of
from spindle_transfer.wire import (
    ACCEPT,
    HEADER_WORDS,
    MAGIC,
    decode_header,
    decode_signal,
    encode_header,
    encode_signal,
)


@pytest.mark.parametrize(
    "dtype,shape",
    [("float32", [2, 3, 7, 5, 1]), ("bfloat16", [9]), ("uint8", [1, 2, 3, 4, 5, 6, 7, 8]), ("int64", [0])],
)
def test_header_round_trip(dtype: str, shape: list[int]) -> None:
    header = header_for(dtype, shape)
    words = encode_header(header)
    assert words.dtype == torch.int64 and words.shape == (HEADER_WORDS,)
    assert decode_header(words) == header


def test_malformed_headers_are_rejected() -> None:
    good = encode_header(header_for("float32", [4, 5]))
    bad = []
    for index, value in [(0, 123), (1, 99), (2, 77), (3, 0), (3, 9), (6, 1), (12, 81)]:
        w = good.clone()
        w[index] = value
        bad.append(w)
    bad.append(good[:-1])
    negative = good.clone()
    negative[4] = -4
    bad.append(negative)
    for words in bad:
        with pytest.raises(ValueError):
            decode_header(words)


def test_signals() -> None:
    assert decode_signal(encode_signal(ACCEPT), (ACCEPT,)) == ACCEPT
    with pytest.raises(ValueError):
        decode_signal(torch.tensor([MAGIC, ACCEPT]), (ACCEPT,))
    with pytest.raises(ValueError):
        decode_signal(encode_signal(5), (ACCEPT,))


def test_header_of() -> None:
    assert header_of(torch.zeros(2, 3, dtype=torch.bfloat16)) == TensorHeader(dtype="bfloat16", shape=[2, 3], nbytes=12)
    with pytest.raises(ValueError):
        header_of(torch.zeros(2, dtype=torch.bool))


def test_new_tag_unique_across_threads_and_ranks() -> None:
    planes = [DataPlane(rank, 3, "gloo", max_workers=1) for rank in range(3)]
    seen: list[list[int]] = [[] for _ in range(8)]

    def take(i: int) -> None:
        seen[i] = [planes[i % 3].new_tag() for _ in range(2000)]

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tags = [t for s in seen for t in s]
    assert len(tags) == len(set(tags)) and all(0 < t < 2**31 for t in tags)
    assert all((t - 1) % 3 == i % 3 for i, s in enumerate(seen) for t in s)


def test_tags_wrap_below_the_rank_group_range() -> None:
    from spindle_attention.distributed.comm import RANK_GROUP_TAG

    plane = DataPlane(5, 7, "gloo", max_workers=1)
    plane._next_tag = plane._tag_slots - 2
    tags = [plane.new_tag() for _ in range(4)]
    assert all(0 < t < RANK_GROUP_TAG for t in tags) and tags[2] == 6


def test_send_checks_before_touching_the_network() -> None:
    plane = DataPlane(0, 2, "gloo", max_workers=1)
    t = torch.zeros(4, 5)
    with pytest.raises(ValueError):
        plane.send(t, 1, 7, header_for("float32", [5, 4]))
    with pytest.raises(ValueError):
        plane.send(t, 0, 7, header_for("float32", [4, 5]))  # to itself
    with pytest.raises(ValueError):
        plane.recv(header_for("float32", [4, 5]), 1, 7, out=torch.zeros(5, 4))
    with pytest.raises(ValueError):
        plane.recv(header_for("float32", [4, 5]), 1, -1)
