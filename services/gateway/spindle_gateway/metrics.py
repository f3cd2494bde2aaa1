"""Prometheus metrics of the gateway (vLLM's names under the `spindle:` prefix), on a registry of its own.

Definitions:
- time to first token: gateway arrival -> the first output token reaches the gateway.
- inter-token latency: the gap between successive deliveries of new tokens (tokens that arrive together in one
  event count once).
- e2e latency: arrival -> terminal state (success or error).
- queue time: arrival -> the scheduler's admission reply (the gateway and scheduler queueing a request sees
  before it is handed to a prefill instance; the prefill instance's own queue shows in the trace).
- running / waiting / kv usage: the scheduler's ClusterStatus, refreshed when /metrics is scraped. KV usage is
  a fraction in [0, 1] (as vLLM's `kv_cache_usage_perc`): used / total blocks over the model instances.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from spindle_protocol.messages import ClusterStatus

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        m = ["model_name"]
        self.ttft = Histogram(
            "spindle:time_to_first_token_seconds",
            "Time to first token in seconds.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.itl = Histogram(
            "spindle:inter_token_latency_seconds",
            "Gap between token deliveries in seconds.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "spindle:e2e_request_latency_seconds",
            "Arrival to terminal state in seconds.",
            m,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.queue = Histogram(
            "spindle:request_queue_time_seconds",
            "Arrival to admission reply in seconds.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(model_name)
        self.running = Gauge(
            "spindle:num_requests_running", "Requests in prefill or decode (cluster).", m, registry=r
        ).labels(model_name)
        self.waiting = Gauge(
            "spindle:num_requests_waiting", "Requests waiting to be scheduled (cluster).", m, registry=r
        ).labels(model_name)
        self.kv_usage = Gauge(
            "spindle:kv_cache_usage_perc", "Fraction of KV blocks in use (prefill + decode).", m, registry=r
        ).labels(model_name)
        self.instance_blocks = Gauge(
            "spindle:instance_kv_blocks_used",
            "KV blocks in use per instance.",
            ["model_name", "instance", "role"],
            registry=r,
        )
        self.scheduler_up = Gauge(
            "spindle:scheduler_up", "1 when the scheduler answered the last status query.", m, registry=r
        ).labels(model_name)
        self.in_flight = Gauge(
            "spindle:gateway_requests_in_flight", "Requests the gateway is serving now.", m, registry=r
        ).labels(model_name)
        self.prompt_tokens = Counter(
            "spindle:prompt_tokens", "Prompt tokens of admitted requests.", m, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter("spindle:generation_tokens", "Output tokens delivered.", m, registry=r).labels(
            model_name
        )
        self._success = Counter(
            "spindle:request_success",
            "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self._errors = Counter(
            "spindle:request_errors",
            "Requests answered with an error, by HTTP status.",
            ["model_name", "status"],
            registry=r,
        )
        self._reshards = Counter(
            "spindle:reshards",
            "Parallel-configuration switches of re-sharding groups (seesaw), by the configuration switched to.",
            ["model_name", "to"],
            registry=r,
        )
        self.reshard_seconds = Counter(
            "spindle:reshard_seconds", "Time the re-sharding groups spent switching.", m, registry=r
        ).labels(model_name)
        self._failures = Counter(
            "spindle:request_failures",
            "Requests that ended in an error, by cause (instance_lost, bus_restart, scheduler_unavailable, deadline, "
            "overloaded, unavailable, rejected, internal).",
            ["model_name", "cause"],
            registry=r,
        )
        self._restarts = Counter(
            "spindle:worker_restarts",
            "Dead processes the launcher restarted, by role.",
            ["model_name", "role"],
            registry=r,
        )
        self._restarts_seen: dict[str, int] = {}
        self._reshards_seen: dict[str, int] = {}  # the scheduler's counts at the last status (counters only grow)
        self._reshard_seconds_seen = 0.0
        self._model = model_name

    def success(self, finish_reason: str) -> None:
        self._success.labels(self._model, finish_reason).inc()

    def error(self, status: int) -> None:
        self._errors.labels(self._model, str(status)).inc()

    def failure(self, status: int, message: str) -> None:
        self._failures.labels(self._model, failure_cause(status, message)).inc()

    def update_cluster(self, status: ClusterStatus | None) -> None:
        self.scheduler_up.set(0 if status is None else 1)
        if status is None:
            return
        self.running.set(status.num_requests_running)
        self.waiting.set(status.num_requests_waiting)
        used = total = 0
        self.instance_blocks.clear()
        for inst in status.instances:
            self.instance_blocks.labels(self._model, inst.instance_id, inst.role).set(inst.kv_blocks_used)
            if inst.role in ("prefill", "decode", "elastic"):
                used += inst.kv_blocks_used
                total += inst.kv_blocks_total
        self.kv_usage.set(used / total if total else 0.0)
        for to, n in status.reshards.items():
            self._reshards.labels(self._model, to).inc(max(0, n - self._reshards_seen.get(to, 0)))
            self._reshards_seen[to] = max(n, self._reshards_seen.get(to, 0))
        for role, n in status.worker_restarts.items():
            self._restarts.labels(self._model, role).inc(max(0, n - self._restarts_seen.get(role, 0)))
            self._restarts_seen[role] = max(n, self._restarts_seen.get(role, 0))
        self.reshard_seconds.inc(max(0.0, status.reshard_seconds - self._reshard_seconds_seen))
        self._reshard_seconds_seen = max(status.reshard_seconds, self._reshard_seconds_seen)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def failure_cause(status: int, message: str) -> str:
    """Why a request failed, from its error (the cluster's messages name the cause; see the tests)."""
    if "was lost" in message or "unreachable" in message or "hand-off failed" in message:
        return "instance_lost"
    if "message bus" in message:
        return "bus_restart"
    if status == 504:
        return "deadline"
    if status == 503 and "scheduler" in message:
        return "scheduler_unavailable"
    if status == 429:
        return "overloaded"
    if status == 503:
        return "unavailable"
    if 400 <= status < 500:
        return "rejected"
    return "internal"
