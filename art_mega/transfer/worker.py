"""A host's NIXL process: runs its agent's adapter offers and fetches, off the agent's event loop.

Loading NIXL and UCX (about a second of dlopen under the GIL) and polling transfers inside the
agent stalled its heartbeats under load; here they cannot, and UCX stays out of the agent.
Protocol: JSON lines over the socket passed as `--fd`: in `{"id", "op", "body"}` with op offer,
fetch or release; out `{"id", "reply"}`. Requests run concurrently (a thread each); end of file
releases every offer and exits. UCX writes its own log lines to stdout, never to the socket.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from art_mega.transfer.nixl import AdapterTransfers
from art_mega.transfer.protocol import FetchRequest, OfferRequest, ReleaseRequest, ReleaseResponse

MAX_CONCURRENT = 8


def handle(transfers: AdapterTransfers, op: str, body: dict[str, Any]) -> dict[str, Any]:
    """Run one request; returns the reply body (an Offer/Fetch/ReleaseResponse as JSON data)."""
    if op == "offer":
        return transfers.offer(OfferRequest.model_validate(body)).model_dump(mode="json")
    if op == "fetch":
        return transfers.fetch(FetchRequest.model_validate(body)).model_dump(mode="json")
    if op == "release":
        released = transfers.release(ReleaseRequest.model_validate(body).transfer_id)
        return ReleaseResponse(released=released).model_dump(mode="json")
    raise ValueError(f"unknown op {op!r}")


def serve(sock: socket.socket) -> None:
    transfers = AdapterTransfers()
    lock = threading.Lock()

    def run(message: dict[str, Any]) -> None:
        try:
            reply: dict[str, Any] = {"reply": handle(transfers, message["op"], message["body"])}
        except Exception as exc:  # answer every request, whatever failed
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        line = json.dumps({"id": message["id"], **reply}).encode() + b"\n"
        with lock:
            sock.sendall(line)

    with ThreadPoolExecutor(MAX_CONCURRENT) as pool, sock.makefile("rb") as lines:
        for line in lines:
            pool.submit(run, json.loads(line))
    transfers.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m art_mega.transfer.worker")
    parser.add_argument("--fd", type=int, required=True, help="the socket to the agent")
    args = parser.parse_args(argv)
    serve(socket.socket(fileno=args.fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
