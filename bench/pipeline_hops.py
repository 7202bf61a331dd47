"""Where one sequence's per-token time goes between pipeline stages: the same two layer ranges
of the embedded model decoding one token at a time, in this process, as Ray actors chained by
ObjectRefs (what ``RayStages`` did before the stage channel), and as the same kind of actors
chained by the stage channel (``engines/pipeline/wire.py``, what ``RayStages`` does); for the
channel, each stage's own forward time is read inside the actor too. Plus an empty actor call
back to back and after the caller idled (a stage waits that long for its next token).

Usage::

    python bench/pipeline_hops.py [--rounds 3] [--tokens 48] [--packed]

``--packed``: every stage's linear weights packed for oneDNN, as the pipeline runs on CPU.
Round-robin over the ways, medians; prints one JSON line per way and round, then a summary.
Run it on an idle box; it records the CPU flags. docs/results/benchmarks-2026-12-07.md,
"Pipeline hops" and "The stage channel".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.pipeline import _cpu_flags

SPLIT = ((1, 16), (16, 30))  # the embedded model's layers after the origin's first
SECRET = "bench"


def _hop(position: int, sid: str, hidden: int, step: int = 0):
    import torch

    from engines.pipeline.stage import Hop

    if position == 0:  # a 16-token prompt first
        return Hop.single(torch.randn(1, 16, hidden), torch.arange(16), sid, step)
    return Hop.single(torch.randn(1, 1, hidden), torch.tensor([position]), sid, step)


def _layers(path: str, start: int, end: int, packed: bool):
    import torch

    from engines.pipeline.kernels import pack_linears
    from engines.pipeline.loading import load_layers

    model = load_layers(path, start, end, torch.float32, "sdpa")
    if packed:
        pack_linears(model)
    return model


def _stage_class():
    import ray

    @ray.remote(num_cpus=0.01, max_concurrency=2)
    class Stage:
        """A StageCore, called by Ray (``forward``) or fed by the stage channel, timing its
        own forwards."""

        def __init__(self, path: str, start: int, end: int, packed: bool):
            import torch

            from engines.pipeline.stage import StageCore
            from engines.pipeline.wire import StageServer

            torch.set_num_threads(1)
            self.core = StageCore(_layers(path, start, end, packed), start, end)
            self.spent: list[float] = []
            self.server = StageServer(self, SECRET, "127.0.0.1")  # forwards through self

        # What StageServer asks of its core, timed.
        @property
        def start(self) -> int:
            return self.core.start

        @property
        def end(self) -> int:
            return self.core.end

        def free(self, seq_id: str) -> None:
            self.core.free(seq_id)

        def forward(self, hop, check: bool = False):
            started = time.perf_counter()
            try:
                return self.core.forward(hop, check)
            finally:
                self.spent.append(time.perf_counter() - started)

        def address(self) -> str:
            return self.server.address

        def connect(self, address: str) -> None:
            self.server.connect(address)

        def forward_ms(self, skip: int) -> float | None:
            """The median of its forwards since the last ask, the first ``skip`` left out."""
            spent, self.spent = self.spent[skip:], []
            return 1000 * statistics.median(spent) if spent else None

        def ping(self) -> float:
            return time.perf_counter()

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


def _channel(stage_cls, path: str, packed: bool):
    """Two stage actors chained by the stage channel; (call, actors)."""
    import itertools

    import ray

    from engines.pipeline.wire import OriginWire

    actors = [stage_cls.remote(path, a, b, packed) for a, b in SPLIT]
    wire = OriginWire(SECRET, "127.0.0.1")
    first, second = ray.get([a.address.remote() for a in actors])
    ray.get([actors[0].connect.remote(second), actors[1].connect.remote(wire.address)])
    wire.connect(first)
    steps = itertools.count()

    def call(hop):
        hop.step = next(steps)
        return wire.submit(hop, check=False).result(timeout=60)

    return call, actors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--packed", action="store_true")
    args = parser.parse_args()

    import ray
    import torch

    from engines.kit.embedded import prepare_embedded_model
    from engines.pipeline.stage import StageCore

    path = str(prepare_embedded_model())
    torch.set_num_threads(1)
    local = [StageCore(_layers(path, a, b, args.packed), a, b) for a, b in SPLIT]
    hidden = local[0].model.config.hidden_size
    ray.init(include_dashboard=False, log_to_driver=False)
    stage = _stage_class()
    by_ref = [stage.remote(path, a, b, args.packed) for a, b in SPLIT]
    by_channel, channel_actors = _channel(stage, path, args.packed)
    ray.get([s.ping.remote() for s in by_ref + channel_actors])

    def in_process(hop):
        start = time.perf_counter()
        out = local[0].forward(hop)
        middle = time.perf_counter()
        local[1].forward(out)
        in_process.spent.append((middle - start, time.perf_counter() - middle))

    in_process.spent = []
    ways = {
        "in process": in_process,
        "Ray actors, chained ObjectRefs": lambda hop: ray.get(
            by_ref[1].forward.remote(by_ref[0].forward.remote(hop))),
        "Ray actors, stage channel": by_channel,
    }
    rows = []
    for rnd in range(args.rounds):
        for name, call in ways.items():
            ms = _per_token(call, args.tokens, f"{name}-{rnd}", hidden)
            rows.append({"way": name, "round": rnd, "ms_per_token": round(ms, 2)})
            print(json.dumps(rows[-1]), flush=True)
        # Each stage's forward on its own (the prompt's left out): in this process, in the actors.
        spent, in_process.spent = in_process.spent[1:], []
        here = [1000 * statistics.median(s[i] for s in spent) for i in range(2)]
        there = ray.get([a.forward_ms.remote(skip=1) for a in channel_actors])
        ray.get([a.forward_ms.remote(skip=0) for a in by_ref])  # not read: emptied only
        for where, values in (("in process", here), ("in the channel's actors", there)):
            rows.append({"way": f"stage forwards, {where}", "round": rnd,
                         "ms_per_token": [round(v, 2) for v in values]})
            print(json.dumps(rows[-1]), flush=True)
        for idle_s in (0.0, 0.045):
            ms = _empty_call_ms(by_ref[0], idle_s)
            rows.append({"way": f"empty Ray call after {idle_s * 1000:.0f} ms idle",
                         "round": rnd, "ms_per_token": round(ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    _report(rows, args.packed)


def _report(rows: list[dict], packed: bool) -> None:
    """The box and settings, then each way's median over the rounds."""
    print(json.dumps({"cpu_flags": _cpu_flags(), "dtype": "float32", "threads": 1,
                      "packed": packed}))
    for name in dict.fromkeys(r["way"] for r in rows):
        got = [r["ms_per_token"] for r in rows if r["way"] == name]
        if isinstance(got[0], list):
            print(f"{name:40s} per stage, rounds {got}")
        else:
            print(f"{name:40s} median {statistics.median(got):8.2f} ms  (rounds {got})")


if __name__ == "__main__":
    main()
