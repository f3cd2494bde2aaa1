"""CSPS §3.2.2: how many GPUs a prompt's SP prefill takes, and SP-NTP (all-to-all) or SP-TP (all-gather and
reduce-scatter around tensor-parallel attention).

Per layer, SP-NTP on N GPUs of a TP deployment gathers the attention's parameters into each GPU and runs two
all-to-alls: (4 d^2 + 4 L d / N)(N - 1) elements; SP-TP all-gathers and reduce-scatters the hidden states:
2 L d (N - 1) (the paper's supplementary material). So SP-NTP wins when d / L < (1 - 2 / N) / 2: at N > 2 once
L > 2 d N / (N - 2), never at N = 2 (the paper's text says "when N = 2, SP-NTP is always better", against its own
inequality; we follow the inequality); without TP no parameters move and SP-NTP always wins.
"""

from __future__ import annotations

import math

NTP, TP = "sp-ntp", "sp-tp"


def gpus_for(prompt_tokens: int, spt_tokens: int) -> int:
    """GPUs a prompt takes when each holds at most `spt_tokens` of it (the SPT length that fills a GPU's KV)."""
    if prompt_tokens < 1 or spt_tokens < 1:
        raise ValueError(f"prompt and SPT lengths must be >= 1, got {prompt_tokens} and {spt_tokens}")
    return math.ceil(prompt_tokens / spt_tokens)


def ntp_bytes(prompt_tokens: int, hidden: int, gpus: int, tp: int, elem: int = 2) -> float:
    """Per layer, the bytes SP-NTP moves (all GPUs together): its parameters (with TP) and its two all-to-alls."""
    n, d, length = gpus, hidden, prompt_tokens
    params = 4 * d * d if tp > 1 else 0
    return elem * (params + 4 * length * d / n) * (n - 1)


def tp_bytes(prompt_tokens: int, hidden: int, gpus: int, elem: int = 2) -> float:
    """Per layer, the bytes SP-TP moves (all GPUs together): one all-gather and one reduce-scatter."""
    return elem * 2 * prompt_tokens * hidden * (gpus - 1)


def sp_architecture(prompt_tokens: int, hidden: int, gpus: int, tp: int) -> str:
    """`sp-ntp` or `sp-tp`: the one that moves fewer bytes per layer (ties: SP-NTP)."""
    if gpus < 1 or tp < 1:
        raise ValueError(f"gpus and tp must be >= 1, got {gpus} and {tp}")
    if gpus == 1:
        return NTP
    return NTP if ntp_bytes(prompt_tokens, hidden, gpus, tp) <= tp_bytes(prompt_tokens, hidden, gpus) else TP
