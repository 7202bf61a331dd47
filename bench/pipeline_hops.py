"""Where one sequence's per-token time goes between pipeline stages: the same two layer ranges
of the embedded model decoding one token at a time, in this process, as Ray actors chained by
ObjectRefs (what ``RayStages`` does), and as the same actors chained by ZeroMQ sockets (a direct
channel, Ray only placing them); plus an empty actor call back to back and after the caller
idled (a stage waits that long for its next token).

Usage::

    python bench/pipeline_hops.py [--rounds 3] [--tokens 48]

Round-robin over the ways, medians; prints one JSON line per way and round, then a summary.
Run it on an idle box; it records the CPU flags. docs/benchmarks.md, "Pipeline hops".
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pipeline import _cpu_flags

SPLIT = ((1, 16), (16, 30))  # the embedded model's layers after the origin's first


def _hop(position: int, sid: str, hidden: int):
    import torch

    from engines.pipeline.stage import Hop

    if position == 0:  # a 16-token prompt first
        return Hop.single(torch.randn(1, 16, hidden), torch.arange(16), sid, 0)
    return Hop.single(torch.randn(1, 1, hidden), torch.tensor([position]), sid, position)


def _stage_class():
    import ray

    @ray.remote(num_cpus=0.01)
    class Stage:
        """A StageCore, called by Ray (``forward``) or fed by a ZeroMQ socket (``wire``)."""

        def __init__(self, path: str, start: int, end: int):
            import torch

            from engines.pipeline.loading import load_layers
            from engines.pipeline.stage import StageCore

            torch.set_num_threads(1)
            self.core = StageCore(load_layers(path, start, end, torch.float32, "sdpa"), start, end)

        def forward(self, hop):
            return self.core.forward(hop)

        def ping(self) -> float:
            return time.perf_counter()

        def wire(self, next_address: str) -> str:
            import zmq

            context = zmq.Context.instance()
            pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
            port = pull.bind_to_random_port("tcp://127.0.0.1")
            push.connect(next_address)

            def serve() -> None:
                while True:
                    push.send(pickle.dumps(self.core.forward(pickle.loads(pull.recv())), 5))

            threading.Thread(target=serve, daemon=True).start()
            return f"tcp://127.0.0.1:{port}"

    return Stage


def _per_token(call, tokens: int, sid: str, hidden: int) -> float:
    call(_hop(0, sid, hidden))
    gaps = []
    for position in range(16, 16 + tokens):
        hop = _hop(position, sid, hidden)
        started = time.perf_counter()
        call(hop)
        gaps.append(time.perf_counter() - started)
    return 1000 * statistics.median(gaps)


def _empty_call_ms(stage, idle_s: float, calls: int = 40) -> float:
    import ray

    gaps = []
    for _ in range(calls):
        time.sleep(idle_s)
        started = time.perf_counter()
        ray.get(stage.ping.remote())
        gaps.append(time.perf_counter() - started)
    return 1000 * statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()

    import ray
    import torch
    import zmq

    from engines.embedded import prepare_embedded_model
    from engines.pipeline.loading import load_layers
    from engines.pipeline.stage import StageCore

    path = str(prepare_embedded_model())
    torch.set_num_threads(1)
    local = [StageCore(load_layers(path, a, b, torch.float32, "sdpa"), a, b) for a, b in SPLIT]
    hidden = local[0].model.config.hidden_size
    ray.init(include_dashboard=False, log_to_driver=False)
    stage = _stage_class()
    by_ref = [stage.remote(path, a, b) for a, b in SPLIT]
    by_zmq = [stage.remote(path, a, b) for a, b in SPLIT]
    ray.get([s.ping.remote() for s in by_ref + by_zmq])
    back = zmq.Context.instance().socket(zmq.PULL)
    back_address = f"tcp://127.0.0.1:{back.bind_to_random_port('tcp://127.0.0.1')}"
    second = ray.get(by_zmq[1].wire.remote(back_address))
    into = zmq.Context.instance().socket(zmq.PUSH)
    into.connect(ray.get(by_zmq[0].wire.remote(second)))

    def zmq_call(hop):
        into.send(pickle.dumps(hop, 5))
        return pickle.loads(back.recv())

    ways = {
        "in process": lambda hop: local[1].forward(local[0].forward(hop)),
        "Ray actors, chained ObjectRefs": lambda hop: ray.get(
            by_ref[1].forward.remote(by_ref[0].forward.remote(hop))),
        "Ray actors, ZeroMQ chain": zmq_call,
    }
    rows = []
    for rnd in range(args.rounds):
        for name, call in ways.items():
            ms = _per_token(call, args.tokens, f"{name}-{rnd}", hidden)
            rows.append({"way": name, "round": rnd, "ms_per_token": round(ms, 2)})
            print(json.dumps(rows[-1]), flush=True)
        for idle_s in (0.0, 0.045):
            ms = _empty_call_ms(by_ref[0], idle_s)
            rows.append({"way": f"empty Ray call after {idle_s * 1000:.0f} ms idle",
                         "round": rnd, "ms_per_token": round(ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    print(json.dumps({"cpu_flags": _cpu_flags(), "dtype": "float32", "threads": 1}))
    for name in dict.fromkeys(r["way"] for r in rows):
        got = [r["ms_per_token"] for r in rows if r["way"] == name]
        print(f"{name:40s} median {statistics.median(got):8.2f} ms  (rounds {got})")


if __name__ == "__main__":
    main()
