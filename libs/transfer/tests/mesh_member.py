"""One member of the mesh test (a separate process): `python mesh_member.py RANK PORT DIR [FIRST_STEP]`.

Steps are driven by files in DIR (the test writes `go-<step>`, the member writes `<rank>-<step>.json`):
- `exchange`: a header-checked transfer with every other live member, both ways, all at once;
- `probe`: the same, recording per peer whether it worked and how long it took (a dead peer must fail fast).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from spindle_transfer import DataPlane, TransferError, header_of

WORLD = 8
TAG_BASE = 100


def exchange(dp: DataPlane, peers: list[int], step: int) -> dict[str, object]:
    """Send rank*1000+peer to every peer and receive peer*1000+rank from it, concurrently; per peer the outcome."""
    out: dict[str, object] = {}

    def with_peer(peer: int) -> None:
        t0 = time.perf_counter()
        mine = torch.full((3, 5), float(dp.rank * 1000 + peer))
        header = header_of(mine)
        # each direction has its own tag: the receiver's rank picks it (as new_tag would), both sides know it
        err: list[str] = []

        def send() -> None:
            try:
                dp.send(mine, peer, TAG_BASE + step * WORLD + peer, header, timeout_s=10)
            except TransferError as e:
                err.append(str(e))

        sender = threading.Thread(target=send)
        sender.start()
        try:
            got = dp.recv(header, peer, TAG_BASE + step * WORLD + dp.rank, timeout_s=10)
            ok = bool(torch.equal(got, torch.full((3, 5), float(peer * 1000 + dp.rank))))
        except TransferError as e:
            ok, err = False, [*err, str(e)]
        sender.join()
        out[str(peer)] = {"ok": ok and not err, "seconds": time.perf_counter() - t0, "error": "; ".join(err)}

    threads = [threading.Thread(target=with_peer, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    rank, port, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    t0 = time.perf_counter()
    dp = DataPlane.init(rank, WORLD, f"mesh://127.0.0.1:{port}", timeout_s=5)
    joined_s = time.perf_counter() - t0
    assert dp.mesh is not None
    dp.mesh.wait_formed(10)  # a started member is ready once its groups are: the test waits for this file
    (folder / f"joined-{rank}-{os.getpid()}").touch()
    step = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    while True:
        go = folder / f"go-{step}"
        while not go.exists():
            time.sleep(0.02)
        order = json.loads(go.read_text())
        if order.get("exit"):
            dp.close()
            return
        if rank not in order["members"]:
            step += 1
            continue
        peers = [p for p in order["members"] + order.get("dead", []) if p != rank]
        pending = dp.mesh.wait_formed(10)
        result = {
            "joined_s": joined_s,
            "exchange": exchange(dp, peers, step),
            "peers": {str(k): v for k, v in dp.mesh.peers().items()},
            "not_ready": {str(k): v for k, v in pending.items()},
            "stats": {"formed": dp.mesh.stats.formed, "replaced": dp.mesh.stats.replaced},
        }
        tmp = folder / f".{rank}-{step}.json"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, folder / f"{rank}-{step}.json")
        step += 1


if __name__ == "__main__":
    main()
