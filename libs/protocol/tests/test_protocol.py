"""Messages round-trip, bad bytes are refused, prompts of any length cross a real nats-server intact."""

import asyncio
import random

import msgspec
import pytest

from spindle_protocol import ProtocolError, decode, encode, subjects
from spindle_protocol.bus import Bus
from spindle_protocol.messages import (
    InstanceInfo,
    PrefillDone,
    Prompt,
    RequestFinished,
    RequestSpec,
    Resharded,
    RunPrefill,
    Sampling,
    TensorHeader,
    WorkerEvent,
)
from spindle_protocol.nats_server import start_nats_server
from spindle_protocol.prompts import delete_prompt, load_prompt, put_prompt
from spindle_protocol.tensor_header import check_header, header_for


def _spec(tokens: list[int]) -> RequestSpec:
    return RequestSpec(
        request_id="r-1",
        prompt=Prompt(num_tokens=len(tokens), token_ids=tokens),
        sampling=Sampling(max_tokens=4),
        arrival_time=1.0,
        deadline=2.0,
    )


def test_round_trip_and_tagged_events():
    cmd = RunPrefill(request=_spec([1, 2, 3]), decode_instance="decode-0", decode_rank=3)
    assert decode(encode(cmd), RunPrefill) == cmd
    ev = RequestFinished(request_id="r", instance_id="d", finish_reason="stop", num_output_tokens=2)
    assert decode(encode(ev), WorkerEvent) == ev
    assert isinstance(
        decode(encode(PrefillDone(request_id="r", instance_id="p", seconds=1.0, finished=False)), WorkerEvent),
        PrefillDone,
    )
    switched = Resharded(instance_id="e0", config="TP2PP2", seconds=0.5, weight_bytes=10, kv_bytes=4)
    assert decode(encode(switched), WorkerEvent) == switched  # a group's event: no request
    with pytest.raises(ProtocolError):
        decode(encode(ev), RunPrefill)
    with pytest.raises(ProtocolError):
        decode(b"\x93garbage", WorkerEvent)


def test_instance_info_device_round_trips_and_defaults_to_unreported():
    fields = {"instance_id": "prefill-0", "role": "prefill", "rank": 1, "pid": 7, "started_at": 1.0, "updated_at": 2.0}
    on_gpu = InstanceInfo(**fields, device="cuda:1")
    assert decode(encode(on_gpu), InstanceInfo).device == "cuda:1"

    class OlderInstanceInfo(msgspec.Struct, frozen=True, kw_only=True):  # a sender from before the field
        instance_id: str
        role: str
        rank: int
        pid: int
        started_at: float
        updated_at: float

    older = decode(msgspec.msgpack.encode(OlderInstanceInfo(**fields)), InstanceInfo)
    assert older.device == "" and older == InstanceInfo(**fields)


def test_subject_tokens_are_checked():
    assert subjects.stream("cmpl-abc_1") == "spindle.stream.cmpl-abc_1"
    for bad in ("a.b", "a b", "*", ">", "", "x" * 129):
        with pytest.raises(ValueError):
            subjects.stream(bad)


def test_tensor_headers():
    h = header_for("float32", [2, 30, 7, 3, 64])
    check_header(h, expect=h)
    with pytest.raises(ValueError, match="does not match"):
        check_header(h, expect=header_for("float32", [2, 30, 8, 3, 64]))
    with pytest.raises(ValueError, match="bytes"):
        check_header(TensorHeader(dtype="float32", shape=[4], nbytes=8))
    with pytest.raises(ValueError, match="dtype"):
        check_header(TensorHeader(dtype="object", shape=[4], nbytes=4))
    with pytest.raises(ValueError, match="limit"):
        check_header(header_for("uint8", [10]), max_bytes=5)


def test_300k_token_prompt_crosses_nats_through_the_object_store():
    """The gateway's code path (put_prompt) to a worker's (load_prompt) over a real nats-server."""
    tokens = [random.Random(0).randrange(49152) for _ in range(300_000)]

    async def main() -> None:
        with start_nats_server() as server:
            gateway = await Bus.connect(server.url, "gateway")
            worker = await Bus.connect(server.url, "worker")
            got: asyncio.Future = asyncio.get_running_loop().create_future()

            async def on_run(cmd: RunPrefill, raw) -> None:
                got.set_result((len(raw.data), await load_prompt(worker, cmd.request.prompt)))

            await worker.subscribe(subjects.prefill_run("prefill-0"), RunPrefill, on_run)
            prompt = await put_prompt(gateway, "cmpl-big", tokens)
            assert prompt.token_ids is None and prompt.ref is not None
            spec = RequestSpec(
                request_id="cmpl-big", prompt=prompt, sampling=Sampling(max_tokens=1), arrival_time=0.0, deadline=1.0
            )
            await gateway.publish(
                subjects.prefill_run("prefill-0"), RunPrefill(request=spec, decode_instance="d", decode_rank=1)
            )
            size, loaded = await asyncio.wait_for(got, 30)
            assert size < 4096 and loaded == tokens
            await delete_prompt(gateway, prompt)
            small = await put_prompt(gateway, "cmpl-small", tokens[:100])
            assert small.token_ids == tokens[:100] and await load_prompt(worker, small) == tokens[:100]
            await gateway.close()
            await worker.close()

    asyncio.run(main())
