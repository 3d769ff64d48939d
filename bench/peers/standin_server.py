"""The embedding stand-in (testkit/standin.py) in a process of its own, driven over stdin/stdout.

    python bench/peers/standin_server.py --dimensions D

Prints its base URL, then answers one line per command:

    reset SECONDS   counters to zero, the vector cache emptied, every answer after SECONDS
    count           {"requests": N, "texts": N, "cpu_seconds": S}
    quit            stop serving and exit

Its own process, so that no system under test shares an interpreter (and a GIL) with it, and
its CPU time is its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from testkit.standin import StandIn, _unit_vector


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dimensions", type=int, default=384)
    args = ap.parse_args()
    with StandIn(dimensions=args.dimensions) as standin:
        print(standin.base_url, flush=True)
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "reset":
                standin.reset()
                standin.delay = float(rest[0]) if rest else 0.0
                _unit_vector.cache_clear()  # no run is served faster for an earlier run's texts
                print("ok", flush=True)
            elif command == "count":
                counts = {
                    "requests": standin.requests,
                    "texts": len(standin.texts),
                    "cpu_seconds": time.process_time(),
                }
                print(json.dumps(counts), flush=True)
            elif command == "quit":
                break
            else:
                print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)


if __name__ == "__main__":
    main()
