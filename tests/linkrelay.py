"""A data link between simulated hosts with latency and packet loss, for kernels without netem.

``python tests/linkrelay.py CONTROL IFACE...`` forwards every Ethernet frame that arrives on one
of the interfaces (the machine's ends of the hosts' data links) to all the others, as a hub
does, after ``delay_ms`` and dropping each frame with probability ``loss``. The settings are
read from the JSON file CONTROL whenever it changes (``{"delay_ms": 20, "loss": 0.01,
"seed": 0}``). The hosts' ends must not build frames larger than the link's MTU (their
``gso_max_size`` is set to it), since a frame is forwarded as it is.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def main(control: str, ifaces: list[str]) -> int:
    socks = []
    for name in ifaces:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((name, ETH_P_ALL))
        s.setblocking(False)
        socks.append(s)
    settings = {"delay_ms": 0.0, "loss": 0.0, "seed": 0}
    rng = random.Random(0)
    seen_mtime = 0.0
    queue: list[tuple[float, int, int, bytes]] = []  # (due, n, from socket, frame)
    n = 0
    while True:
        try:
            mtime = os.stat(control).st_mtime
            if mtime != seen_mtime:
                seen_mtime = mtime
                with open(control) as f:
                    settings.update(json.load(f))
                rng = random.Random(settings.get("seed", 0))
        except (OSError, ValueError):
            pass
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, src, frame = heapq.heappop(queue)
            for i, s in enumerate(socks):
                if i != src:
                    try:
                        s.send(frame)
                    except OSError:
                        pass  # a link that is down drops what it is sent
        wait = min(0.05, max(0.0, queue[0][0] - now)) if queue else 0.05
        ready, _, _ = select.select(socks, [], [], wait)
        for s in ready:
            src = socks.index(s)
            while True:
                try:
                    frame, addr = s.recvfrom(65536)
                except (BlockingIOError, OSError):
                    break
                if addr[2] == PACKET_OUTGOING:
                    continue
                if settings["loss"] and rng.random() < float(settings["loss"]):
                    continue
                n += 1
                heapq.heappush(queue, (time.monotonic() + float(settings["delay_ms"]) / 1000, n, src, frame))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
