"""Mesh: a data plane whose members come and go, one gloo group per pair of processes.

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
transport its tensors take (paths.choose_path: gloo between CPUs, host-staged with a GPU on either side, as the
gloo pairs carry them); `paths()` reports it and the log line of each formed group names it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from spindle_attention.distributed.p2p import PeerUnreachable

from .paths import Placement, choose_path, describe
from .store import JOINS

log = logging.getLogger("spindle.transfer.mesh")
POLL_S = 0.05  # how often the watcher reads the join log
LEFT = "-"  # a join-log token meaning "left for good"


@dataclass
class Peer:
    """What this process knows of one other member."""

    token: str
    group: dist.ProcessGroup | None = None
    error: str | None = None  # its group could not be formed (it died before meeting us)
    place: Placement | None = None  # where it runs (None: its join did not say; an older member)

    @property
    def state(self) -> str:
        if self.token == LEFT:
            return "left"
        if self.group is not None:
            return "ready"
        return "failed" if self.error is not None else "forming"


@dataclass
class MeshStats:
    formed: int = 0  # groups formed by this process
    replaced: int = 0  # groups dropped for a peer's new start


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
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank {rank} must be >= 0")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.host, self.port, self._rank = host, port, rank
        self.token = secrets.token_hex(6)
        self.place = place or Placement.here()
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
        if peer == self._rank:
            raise ValueError(f"rank {peer} is this process")
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._cond:
            while True:
                p = self._peers.get(peer)
                if p is not None and p.group is not None:
                    return p.group, int(peer > self._rank)
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
            return {r: self._path(p) for r, p in sorted(self._peers.items()) if p.group is not None}

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
            self._peers.clear()
            self._cond.notify_all()

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
                if known is not None and known.group is not None:
                    self.stats.replaced += 1
                    log.info("rank %d: peer %d %s; dropping its group", self._rank, rank,
                             "left" if token == LEFT else "restarted")  # fmt: skip
                self._peers[rank] = Peer(token, place=place)
                if token != LEFT:
                    threading.Thread(
                        target=self._form, args=(rank, token), name=f"spindle-mesh-form-{rank}", daemon=True
                    ).start()
            self._cond.notify_all()

    def _form(self, peer: int, token: str) -> None:
        lo, hi = sorted([(self._rank, self.token), (peer, token)])
        prefix = f"mesh/pair/{lo[0]}.{lo[1]}/{hi[0]}.{hi[1]}"
        t0 = time.perf_counter()
        group, error = None, None
        try:
            store = self._connect()  # its own connection: a formation that waits must not hold the shared one
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), int(self._rank > peer), 2, self.timeout)
        except Exception as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
        seconds = time.perf_counter() - t0
        with self._cond:
            current = self._peers.get(peer)
            if current is None or current.token != token or self._closed.is_set():
                return  # superseded by a newer start of the peer (or we left): drop it
            if group is not None:
                current.group = group
                self.stats.formed += 1
                how = describe(self.place, current.place or Placement(self.place.host))
                log.info("rank %d: group with rank %d formed in %.1f ms; path %s", self._rank, peer, seconds * 1e3,
                         how)  # fmt: skip
            else:
                current.error = error
                log.warning("rank %d: no group with rank %d (%s)", self._rank, peer, error)
            self._cond.notify_all()

    def _path(self, peer: Peer) -> str:
        # a peer that did not say where it runs is taken for a CPU rank on this host (what every member was)
        return choose_path(self.place, peer.place or Placement(self.place.host))
