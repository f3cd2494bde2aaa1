"""`spindle sim --timeline out.html`: a run's timeline (spindle_telemetry.timeline), drawn by the same page as the
gateway's live /dashboard.

`RecordingSimulator` is the Simulator with observers on its steps: it records what each instance ran (prefill
chunks per SP member, decode steps merged while an instance's batch size stays the same, the iterations of
per-iteration strategies, KV moves from the events the core hears), KV use and queues at every heartbeat (what
the core sees), and the strategy's decisions (decisions.py, as the scheduler service publishes them). It only
reads the simulator's state after (or, for a step's end, before) the simulator's own code, so a run's results are
the same with and without it; a plain `Simulator` records nothing and costs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from spindle_policy.actions import Action, RunBatch
from spindle_policy.decisions import decision
from spindle_policy.latency import LatencyModel
from spindle_policy.strategy import Strategy
from spindle_protocol.messages import KVMigrated, Preempted, Resharded, TransferDone, WorkerEvent
from spindle_telemetry.timeline import DecisionRow, InstanceRow, Span, Timeline, TimelineBuilder, render_html

from .cluster import ChunkJob, SimColocated, SimConfig, SimDecode
from .executor import SimResult, Simulator
from .metrics import RequestRecord
from .workloads import TraceRequest


class RecordingSimulator(Simulator):
    def __init__(self, strategy: Strategy | str, latency: LatencyModel, config: SimConfig | None = None) -> None:
        super().__init__(strategy, latency, config)
        self.timeline = TimelineBuilder()
        self._strategy = self.core.strategy.describe()
        # instance -> the step it runs now: its start, decodes and prompt pieces (colocated)
        self._steps: dict[str, tuple[float, list[str], list[tuple[RequestRecord, int, int]]]] = {}
        for inst in self.instances.values():
            row = InstanceRow(id=inst.id, role=inst.role, rank=inst.rank, node=inst.node,
                              kv_blocks_total=inst.total_blocks)  # fmt: skip
            self.timeline.instance(row)

    def recorded(self, title: str = "") -> Timeline:
        end = max([self.queue.now, *(s.end for s in self.timeline.spans)])
        return self.timeline.snapshot(0.0, end, title=title, strategy=self._strategy)

    # ---- observers ----

    def _execute(self, actions: list[Action], now: float) -> None:
        for a in actions:
            d = decision(a, self._strategy, now)
            if d is not None and d.listed:
                self.timeline.decision(DecisionRow(t=now, request_id=d.request_id, strategy=d.strategy, text=d.text))
        super()._execute(actions, now)

    def _emit(self, event: WorkerEvent, now: float) -> None:
        moved = None
        match event:
            case TransferDone(dst_instance=dst, seconds=s, parked=parked):
                moved = Span(instance=dst, start=now - s, end=now, kind="park" if parked else "transfer",
                             label=f"KV from {event.src_instance}")  # fmt: skip
            case Preempted(instance_id=iid, seconds=s):
                moved = Span(instance=iid, start=now - s, end=now, kind="park", label="swapped out")
            case KVMigrated(dst=dst, seconds=s):
                moved = Span(instance=dst, start=now - s, end=now, kind="transfer", label=f"from {event.instance_id}")
            case Resharded(instance_id=iid, seconds=s):
                moved = Span(instance=iid, start=now - s, end=now, kind="reshard", label=f"to {event.config}")
        if moved is not None and moved.instance in self.instances:
            moved.requests = [event.request_id] if event.request_id else []
            self.timeline.span(moved)
        super()._emit(event, now)

    def _start_chunk(self, job: ChunkJob, now: float) -> None:
        super()._start_chunk(job, now)
        chunk, rid = job.chunk, job.rec.request_id
        group = list(chunk.instances) if chunk.sp > 1 else []
        for iid in chunk.instances:
            end = self.instances[iid].busy_spans[-1][1]
            self.timeline.chunk(Span(instance=iid, start=now, end=end, kind="prefill", requests=[rid], group=group,
                                    sp=chunk.sp, token_start=chunk.start, token_end=chunk.end))  # fmt: skip

    def _start_step(self, d: SimDecode, now: float) -> None:
        stepping = d.stepping
        super()._start_step(d, now)
        if d.stepping and not stepping:
            colocated = isinstance(d, SimColocated)
            batch = d.step_batch if colocated else d.running
            chunks = list(d.step_chunks) if colocated else []  # type: ignore[attr-defined]
            self._steps[d.id] = (now, [r.request_id for r in batch], chunks)

    def _on_step(self, now: float, d: SimDecode) -> None:
        if (started := self._steps.pop(d.id, None)) is not None:
            t0, rids, chunks = started
            if rids:
                self.timeline.decode_step(d.id, t0, now, rids)
            for rec, start, n in chunks:  # prompt pieces in the step (colocated): the step's time is theirs too
                self.timeline.chunk(Span(instance=d.id, start=t0, end=now, kind="prefill", requests=[rec.request_id],
                                         token_start=start, token_end=start + n))  # fmt: skip
        super()._on_step(now, d)

    def _run_batch(self, a: RunBatch, now: float) -> None:
        super()._run_batch(a, now)
        end = self.instances[a.instances[0]].busy_spans[-1][1]
        live = [p for p in a.prefills if self.records[p.request_id].state == "pending"]
        label = f"iteration {a.batch_id}"
        if a.kvp:  # each member computes the parts it masters
            for p in live:
                self.timeline.chunk(Span(instance=p.master, start=now, end=end, kind="prefill", requests=[p.request_id],
                                        token_start=p.start, token_end=p.end, label=label))  # fmt: skip
        elif live:  # one sequence-parallel pass of every part over the group
            one = live[0] if len(live) == 1 else None
            group = list(a.instances) if len(a.instances) > 1 else []
            for iid in a.instances:
                self.timeline.chunk(Span(instance=iid, start=now, end=end, kind="prefill",
                                        requests=[p.request_id for p in live], group=group, sp=len(a.instances),
                                        token_start=one.start if one else 0, token_end=one.end if one else 0,
                                        label=label))  # fmt: skip
        masters: dict[str, list[str]] = {}
        for part in a.decodes:
            if self.records[part.request_id].state == "pending":
                masters.setdefault(part.master, []).append(part.request_id)
        for master, rids in masters.items():
            self.timeline.decode_step(master, now, end, rids, label=label)

    def _on_heartbeat(self, now: float, payload: object) -> None:
        super()._on_heartbeat(now, payload)
        for inst in self.instances.values():
            self.timeline.kv(inst.id, now, inst.used_blocks, inst.total_blocks)
            load = inst._load()
            self.timeline.queue(inst.id, now, load.get("num_waiting", 0), load.get("queued_tokens", 0))


def strategy_path(path: Path, spec: str) -> Path:
    """`out.html` -> `out.<spec>.html`: one page per strategy (`spindle sim compare --timeline`)."""
    return path.with_name(f"{path.stem}.{re.sub(r'[^A-Za-z0-9_.=-]+', '_', spec)}{path.suffix or '.html'}")


def run_recorded(
    trace: Sequence[TraceRequest],
    strategy: Strategy | str,
    latency: LatencyModel,
    config: SimConfig | None,
    path: Path,
    title: str = "",
) -> SimResult:
    """A run, as `simulate`, with its timeline written to `path` as one HTML page."""
    sim = RecordingSimulator(strategy, latency, config)
    result = sim.run(trace)
    path.write_text(render_html(sim.recorded(title)), encoding="utf-8")
    return result
