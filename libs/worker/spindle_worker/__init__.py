"""What prefill and decode instances share: an engine on its own thread, the bus, the data plane,
heartbeats, stats, aborts and the one-terminal-state bookkeeping of requests."""

from .instance import Instance, InstanceConfig, Job, sampling_params

__all__ = ["Instance", "InstanceConfig", "Job", "sampling_params"]
