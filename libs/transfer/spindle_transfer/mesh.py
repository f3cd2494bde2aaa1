"""Mesh: a data plane whose members come and go, a gloo group per pair of processes (and NCCL ones between GPUs).

A fixed `torch.distributed` world cannot lose a rank: one dead process breaks it for good. Here each process
keeps a rank (the launcher's slot for it) and, per start, a fresh random token. Joining appends `rank:token`
to the rendezvous store's join log; a watcher thread in every member reads the log and forms a 2-process gloo
group with every other member, under a store prefix named for both ranks and tokens, each on a thread of its
own (a formation waits for the peer's side, and a peer that never comes must not hold up the others). So:

- a restarted process (same rank, new token) forms new groups with everyone; its old groups are dropped;
- a process added at run time (a new rank) is met by every member within one poll of the log;
- a dead peer fails only the ops on its own pair (gloo ends them at once); nobody else's group is touched.

Groups are formed as soon as both sides are in the log, so a warmed-up stack never forms one on a request's
path. `route(peer)` waits (up to the timeout) for a group still forming or a peer not yet joined: what a
process sending to a peer that is still starting needs. The rendezvous restarting is survived: a member that
loses the store reconnects and appends its entry again (same token: nobody re-forms).

A join also says where the member runs (`rank:token:HOST/DEVICE`, paths.Placement), so each pair knows the
transport its tensors take (paths.choose_path): gloo between CPUs; host-staged (the gloo group carrying host copies)
with a GPU on one side or both on one GPU; nccl between two different GPUs when both members can and the NCCL groups
formed (pairs.py: how both sides agree, and fall back to host-staged, logged, when they cannot). `paths()` reports
it, the log line of each formed group names it, and the instances count it (`dataplane_<transport>_peers`).
An NCCL pair keeps its gloo group for host tensors; a dead peer fails its NCCL ops only after the group's timeout
(NCCL does not notice a closed socket as gloo does), or at once when the mesh sees it restart or leave.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from spindle_attention.distributed.p2p import PeerUnreachable

from .pairs import GroupFactory, Pair, carried, default_factories, form_pair
from .paths import GLOO, NCCL, Placement, describe
from .store import JOINS

log = logging.getLogger("spindle.transfer.mesh")
POLL_S = 0.05  # how often the watcher reads the join log
LEFT = "-"  # a join-log token meaning "left for good"


@dataclass
class Peer:
    """What this process knows of one other member."""

    token: str
    pair: Pair | None = None
    error: str | None = None  # its group could not be formed (it died before meeting us)
    place: Placement | None = None  # where it runs (None: its join did not say; an older member)

    @property
    def state(self) -> str:
        if self.token == LEFT:
            return "left"
        if self.pair is not None:
            return "ready"
        return "failed" if self.error is not None else "forming"


@dataclass
class MeshStats:
    formed: int = 0  # groups formed by this process
    replaced: int = 0  # groups dropped for a peer's new start
    nccl_fallbacks: int = 0  # pairs that wanted NCCL and are host-staged instead


def parse_joins(log_text: str) -> dict[int, str]:
    """The join log -> each rank's latest token (LEFT for a rank that left)."""
    return {rank: token for rank, (token, _) in parse_entries(log_text).items()}


def parse_entries(log_text: str) -> dict[int, tuple[str, Placement | None]]:
    """The join log -> each rank's latest (token, placement); an entry without a valid placement has None."""
    latest: dict[int, tuple[str, Placement | None]] = {}
    for entry in log_text.split(";"):
        if entry:
            rank, _, rest = entry.partition(":")
            token, _, where = rest.partition(":")
            try:
                place = Placement.decode(where) if where else None
            except ValueError:
                place = None
            latest[int(rank)] = (token, place)
    return latest


class Mesh:
    """This process's membership of the mesh at the rendezvous `host:port`; a `p2p.Router`."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        timeout_s: float = 60.0,
        poll_s: float = POLL_S,
        place: Placement | None = None,
        factories: Mapping[str, GroupFactory] | None = None,
    ) -> None:
        """`factories`: the group constructor per transport (pairs.py; default: gloo, and NCCL where this process
        can), injectable so that a machine without GPUs can test the NCCL pairs' logic."""
        if rank < 0:
            raise ValueError(f"rank {rank} must be >= 0")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.host, self.port, self._rank = host, port, rank
        self.token = secrets.token_hex(6)
        self.place = place or Placement.here()
        self._factories = dict(default_factories(self.place) if factories is None else factories)
        if GLOO not in self._factories or not set(self._factories) <= {GLOO, NCCL}:
            raise ValueError(f"factories must be for gloo (and nccl), got {sorted(self._factories)}")
        self.timeout = timedelta(seconds=timeout_s)
        self.stats = MeshStats()
        self._poll_s = poll_s
        self._peers: dict[int, Peer] = {}
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._store = self._connect()
        self._announce()
        self._seen = ""
        self._scan()  # every member already in the log starts forming before join() returns
        self._watcher = threading.Thread(target=self._watch, name="spindle-mesh-watch", daemon=True)
        self._watcher.start()

    # ---- p2p.Router ----

    @property
    def rank(self) -> int:
        return self._rank

    def route(self, peer: int) -> tuple[dist.ProcessGroup, int]:
        """The group that reaches `peer` (its gloo group; for an NCCL pair the Pair, which sends CUDA tensors by
        NCCL) and `peer`'s rank in it."""
        return self.pair(peer).group, int(peer > self._rank)

    def pair(self, peer: int) -> Pair:
        """The pair with `peer`, waiting (up to the timeout) for one still forming; PeerUnreachable otherwise."""
        if peer == self._rank:
            raise ValueError(f"rank {peer} is this process")
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._cond:
            while True:
                p = self._peers.get(peer)
                if p is not None and p.pair is not None:
                    return p.pair
                if p is not None and p.token == LEFT:
                    raise PeerUnreachable(f"rank {peer} left the data plane")
                if p is not None and p.error is not None:
                    raise PeerUnreachable(f"rank {peer} is unreachable: {p.error}")
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    what = "has not joined the data plane" if p is None else "did not finish forming a group"
                    raise PeerUnreachable(f"rank {peer} {what} within {self.timeout.total_seconds():g} s")
                self._cond.wait(min(left, 1.0))

    # ---- what services and tests read ----

    def peers(self) -> dict[int, str]:
        """rank -> state ("forming", "ready", "failed", "left") of every other member seen."""
        with self._cond:
            return {r: p.state for r, p in sorted(self._peers.items())}

    def paths(self) -> dict[int, str]:
        """rank -> the transport of its pair (paths.choose_path), for every peer whose group is ready."""
        with self._cond:
            return {r: p.pair.transport for r, p in sorted(self._peers.items()) if p.pair is not None}

    def placement(self, rank: int) -> Placement | None:
        """Where member `rank` runs, as its join said (this process's own for `rank`; None: not seen, or it did not
        say)."""
        if rank == self._rank:
            return self.place
        with self._cond:
            peer = self._peers.get(rank)
            return peer.place if peer is not None else None

    def wait_formed(self, timeout_s: float) -> dict[int, str]:
        """Wait until no group is still forming (or `timeout_s`); returns the peers not ready then."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while any(p.state == "forming" for p in self._peers.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return {r: p.state for r, p in self._peers.items() if p.state != "ready"}

    def close(self) -> None:
        """Leave: the others drop their groups with us; ours are dropped too."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._store.append(JOINS, f"{self._rank}:{LEFT};")
        except Exception as e:  # the rendezvous is gone: the others find out from their ops
            log.debug("leaving: %s", e)
        with self._cond:
            dropped = [p.pair for p in self._peers.values() if p.pair is not None and p.pair.nccl]
            self._peers.clear()
            self._cond.notify_all()
        for pair in dropped:
            pair.abort()

    # ---- internals ----

    def _connect(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)

    def _announce(self) -> None:
        self._store.append(JOINS, f"{self._rank}:{self.token}:{self.place.encode()};")

    def _watch(self) -> None:
        lost_since = None
        while not self._closed.wait(self._poll_s):
            try:
                self._scan()
                lost_since = None
            except Exception as e:  # the rendezvous restarted or is unreachable: reconnect, say who we are again
                if lost_since is None:
                    lost_since = time.monotonic()
                    why = str(e).splitlines()[0] if str(e) else type(e).__name__
                    log.warning("rank %d lost the rendezvous at %s:%d (%s); reconnecting", self._rank, self.host,
                                self.port, why)  # fmt: skip
                try:
                    self._store = self._connect()
                    self._announce()
                    self._seen = ""
                    log.info("rank %d rejoined the rendezvous after %.1f s", self._rank, time.monotonic() - lost_since)
                except Exception:
                    self._closed.wait(1.0)

    def _scan(self) -> None:
        text = self._store.get(JOINS).decode()
        if text == self._seen:
            return
        self._seen = text
        latest = parse_entries(text)
        with self._cond:
            for rank, (token, place) in latest.items():
                if rank == self._rank:
                    continue
                known = self._peers.get(rank)
                if known is not None and known.token == token:
                    continue
                if known is not None and known.pair is not None:
                    self.stats.replaced += 1
                    log.info("rank %d: peer %d %s; dropping its group", self._rank, rank,
                             "left" if token == LEFT else "restarted")  # fmt: skip
                    if known.pair.nccl:  # its pending NCCL ops end now, not at their timeout
                        threading.Thread(target=known.pair.abort, name="spindle-mesh-abort", daemon=True).start()
                self._peers[rank] = Peer(token, place=place)
                if token != LEFT:
                    threading.Thread(
                        target=self._form, args=(rank, token), name=f"spindle-mesh-form-{rank}", daemon=True
                    ).start()
            self._cond.notify_all()

    def _form(self, peer: int, token: str) -> None:
        lo, hi = sorted([(self._rank, self.token), (peer, token)])
        prefix = f"mesh/pair/{lo[0]}.{lo[1]}/{hi[0]}.{hi[1]}"
        with self._cond:
            known = self._peers.get(peer)
            # a peer that did not say where it runs is taken for a CPU rank on this host (what every member was)
            there = (known.place if known is not None else None) or Placement(self.place.host)
        t0 = time.perf_counter()
        pair, error, fallback = None, None, None
        try:
            store = self._connect()  # its own connection: a formation that waits must not hold the shared one
            pair, fallback = form_pair(store, prefix, int(self._rank > peer), self.place, there, self._factories,
                                       self.timeout)  # fmt: skip
        except Exception as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
        seconds = time.perf_counter() - t0
        with self._cond:
            current = self._peers.get(peer)
            if current is None or current.token != token or self._closed.is_set():
                current = None  # superseded by a newer start of the peer (or we left): drop it
            elif pair is not None:
                current.pair = pair
                self.stats.formed += 1
                if fallback is not None:
                    self.stats.nccl_fallbacks += 1
                    log.warning("rank %d: no NCCL pair with rank %d (%s); host-staged", self._rank, peer, fallback)
                how = describe(self.place, there, carried(pair.nccl))
                log.info("rank %d: group with rank %d formed in %.1f ms; path %s", self._rank, peer, seconds * 1e3,
                         how)  # fmt: skip
            else:
                current.error = error
                log.warning("rank %d: no group with rank %d (%s)", self._rank, peer, error)
            self._cond.notify_all()
        if current is None and pair is not None and pair.nccl:
            pair.abort()
