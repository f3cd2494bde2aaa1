"""Spindle kvstore: a host-memory KV block store (pure core `KVStore`, NATS + data-plane service)."""

from .store import Entry, KVStore, StoreStats

__all__ = ["Entry", "KVStore", "StoreStats"]
