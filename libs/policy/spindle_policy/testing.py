"""Builders for tests of the pure core: an instance's heartbeat and a request, with small defaults."""

from __future__ import annotations

from spindle_protocol.messages import InstanceInfo, Prompt, RequestSpec, Sampling


def instance_info(
    instance_id: str,
    role: str,
    rank: int,
    *,
    total: int = 100,
    used: int = 0,
    running: int = 0,
    at: float = 0.0,
    tp_size: int = 1,
    max_model_len: int = 1600,
    kvp_group: str = "",
    kv_bytes_per_token: int = 0,
) -> InstanceInfo:
    """A heartbeat: `total` KV blocks of 16 tokens, `used` of them in use, sent at `at` (a member of KV-parallel
    group `kvp_group` when set)."""
    return InstanceInfo(
        instance_id=instance_id, role=role, rank=rank, pid=0, started_at=0.0, updated_at=at,
        kv_blocks_total=total, kv_blocks_used=used, block_size=16, max_model_len=max_model_len,
        num_running=running, tp_size=tp_size, kvp_group=kvp_group, kv_bytes_per_token=kv_bytes_per_token,
    )  # fmt: skip


def request_spec(request_id: str, prompt: int = 300, out: int = 20) -> RequestSpec:
    """A request of `prompt` tokens and `out` output tokens (EOS ignored); 300 + 20 is 20 blocks of 16."""
    return RequestSpec(
        request_id=request_id, prompt=Prompt(num_tokens=prompt),
        sampling=Sampling(max_tokens=out, ignore_eos=True), arrival_time=0.0, deadline=1e9,
    )  # fmt: skip
