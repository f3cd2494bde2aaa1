"""What forming a process group on demand costs (issue 26: a data plane with dynamic membership).

Today every worker joins one `torch.distributed` world of fixed size at start, so a dead rank can never come back.
The alternative is a rendezvous store (torch's `TCPStore`) and a small gloo group per pair or per gang, formed when a
plan first needs it (`ProcessGroupGloo` over a `PrefixStore` named for the pair and an epoch), cached, and dropped
when a member dies. This measures, on this machine, with N fresh processes that know only the store's address:

- forming a 2-rank group for every pair (both sides), and its first 4-byte exchange (gloo connects lazily);
- a 1 MiB transfer on a formed pair, against the same over a fixed world's default group (today's data plane);
- a gang of all N formed at once;
- after one process is killed: its survivors' own pairs still exchange, an op with the dead one fails (not hangs),
  and a restarted process forms new pairs with everyone (a new epoch) and exchanges.

Prints a table, writes JSON.   .venv/bin/python bench/pg_formation.py [--procs 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = timedelta(seconds=20)
REPEATS = 7  # 1 MiB exchanges per pair (the first includes gloo's buffer set-up)


def _store(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def _pair(store: dist.TCPStore, me: int, peer: int, epoch: int) -> tuple[dist.ProcessGroupGloo, float]:
    a, b = sorted((me, peer))
    t0 = time.perf_counter()
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{a}-{b}/{epoch}", store), int(me == b), 2, TIMEOUT)
    return pg, time.perf_counter() - t0


def _exchange(pg: dist.ProcessGroupGloo, me_low: bool, t: torch.Tensor) -> float:
    """Lower rank sends first, then receives back."""
    t0 = time.perf_counter()
    if me_low:
        pg.send([t], 1, 0).wait()
        pg.recv([t], 1, 1).wait()
    else:
        pg.recv([t], 0, 0).wait()
        pg.send([t], 0, 1).wait()
    return time.perf_counter() - t0


def worker(rank: int, procs: int, port: int, world_port: int, out: str, epoch: int = 0) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = _store(port)
    rec: dict[str, list[float]] = {"form": [], "first": [], "mib_pair": []}
    small, big = torch.zeros(1), torch.zeros(1 << 18)  # 4 B, 1 MiB
    pairs = {}
    for peer in range(procs):
        if peer == rank:
            continue
        pg, t = _pair(store, rank, peer, epoch)
        pairs[peer] = pg
        rec["form"].append(t)
        rec["first"].append(_exchange(pg, rank < peer, small))
    for peer, pg in pairs.items():
        for _ in range(REPEATS):
            rec["mib_pair"].append(_exchange(pg, rank < peer, big) / 2)
    if epoch == 0:
        t0 = time.perf_counter()
        gang = dist.ProcessGroupGloo(dist.PrefixStore("gang/all/0", store), rank, procs, TIMEOUT)
        gang.barrier().wait()
        rec["gang"] = [time.perf_counter() - t0]
        # today's data plane: one fixed world (the default group), the same 1 MiB exchange with each peer
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{world_port}", rank=rank, world_size=procs,
                                timeout=TIMEOUT)  # fmt: skip
        rec["mib_world"] = []
        for peer in range(procs):
            if peer == rank:
                continue
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                if rank < peer:
                    dist.send(big, peer, tag=7)
                    dist.recv(big, peer, tag=8)
                else:
                    dist.recv(big, peer, tag=7)
                    dist.send(big, peer, tag=8)
                rec["mib_world"].append((time.perf_counter() - t0) / 2)
        dist.barrier()
    Path(out, f"rank{rank}-{epoch}.json").write_text(json.dumps(rec))
    store.set(f"done/{rank}/{epoch}", "1")
    if epoch == 0 and rank == procs - 1:
        os._exit(0)  # the victim: gone without a goodbye
    if epoch == 0 and rank == 0:  # a survivor: its pair with the dead one fails, its others still work
        store.wait([f"done/{procs - 1}/0"])
        time.sleep(0.5)
        t0 = time.perf_counter()
        try:
            _exchange(pairs[procs - 1], True, small)
            dead = "no error"
        except RuntimeError as e:
            dead = str(e).split("\n")[0][:120]
        failed_s = time.perf_counter() - t0
        ok = _exchange(pairs[1], True, small)
        Path(out, "survivor.json").write_text(json.dumps({"dead_peer_error": dead, "dead_peer_s": failed_s,
                                                          "live_peer_s": ok}))  # fmt: skip
    if epoch == 0 and rank == 1:
        _exchange(pairs[0], False, small)
    # stay for the restarted process: form epoch-1 pairs with it
    store.wait([f"restarted/{procs - 1}"])
    pg, t = _pair(store, rank, procs - 1, 1)
    first = _exchange(pg, True, small)
    Path(out, f"rejoin{rank}.json").write_text(json.dumps({"form": t, "first": first}))


def restarted(rank: int, procs: int, port: int, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = _store(port)
    store.set(f"restarted/{rank}", "1")
    t0 = time.perf_counter()
    for peer in range(procs - 1):
        pg, _ = _pair(store, rank, peer, 1)
        _exchange(pg, False, torch.zeros(1))
    Path(out, "restarted.json").write_text(json.dumps({"all_pairs_s": time.perf_counter() - t0}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--json", type=Path, default=Path("bench/results/pg_formation.json"))
    args = p.parse_args(argv)
    if args.procs < 3:
        p.error("--procs must be >= 3 (a victim, a survivor and a third)")
    import tempfile

    from spindle_model.testing import free_port

    port, world_port = free_port(), free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        first = [ctx.Process(target=worker, args=(r, args.procs, port, world_port, out)) for r in range(args.procs)]
        for proc in first:
            proc.start()
        first[-1].join(120)
        server.wait(["done/0/0"], timedelta(seconds=120))
        time.sleep(1.5)  # the survivor tries the dead pair first
        again = ctx.Process(target=restarted, args=(args.procs - 1, args.procs, port, out))
        again.start()
        again.join(120)
        for proc in first:
            proc.join(60)
        recs = [json.loads(Path(out, f"rank{r}-0.json").read_text()) for r in range(args.procs)]
        survivor = json.loads(Path(out, "survivor.json").read_text())
        rejoin = json.loads(Path(out, "restarted.json").read_text())
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    flat = lambda k: [x for r in recs for x in r[k]]  # noqa: E731
    doc = {
        "procs": args.procs,
        "pair_form_ms": ms(flat("form")),
        "pair_first_exchange_ms": ms(flat("first")),
        "gang_form_ms": ms(flat("gang")),
        "mib_pair_ms": ms(flat("mib_pair")),
        "mib_world_ms": ms(flat("mib_world")),
        "dead_peer": survivor,
        "restarted_all_pairs_ms": 1e3 * rejoin["all_pairs_s"],
    }
    print(f"{args.procs} processes, gloo on loopback (medians over every pair and side)")
    for k, v in doc.items():
        if k.endswith("_ms"):
            print(f"  {k:<26} {v:9.2f} ms")
    print(f"  a dead peer's pair: {survivor['dead_peer_error']!r} after {survivor['dead_peer_s'] * 1e3:.1f} ms; "
          f"a live pair of the same survivor then {survivor['live_peer_s'] * 1e3:.2f} ms")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
