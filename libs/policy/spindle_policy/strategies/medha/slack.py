"""Medha's prefill queue order (§4.2): input-length-aware least remaining slack (ILRS) and the baselines it is
compared with. Pure functions of one prefilling request, its predicted remaining prefill time and the clock."""

from __future__ import annotations

from dataclasses import dataclass

from spindle_protocol.messages import RequestSpec

POLICIES = ("ilrs", "lrs", "edf", "fcfs")


@dataclass
class Prefilling:
    """A request admitted to a replica whose prompt is not done: `done` prompt tokens computed so far."""

    spec: RequestSpec
    arrived: float
    deadline_s: float  # the TTFT deadline's length from arrival (the deadline rule's)
    done: int = 0
    until: int = 0  # where the replica computing its next chunks stops holding its KV (KVP spans); 0: the prompt's end

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def prompt(self) -> int:
        return self.spec.prompt.num_tokens

    @property
    def left(self) -> int:
        return self.prompt - self.done

    @property
    def room(self) -> int:
        """Prompt tokens its next chunks may take on the replica that computes them now."""
        return (self.until or self.prompt) - self.done

    @property
    def deadline(self) -> float:
        return self.arrived + self.deadline_s


def relative_slack(p: Prefilling, now: float, remaining_s: float) -> float:
    """Eq. 7: (deadline - now - remaining prefill time) / the deadline's length. Below 0: the deadline is lost."""
    return (p.deadline - now - remaining_s) / p.deadline_s


def priority(policy: str, p: Prefilling, now: float, remaining_s: float) -> tuple[float, float]:
    """Sort key, smallest first: ILRS and LRS by relative slack (Eq. 7; LRS is ILRS without prefill-prefill batching,
    the paper's "LRS with normalisation"), EDF by absolute deadline, FCFS by arrival. Ties by arrival."""
    if policy in ("ilrs", "lrs"):
        return relative_slack(p, now, remaining_s), p.arrived
    if policy == "edf":
        return p.deadline, p.arrived
    return p.arrived, 0.0
