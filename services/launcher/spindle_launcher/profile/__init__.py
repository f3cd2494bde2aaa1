"""`spindle profile`: measure the real engine on this machine and fit the scheduler's `LatencyModel` to it.

Three measurements, each repeated with the median kept:
- prefill chunks (SP size 1, `runner.py`): per history C, one prefill-only request whose steps compute C
  tokens, then each chunk L of the grid in turn; every step is one sample (history before it, tokens it
  computed), so the history prefill is itself a C = 0 sample and no compute is wasted. SP sizes > 1
  (`sp_sizes`) run the same grid on spawned SP groups (`sp.py`).
- decode steps over (batch size, KV tokens per request, `runner.py`): requests enter with random KV through
  the decode-side hand-off API (`reserve` + `add_prefilled`), so no prefill is needed to set them up.
- KV transfers between two spawned ranks of a real gloo group through `spindle_transfer.DataPlane`
  (`transfer.py`).

The fit and the profile JSON are the scheduler's (`spindle_policy.profile_data`): it reads a profile
without the engine. This package is the launcher's because it runs the engine; the scheduler never does.
The profile's `device` section (`device.py`) is this machine as a cost-model device: its matmul and copy
peaks measured with torch, its efficiencies fitted to the same samples by `spindle_costmodel.device_fit`,
with a held-out validation table.
"""

from .config import QUICK, ProfileConfig
from .runner import run_profile

__all__ = ["QUICK", "ProfileConfig", "run_profile"]
