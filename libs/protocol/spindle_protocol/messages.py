"""Typed control-plane messages (msgspec, msgpack on the wire). Never pickle.

Every message is a frozen `msgspec.Struct`; `encode`/`decode` in codec.py check the type on the way in.
Times are Unix seconds (float) from `time.time()`; durations are seconds unless the name says `_ms`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

ServiceClass = Literal["interactive", "batch"]
Role = str  # "prefill" | "decode" | "elastic" (prefills and decodes) | "kvstore"
ROLES = ("prefill", "decode", "kvstore")


class Grammar(msgspec.Struct, frozen=True, array_like=True):
    """What a request's output must match: `kind` "json_schema" (source: the schema as JSON text) or "regex"."""

    kind: str
    source: str


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine needs to sample and stop (stop *strings* stay in the gateway). The fields mean what
    `spindle_engine.SamplingParams`' do; `logit_bias` maps token ids to biases."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    logprobs: int | None = None  # None: none; N: the sampled token's and the N most likely alternatives'
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs (N alternatives), from the prefill instance
    n: int = 1  # choices from the one prompt: every decode output and stream event names its choice (`index`)
    grammar: Grammar | None = None  # constrained decoding (spindle_engine.grammar)


class PromptRef(msgspec.Struct, frozen=True, kw_only=True):
    """A prompt stored in the JetStream object store (bucket PROMPT_BUCKET) as little-endian int32."""

    bucket: str
    name: str
    num_tokens: int
    sha256: str


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt token ids, inline when small, else a reference into the object store."""

    num_tokens: int
    token_ids: list[int] | None = None
    ref: PromptRef | None = None


class RequestSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One generation request as every service sees it."""

    request_id: str
    prompt: Prompt
    sampling: Sampling
    arrival_time: float
    deadline: float  # absolute; the gateway ends the request at this time whatever happens
    # "batch": throughput-class work (a Batch API line): a strategy may run it after interactive requests
    service_class: ServiceClass = "interactive"


# ---- gateway <-> scheduler ----


class AdmitRequest(msgspec.Struct, frozen=True, kw_only=True):
    request: RequestSpec


class AdmitReply(msgspec.Struct, frozen=True, kw_only=True):
    accepted: bool
    status: int = 200  # HTTP status the gateway answers with when rejected: 429 overload, 503 no workers, 400
    reason: str = ""
    retry_after_s: float = 0.0
    prefill_instance: str = ""
    decode_instance: str = ""


class StatusQuery(msgspec.Struct, frozen=True, kw_only=True):
    pass


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Heartbeat of one instance: the registry value and what the scheduler plans with."""

    instance_id: str
    role: Role
    rank: int  # rank in the data-plane process group
    pid: int
    started_at: float
    updated_at: float
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    block_size: int = 0
    kv_bytes_total: int = 0  # kvstore: memory budget
    kv_bytes_used: int = 0
    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0  # prefill: prompt tokens accepted but not yet computed
    max_model_len: int = 0
    node: str = ""  # host name: strategies keep SP groups and TP shards on one node where they can
    tp_size: int = 1  # tensor-parallel degree of this instance
    spp_size: int = 1  # sequence-pipeline stages of this instance (one process each; the first registers)
    kvp_size: int = 1  # members of the KV-parallel decode group this instance belongs to (1: none)
    # the KV-parallel group it steps with in lockstep (its leader's id; "" = none): the scheduler splits a request's
    # KV only over instances of one group; every member registers as its own decode instance, with its own blocks
    kvp_group: str = ""
    kv_bytes_per_token: int = 0  # bytes of one token's KV on this instance (all layers; 0 = not reported)
    # a re-sharding instance's current parallel configuration (`PPa x TPb` label, Seesaw; "" = it does not re-shard)
    parallel: str = ""
    # a re-sharding instance's configurations, `PREFILL:DECODE` labels (e.g. `PP2:TP2`); its host KV tier registers
    # as a kvstore `<instance id>-host`
    reshard_plan: str = ""
    device: str = ""  # where its engine runs: "cpu" or "cuda:N" ("" = not reported: an older sender, the simulator)


class ClusterStatus(msgspec.Struct, frozen=True, kw_only=True):
    instances: list[InstanceInfo]
    dead_instances: list[str]
    num_requests_running: int
    num_requests_waiting: int
    strategy: str
    max_model_len: int
    model: str
    reshards: dict[str, int] = {}  # re-shards carried out so far, per configuration switched to (Seesaw)
    reshard_seconds: float = 0.0  # their measured time together
    worker_restarts: dict[str, int] = {}  # processes the launcher restarted so far, per role (StackRestarts)


class AddInstances(msgspec.Struct, frozen=True, kw_only=True):
    """`spindle add` -> the launcher, request-reply: start `count` more instances of `role` (prefill or decode)."""

    role: str
    count: int = 1


class AddedInstances(msgspec.Struct, frozen=True, kw_only=True):
    """The launcher's answer: the instances it started (they serve once registered), or why it started none."""

    instance_ids: list[str] = []
    error: str = ""


class StackRestarts(msgspec.Struct, frozen=True, kw_only=True):
    """The launcher -> everyone: how many dead processes it restarted so far, per role (prefill, decode, kvstore,
    scheduler, gateway, rendezvous, ...). Sent on each restart and every few seconds (a restarted scheduler learns
    the totals). `gave_up`: units left down after a crash loop."""

    restarts: dict[str, int]
    gave_up: list[str] = []


# ---- scheduler -> workers ----


class SPChunkSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt tokens [start, end) computed by `members` (instance ids) as one sequence-parallel group."""

    start: int
    end: int
    members: list[str]
    layout: str = "zigzag"  # contiguous | stripe | zigzag (ring attention) | all-to-all (Ulysses)


class SPChunkDone(msgspec.Struct, frozen=True, kw_only=True):
    """`member` finished chunk `chunk` of `request_id`'s SP plan, or with `error` gave the plan up. Sent to the
    members that join the plan later, so they wait for the group off their engine thread."""

    request_id: str
    chunk: int
    member: str
    error: str = ""


class RunPrefill(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill `request` and hand its KV to `decode_instance` (data-plane rank `decode_rank`).

    With `chunks`, the prompt runs as a sequence-parallel plan: every member receives the same command, runs
    its part of each chunk it belongs to with the group (`ranks` maps member ids to data-plane ranks), and
    hands the KV it ends up holding to the decode instance itself (a `ReserveKV` with `part`)."""

    request: RequestSpec
    decode_instance: str
    decode_rank: int
    kvstore_instance: str = ""  # where the KV parks when the decode instance has no room
    kvstore_rank: int = -1
    chunks: list[SPChunkSpec] = []
    ranks: dict[str, int] = {}
    # CSPS's sparse attention (CSA) over a one-chunk all-to-all plan: drop ratio at level 2 (0: off), levels (0: all),
    # the drop above level 2 ("doubling" or "printed": spindle_attention.csa)
    csa_drop: float = 0.0
    csa_levels: int = 0
    csa_rule: str = "doubling"


class KVShardSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt tokens [start, end) of a request's KV held by decode `instance` (a member of a KVP group)."""

    instance: str
    start: int
    end: int


class IterationPrefill(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt tokens [start, end) of `request` in an iteration; `retain`: the members that keep which of that KV.
    Without `master`, the group computes them in one sequence-parallel pass (whole prompts only); with it, `master`
    computes them alone and keeps their KV, attending the earlier tokens' KV wherever members hold it (Medha's KV
    parallelism: a prompt that outgrows one instance continues on the next)."""

    request: RequestSpec
    start: int
    end: int
    retain: list[KVShardSpec]
    master: str = ""


class IterationDecode(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    master: str  # runs its dense layers and stores its new token's KV


class RunIteration(msgspec.Struct, frozen=True, kw_only=True):
    """One iteration of a group of elastic instances, sent to every member (`ranks`: their data-plane ranks);
    the first member reports IterationDone(`batch_id`) when it ends."""

    batch_id: int
    members: list[str]
    ranks: dict[str, int] = {}
    prefills: list[IterationPrefill] = []
    decodes: list[IterationDecode] = []
    offload: str = ""  # the host KV tier the prompts' KV goes to as it is computed (Seesaw; "" = none)


class ReshardInstance(msgspec.Struct, frozen=True, kw_only=True):
    """scheduler -> a re-sharding elastic instance (Seesaw): switch to the parallel configuration `to` (a label of
    its `reshard_plan`); it answers Resharded."""

    to: str


class IterationAbandoned(msgspec.Struct, frozen=True, kw_only=True):
    """An elastic instance -> the other members of an iteration it gave up (a member died mid-way): stop waiting
    for it; its requests have failed."""

    batch_id: int
    instance_id: str
    reason: str


class MigrateKVIn(msgspec.Struct, frozen=True, kw_only=True):
    """scheduler -> the destination of a KV migration (the scheduler's MigrateKV): take over the decoding request
    `request_id` from the elastic instance `src`. It asks `src` for the KV (MigrateKVOut) and reports KVMigrated
    when it holds the request."""

    request_id: str
    src: str
    src_rank: int


class MigrateKVOut(msgspec.Struct, frozen=True, kw_only=True):
    """destination -> source of a KV migration: send `request_id`'s tokens, spec and KV to `dst_rank` under `tag`
    over the data plane, then forget the request."""

    request_id: str
    dst: str
    dst_rank: int
    tag: int


class PlaceKVP(msgspec.Struct, frozen=True, kw_only=True):
    """scheduler -> the leader of a KV-parallel decode group, before the prefill starts: where the request's KV
    goes. `shards` cover the prompt in order, the first on the master (which samples the request's tokens), the
    last the tail (which takes the new tokens); one shard = the whole KV on one member."""

    request_id: str
    shards: list[KVShardSpec]


class ScaleDownKVP(msgspec.Struct, frozen=True, kw_only=True):
    """scheduler -> the leader of a KV-parallel decode group, request-reply: member `instance` leaves the holders
    of a decoding request; its range of the KV moves to `into`, an adjacent holder ("": the one before it, or
    after it when it holds the first range). The only KV a group ever moves."""

    request_id: str
    instance: str
    into: str = ""


class ScaleDownReply(msgspec.Struct, frozen=True, kw_only=True):
    accepted: bool
    reason: str = ""  # "unknown" (not decoding in the group), "no_room", or why the plan does not allow it
    shards: list[KVShardSpec] = []  # accepted: where the request's KV is now (its tokens so far), master first


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    reason: str = "abort"


# ---- prefill <-> decode / kvstore: the KV hand-off (handshake here, tensors on the data plane) ----


class TensorHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What a receiver expects before it trusts a buffer: dtype name, shape, byte count."""

    dtype: str
    shape: list[int]
    nbytes: int


class ReserveKV(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the decode instance to reserve blocks for `request` and post a receive from `src_rank`."""

    request: RequestSpec
    first_token: int  # sampled by the prefill instance from the last prompt position (-1: another part has it)
    src_rank: int
    kv: TensorHeader  # [2, layers, prompt_tokens, kv_heads, head_dim] (a part: its tokens only)
    part: KVPart | None = None  # set when the KV comes from several SP holders
    prefill_ms: float | None = None  # the prefill's time, for the request's usage stats
    csa_dropped_tokens: int = 0  # CSA: prompt tokens dropped at level 2 (per dropping layer and head), for usage


class KVPart(msgspec.Struct, frozen=True, kw_only=True):
    """One holder's share of an SP-prefilled prompt's KV. The receiver derives the positions it covers from the
    plan (`spindle_engine.sp.SPPlan.final_placement`), so no position list travels."""

    member: str  # the holder's instance id
    num_parts: int  # how many holders send a part
    chunks: list[SPChunkSpec]


class ReserveReply(msgspec.Struct, frozen=True, kw_only=True):
    """With `tp_ranks` (a tensor-parallel decode instance), the holder sends each rank `tp_ranks[t]` only the KV
    heads `tp_heads[t]` ([start, end)) of its KV, under `tp_tags[t]`, instead of the whole KV under `tag`."""

    accepted: bool
    tag: int = 0  # data-plane tag the receiver posted its receive under
    reason: str = ""  # "no_space", "unknown", "bad_header", ...
    tp_ranks: list[int] = []
    tp_tags: list[int] = []
    tp_heads: list[list[int]] = []


class KVParked(msgspec.Struct, frozen=True, kw_only=True):
    """The request's KV waits in the kvstore; the decode instance pulls it when blocks free.

    From a prefill instance: the prompt's KV and its first output (`first_token`). Handed over by another
    decode instance (`MoveParked`) after a preemption there: `token_ids` (prompt and outputs so far; the KV
    covers all but the last) and `next_seq`, the stream number of the next output.

    An SP prompt's KV parks in *tiled* order: the holders, in member order (`KVPart.chunks`' last group), store
    their parts one after another, so holder k's part is tokens [start, start + its tokens) of the request's
    entry, and all parts tile [0, prompt_tokens); the receiver un-permutes by the plan's positions
    (`SPPlan.final_placement`). One holder's share comes with `part` and `start` (`first_token` -1 unless that
    holder sampled it); a whole tiled KV handed over by another decode instance comes with `tiled`, the plan."""

    request: RequestSpec
    first_token: int
    kvstore_instance: str
    kvstore_rank: int
    kv: TensorHeader
    token_ids: list[int] | None = None
    next_seq: int = 1
    part: KVPart | None = None
    prefill_ms: float | None = None  # the prefill's time, for the request's usage stats
    csa_dropped_tokens: int = 0  # CSA: prompt tokens dropped at level 2 (per dropping layer and head), for usage
    start: int = 0  # where `part` starts in the tiled order
    tiled: list[SPChunkSpec] = []


class MoveParked(msgspec.Struct, frozen=True, kw_only=True):
    """A request parked on this decode instance goes to wait on `dst_instance` instead (its KV stays in the
    kvstore until `dst_instance` pulls it)."""

    request_id: str
    dst_instance: str


class MoveReply(msgspec.Struct, frozen=True, kw_only=True):
    accepted: bool
    reason: str = ""  # "not_parked" (unknown, pulling already, or gone)


class KVPut(msgspec.Struct, frozen=True, kw_only=True):
    """Store tokens [start, end) of a request's KV; `pinned` entries are never evicted."""

    request_id: str
    start: int
    end: int
    src_rank: int
    kv: TensorHeader
    pinned: bool = True


class KVGet(msgspec.Struct, frozen=True, kw_only=True):
    """Send tokens [start, end) of a stored entry to `dst_rank` under `tag` (the receiver posted it)."""

    request_id: str
    start: int
    end: int
    dst_rank: int
    tag: int
    free_after: bool = False


class KVGetReply(msgspec.Struct, frozen=True, kw_only=True):
    found: bool
    kv: TensorHeader | None = None
    reason: str = ""


class KVFree(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str


class KVFreeReply(msgspec.Struct, frozen=True, kw_only=True):
    freed_bytes: int


class PreemptDecode(msgspec.Struct, frozen=True, kw_only=True):
    """Take a decoding request out of the batch, store its KV (prompt and outputs so far) in the kvstore and
    free its blocks; it resumes on this instance, FIFO with other parked requests, when blocks free."""

    request_id: str
    kvstore_instance: str
    kvstore_rank: int


class PreemptReply(msgspec.Struct, frozen=True, kw_only=True):
    accepted: bool
    num_tokens: int = 0  # KV tokens parked
    reason: str = ""  # "unknown" (not decoding here), "kvstore_full", ...


# ---- worker -> gateway: the token stream ----


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One output position's log-probabilities: the sampled token's and the top alternatives', best first."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class StreamEvent(msgspec.Struct, frozen=True, kw_only=True):
    """Token ids `token_ids` are outputs `seq, seq+1, ...` of the request's choice `index` (0 unless n > 1).
    The last event of each choice has `finished`.

    An error event (`error` set) is terminal; `status` is the HTTP-style code (503 worker lost, 504
    deadline, 500 internal).
    """

    request_id: str
    seq: int
    token_ids: list[int] = []
    index: int = 0  # the choice (n > 1); `seq`, `finished` and `finish_reason` are that choice's
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    status: int = 200
    stats: dict[str, float] | None = None  # spindle-specific usage fields on the last event
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt positions 1.., on the first output's event


# ---- workers -> scheduler: events ----


class PrefillProgress(msgspec.Struct, frozen=True, kw_only=True, tag="prefill_progress"):
    request_id: str
    instance_id: str
    tokens_done: int
    tokens_total: int
    chunk_seconds: float
    ring_bytes: int = 0  # SP chunks: bytes this instance sent for ring / all-to-all attention (all layers)
    rebalance_bytes: int = 0  # SP chunks: history bytes this instance sent to new group members first


class PrefillDone(msgspec.Struct, frozen=True, kw_only=True, tag="prefill_done"):
    request_id: str
    instance_id: str
    seconds: float
    finished: bool  # the first token already ended the request (stop / length)


class TransferDone(msgspec.Struct, frozen=True, kw_only=True, tag="transfer_done"):
    request_id: str
    src_instance: str
    dst_instance: str
    nbytes: int
    seconds: float
    parked: bool = False  # went to the kvstore instead of the decode instance


class DecodeStarted(msgspec.Struct, frozen=True, kw_only=True, tag="decode_started"):
    request_id: str
    instance_id: str


class RequestFinished(msgspec.Struct, frozen=True, kw_only=True, tag="request_finished"):
    request_id: str
    instance_id: str
    finish_reason: str
    num_output_tokens: int


class RequestFailed(msgspec.Struct, frozen=True, kw_only=True, tag="request_failed"):
    request_id: str
    instance_id: str
    message: str
    status: int = 500


class Preempted(msgspec.Struct, frozen=True, kw_only=True, tag="preempted"):
    """A decoding request left the batch; its KV (`num_tokens` tokens) waits in the kvstore until it resumes on
    the same instance (a new DecodeStarted)."""

    request_id: str
    instance_id: str
    num_tokens: int
    seconds: float  # from the command to the KV stored and the blocks freed


class KVPShards(msgspec.Struct, frozen=True, kw_only=True, tag="kvp_shards"):
    """The leader of a KV-parallel decode group, after a step: where a decoding request's KV is now, sent when it
    was placed (the group may not use the scheduler's `PlaceKVP`) and after each scale-up or scale-down. `shards`
    tile its tokens so far in order, the last the tail; `master` (a member too) samples its tokens and may hold
    none of them."""

    request_id: str
    instance_id: str  # the leader
    master: str
    shards: list[KVShardSpec]


class IterationDone(msgspec.Struct, frozen=True, kw_only=True, tag="iteration_done"):
    """A group of elastic instances finished the iteration the scheduler sent (`RunBatch` `batch_id`): its members
    are free for the next one. The event is the group's, not a request's (`request_id` empty)."""

    instance_id: str  # the group's first member
    batch_id: int
    seconds: float  # measured: the iteration's time on the group
    request_id: str = ""


class KVMigrated(msgspec.Struct, frozen=True, kw_only=True, tag="kv_migrated"):
    """A decoding request's KV held on `src` moved to `dst` (the scheduler's `MigrateKV`)."""

    request_id: str
    instance_id: str  # src
    dst: str
    num_tokens: int
    seconds: float


class Resharded(msgspec.Struct, frozen=True, kw_only=True, tag="resharded"):
    """A colocated instance switched its parallel configuration (the scheduler's `Reshard`, Seesaw): its weights
    are loaded as `config` (a `PPa x TPb` label such as `TP4`) and the KV it keeps re-sharded to it. The event is the
    instance's, not a request's (`request_id` empty)."""

    instance_id: str
    config: str
    seconds: float  # measured: the switch, weights and KV together
    weight_bytes: int  # weights loaded from host memory over every GPU of the instance
    kv_bytes: int  # KV of the requests it keeps, moved out and back in the new layout
    request_id: str = ""


WorkerEvent = (
    PrefillProgress
    | PrefillDone
    | TransferDone
    | DecodeStarted
    | Preempted
    | KVPShards
    | IterationDone
    | KVMigrated
    | Resharded
    | RequestFinished
    | RequestFailed
)


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """The scheduler -> watchers (the gateway's /dashboard), on `subjects.DECISIONS`: one action the strategy took.

    `kind`: "plan" (a request's prefill chunks and decode instance), "iteration" (a per-iteration strategy's batch
    on a group), "reject", "fail", "preempt", "move" (parked KV to another decode instance), "migrate" (KV between
    elastic instances), "scale_down" (a KV-parallel member leaves a request), "reshard"."""

    t: float  # Unix time of the decision
    strategy: str
    kind: str
    request_id: str = ""
    text: str = ""  # for people: "SP 4 on prefill-0..3, chunks 0-8192@1, 8192-20000@4, decode decode-1"
    instances: list[str] = []  # a plan's prefill instances, an iteration's group, an action's instance(s)
    chunks: list[SPChunkSpec] = []  # a plan's chunks and their SP groups
    decode_instance: str = ""
    batch_id: int = -1  # an iteration's (IterationDone names it when the iteration ends)
    prefill_requests: list[str] = []  # an iteration's prefill parts, in order
    new_requests: list[str] = []  # ... those whose prompt starts in it (the request's admission, in effect)
    decode_masters: dict[str, int] = {}  # an iteration's decodes per master instance

    @property
    def listed(self) -> bool:
        """Whether it belongs in the list people read: all but iterations that start no prompt (a per-iteration
        strategy sends one every few milliseconds)."""
        return self.kind != "iteration" or bool(self.new_requests)


class StatsQuery(msgspec.Struct, frozen=True, kw_only=True):
    pass


class InstanceStats(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Exact per-instance state, for tests and operators (blocks held per request; `counters` only when set)."""

    instance_id: str
    role: Role
    kv_blocks_total: int
    kv_blocks_used: int
    requests: dict[str, int]  # request id -> blocks (or bytes, on the kvstore) held
    counters: dict[str, int] = msgspec.field(default_factory=dict)  # e.g. kvp_scale_ups of a KVP decode group
