"""libzmq 4.3.5 aborts a process whose ROUTER has a receive high-water mark, when a client
fills its receive queue, keeps sending ZMTP heartbeats and closes the connection.

    python scripts/libzmq_router_abort.py 10000   # aborts: Assertion failed: !_io_error
    python scripts/libzmq_router_abort.py 0       # survives: prints "survived"

Why the relay's client ROUTER has no receive mark (relay/node.py). The argument is the
ROUTER's ZMQ_RCVHWM; each round a DEALER with heartbeats queues 50,000 requests the ROUTER
does not read yet, waits, and closes.
"""

from __future__ import annotations

import sys
import time

import zmq

ROUNDS = 6
REQUESTS = 50_000


def main(receive_hwm: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, receive_hwm)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    for round_no in range(ROUNDS):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, 200)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
        dealer.setsockopt(zmq.HEARTBEAT_TTL, 1000)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(REQUESTS):
            dealer.send(b"x" * 100)
        time.sleep(0.5 + 0.4 * round_no)  # heartbeats queue behind the requests
        dealer.close(linger=0)
        time.sleep(0.3)
        taken = 0
        while router.poll(300):
            router.recv_multipart()
            taken += 1
        print(f"round {round_no}: took {taken} requests", flush=True)
    print("survived")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
