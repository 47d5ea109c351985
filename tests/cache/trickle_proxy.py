"""A TCP proxy on 127.0.0.1 that forwards to a target and lets the bytes trickle: each
direction is passed on in small pieces at most --bytes-per-s (0: at full speed). The
remote-tier tests run it as a child process, stopped by its PID, to put a slow link
between the client and a real server:

    python tests/cache/trickle_proxy.py --target 127.0.0.1:6379 --down 50000 --up 0

It prints the port it listens on (one line on stdout) once it accepts connections.
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import time

PIECE = 1024   # bytes passed on at once when throttled


def pump(src: socket.socket, dst: socket.socket, bytes_per_s: float) -> None:
    """Copies src to dst until either side closes; throttled: PIECE bytes, then the pause
    that keeps the average at bytes_per_s."""
    try:
        while True:
            data = src.recv(PIECE if bytes_per_s else 1 << 16)
            if not data:
                break
            dst.sendall(data)
            if bytes_per_s:
                time.sleep(len(data) / bytes_per_s)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listener: socket.socket, target: tuple[str, int], up: float, down: float) -> None:
    while True:
        client, _ = listener.accept()
        server = socket.create_connection(target)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(client, server, up), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, down), daemon=True).start()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--up", type=float, default=0.0, help="client to server bytes/s (0: unthrottled)")
    ap.add_argument("--down", type=float, default=0.0, help="server to client bytes/s (0: unthrottled)")
    a = ap.parse_args()
    host, port = a.target.rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    print(listener.getsockname()[1], flush=True)
    serve(listener, (host, int(port)), a.up, a.down)
    return 0


if __name__ == "__main__":
    sys.exit(main())
