"""NATS subjects of the control plane. README.md documents who publishes and who subscribes.

Request ids and instance ids are used as subject tokens, so they must match `TOKEN_RE`.
"""

from __future__ import annotations

import re

TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

PREFIX = "spindle"

# gateway -> scheduler, request-reply: AdmitRequest -> AdmitReply
ADMIT = f"{PREFIX}.scheduler.admit"
# gateway -> scheduler, request-reply: StatusQuery -> ClusterStatus
STATUS = f"{PREFIX}.scheduler.status"
# workers -> scheduler, publish: WorkerEvent (PrefillProgress, PrefillDone, TransferDone, RequestFinished, ...)
EVENTS = f"{PREFIX}.scheduler.events"
# scheduler -> watchers (the gateway's /dashboard), publish: Decision (each plan, iteration, rejection, ...)
DECISIONS = f"{PREFIX}.scheduler.decisions"
# anyone -> everyone, publish: Abort. Every service frees what it holds for the request.
ABORT = f"{PREFIX}.abort"
# launcher -> scheduler, publish: StackRestarts (the totals so far, on each restart and every few seconds)
RESTARTS = f"{PREFIX}.stack.restarts"
# spindle add -> launcher, request-reply: AddInstances -> AddedInstances
ADD_INSTANCES = f"{PREFIX}.stack.add"

# JetStream key-value bucket of live instances (key = instance id, value = InstanceInfo); entries expire.
REGISTRY_BUCKET = "spindle_instances"
# JetStream object store bucket for prompts too large for one message (name = request id).
PROMPT_BUCKET = "spindle_prompts"


def check_token(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not TOKEN_RE.match(value):
        raise ValueError(f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9_-]")
    return value


def stream(request_id: str) -> str:
    """prefill/decode/scheduler -> gateway, publish: StreamEvent (token ids with sequence numbers, end, error)."""
    return f"{PREFIX}.stream.{check_token(request_id, 'request id')}"


def prefill_run(instance_id: str) -> str:
    """scheduler -> one prefill instance, publish: RunPrefill."""
    return f"{PREFIX}.prefill.{check_token(instance_id, 'instance id')}.run"


def elastic_iteration(instance_id: str) -> str:
    """The scheduler -> an elastic instance: its next iteration (RunIteration), in the order sent."""
    return f"{PREFIX}.elastic.{check_token(instance_id)}.iteration"


def elastic_abandoned(instance_id: str) -> str:
    """A member of an iteration -> the other members: IterationAbandoned."""
    return f"{PREFIX}.elastic.{check_token(instance_id)}.abandoned"


def elastic_migrate_in(instance_id: str) -> str:
    """The scheduler -> the elastic instance a request's KV migrates to: MigrateKVIn."""
    return f"{PREFIX}.elastic.{check_token(instance_id)}.migrate_in"


def elastic_reshard(instance_id: str) -> str:
    """The scheduler -> a re-sharding elastic instance (Seesaw): ReshardInstance, in order with its iterations."""
    return f"{PREFIX}.elastic.{check_token(instance_id)}.reshard"


def elastic_migrate_out(instance_id: str) -> str:
    """A migration's destination -> its source elastic instance: MigrateKVOut."""
    return f"{PREFIX}.elastic.{check_token(instance_id)}.migrate_out"


def prefill_sp_chunk_done(instance_id: str) -> str:
    """prefill -> a prefill instance joining an SP plan at the next chunk, publish: SPChunkDone."""
    return f"{PREFIX}.prefill.{check_token(instance_id, 'instance id')}.sp_chunk_done"


def decode_reserve(instance_id: str) -> str:
    """prefill -> one decode instance, request-reply: ReserveKV -> ReserveReply (the transfer handshake)."""
    return f"{PREFIX}.decode.{check_token(instance_id, 'instance id')}.reserve"


def decode_parked(instance_id: str) -> str:
    """prefill -> one decode instance, publish: KVParked (the KV waits in the kvstore until blocks free)."""
    return f"{PREFIX}.decode.{check_token(instance_id, 'instance id')}.parked"


def decode_preempt(instance_id: str) -> str:
    """scheduler -> one decode instance, request-reply: PreemptDecode -> PreemptReply."""
    return f"{PREFIX}.decode.{check_token(instance_id, 'instance id')}.preempt"


def decode_move(instance_id: str) -> str:
    """scheduler -> one decode instance, request-reply: MoveParked -> MoveReply (it then publishes KVParked to
    the destination)."""
    return f"{PREFIX}.decode.{check_token(instance_id, 'instance id')}.move"


def decode_scale_down(instance_id: str) -> str:
    """scheduler -> the leader of a KV-parallel decode group, request-reply: ScaleDownKVP -> ScaleDownReply."""
    return f"{PREFIX}.decode.{check_token(instance_id, 'instance id')}.scale_down"


def decode_place(instance_id: str) -> str:
    """scheduler -> the leader of a KV-parallel decode group, publish: PlaceKVP (sent before the prefill starts)."""
    return f"{PREFIX}.decode.{check_token(instance_id, 'instance id')}.place"


def kvstore_put(instance_id: str) -> str:
    """prefill (any worker) -> kvstore, request-reply: KVPut -> ReserveReply; the tensor follows on the data plane."""
    return f"{PREFIX}.kvstore.{check_token(instance_id, 'instance id')}.put"


def kvstore_get(instance_id: str) -> str:
    """decode (any worker) -> kvstore, request-reply: KVGet -> KVGetReply; the tensor follows on the data plane."""
    return f"{PREFIX}.kvstore.{check_token(instance_id, 'instance id')}.get"


def kvstore_free(instance_id: str) -> str:
    """any -> kvstore, request-reply: KVFree -> KVFreeReply."""
    return f"{PREFIX}.kvstore.{check_token(instance_id, 'instance id')}.free"


def instance_stats(instance_id: str) -> str:
    """anyone -> one instance, request-reply: StatsQuery -> InstanceStats (exact block counts, live requests)."""
    return f"{PREFIX}.instance.{check_token(instance_id, 'instance id')}.stats"
