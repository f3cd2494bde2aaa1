"""What `spindle profile` measures: the grid, repeats and parts (`ProfileConfig`), and the smoke-test grid."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileConfig:
    model: str = "smollm2"
    dtype: str = "float32"
    histories: tuple[int, ...] = (0, 512, 1024)  # C: tokens prefilled before the timed chunks
    chunks: tuple[int, ...] = (64, 256, 512)  # L: chunk lengths, timed one after another
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_kv_tokens: tuple[int, ...] = (256, 1024, 2048)  # KV tokens per request
    transfer_bytes: tuple[int, ...] = (2**16, 2**20, 2**22, 2**24, 2**26)
    repeats: int = 3  # prefill repeats; decode steps and transfers take 4*repeats+1 (they are cheap)
    warmup: int = 1
    transfer: bool = True
    seed: int = 0
    sp_sizes: tuple[int, ...] = (1,)  # prefill SP sizes; > 1 runs on spawned local SP groups

    def __post_init__(self) -> None:
        if not self.chunks or min(self.chunks) < 1:
            raise ValueError(f"chunks must be non-empty lengths >= 1, got {self.chunks}")
        if not self.histories or min(self.histories) < 0:
            raise ValueError(f"histories must be non-empty and >= 0, got {self.histories}")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ValueError(f"decode batch sizes must be >= 1, got {self.decode_batches}")
        if not self.decode_kv_tokens or min(self.decode_kv_tokens) < 1:
            raise ValueError(f"decode KV tokens must be >= 1, got {self.decode_kv_tokens}")
        if self.transfer and (not self.transfer_bytes or min(self.transfer_bytes) < 1):
            raise ValueError(f"transfer sizes must be >= 1 byte, got {self.transfer_bytes}")
        if 1 not in self.sp_sizes or min(self.sp_sizes) < 1 or len(set(self.sp_sizes)) != len(self.sp_sizes):
            raise ValueError(f"sp_sizes must be distinct sizes >= 1 including 1, got {self.sp_sizes}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")

    @property
    def decode_steps(self) -> int:
        return 4 * self.repeats + 1

    @property
    def prefill_len(self) -> int:
        return max(self.histories) + sum(self.chunks) + 2  # +2: the sampled token must not end it by length

    @property
    def decode_len(self) -> int:
        return max(self.decode_kv_tokens) + self.warmup + self.decode_steps + 2


QUICK = ProfileConfig(
    histories=(0, 32),
    chunks=(8, 16),
    decode_batches=(1, 2),
    decode_kv_tokens=(16, 64),
    transfer_bytes=(2**12, 2**22, 2**24),
    repeats=1,
    warmup=1,
)
