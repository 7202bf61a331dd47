"""Controller runtime round trip: what one engine step pays to ask the controllers.

Per step the engine hook (``engines/vllm/controller_hook.py``) makes one main-channel call,
``step``: the seed's ``post_pre_process`` (each sequence's new token, then every sequence's pre
phase) and ``mid_process`` (every sequence's mask, rows back in the bias shm) in one command.
This measures it, and the seed's two separate calls it replaced (``two_calls``), in the same
run, end to end through the shared-memory transport, with the runtime in **another process** as in
production, for the no-op controller (``none``) and, with ``--guidance``, an llguidance regex
controller on the embedded model's tokenizer (vocab 49,152), at batch 1 and 16.

``step`` asks for bitmask rows (``mask_format: bits``), as the hook does; the seed's two
calls write dense float rows.

With ``--throughput`` the same run then measures generation through vLLM: unconstrained vs the
no-op controller vs an llguidance regex, 16 streams, alternated over ``--rounds``
(``bench/controlled_throughput.py``, which also runs alone).

Usage::

    python bench/controllers.py [--steps 500] [--batch 1 16] [--guidance] [--throughput]

Writes ``bench/results/controllers.json`` with the CPU flags (and the engine's dtype with
``--throughput``). Run it on an idle box.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pipeline import _cpu_flags  # noqa: E402
from engines.controllers.ipc.channels import MainClient, SideClient  # noqa: E402
from engines.controllers.ipc.shm import ChannelObjects  # noqa: E402

RUNTIME = r"""
import sys, threading
from engines.controllers.runtime.builtin import BUILTIN_CONTROLLERS, HFTokenizerInfo
from engines.controllers.runtime.runtime import ControllerRuntime
from engines.controllers.ipc.shm import BiasMatrix
from engines.controllers.ipc.channels import MainServer, SideServer
prefix, model_dir = sys.argv[1], sys.argv[2]
tok = HFTokenizerInfo.from_pretrained(model_dir)
tok.llg  # built once at start, as a runtime actor does
rt = ControllerRuntime(tok, BUILTIN_CONTROLLERS, BiasMatrix(prefix, create=False))
main, side = MainServer(prefix), SideServer(prefix)
threading.Thread(target=side.serve, args=(rt.handle_side,), daemon=True).start()
main.serve(rt.handle_main)
"""


def measure(main: MainClient, side: SideClient, batch: int, steps: int, module: str,
            arg: str, token: int) -> dict:
    base = int(time.time() * 1000) % 1_000_000 * 100
    seqs = list(range(base, base + batch))
    for seq in seqs:
        side.call("instantiate", timeout=30, req_id=f"run-{seq}", prompt=[], module_id=module,
                  module_arg=arg)
    main.call("post_pre_process", timeout=30, post_ops=[],
              pre_ops=[{"id": s, "req_id": f"run-{s}"} for s in seqs], freed=[])
    pre_ms, mid_ms, merged_ms = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        main.call("step", timeout=30, pre_ops=[], freed=[], mask_format="bits",
                  post_ops=[{"id": s, "tokens": [token], "backtrack": 0} for s in seqs],
                  mid_ops=[{"id": s, "clone_id": None} for s in seqs])
        merged_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        main.call("post_pre_process", timeout=30, pre_ops=[], freed=[],
                  post_ops=[{"id": s, "tokens": [token], "backtrack": 0} for s in seqs])
        t1 = time.perf_counter()
        main.call("mid_process", timeout=30, ops=[{"id": s, "clone_id": None} for s in seqs])
        t2 = time.perf_counter()
        pre_ms.append((t1 - t0) * 1000)
        mid_ms.append((t2 - t1) * 1000)
    main.call("post_pre_process", timeout=30, post_ops=[], pre_ops=[], freed=seqs)
    step = [a + b for a, b in zip(pre_ms, mid_ms, strict=True)]

    def pct(xs: list[float], q: int) -> float:
        return round(statistics.quantiles(xs, n=100)[q - 1], 3)

    return {"controller": module, "batch": batch, "steps": steps,
            "step_p50_ms": pct(merged_ms, 50), "step_p99_ms": pct(merged_ms, 99),
            "two_calls_p50_ms": pct(step, 50), "two_calls_p99_ms": pct(step, 99),
            "post_pre_p50_ms": pct(pre_ms, 50), "mid_p50_ms": pct(mid_ms, 50)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--guidance", action="store_true",
                        help="also an llguidance regex controller ([a-z ]+, any length)")
    parser.add_argument("--throughput", action="store_true",
                        help="then generation through vLLM: plain vs none vs regex, 16 streams")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    args = parser.parse_args()
    from engines.controllers.runtime.builtin import HFTokenizerInfo
    from engines.kit.embedded import prepare_embedded_model
    model_dir = str(prepare_embedded_model(progress=False))
    tok = HFTokenizerInfo.from_pretrained(model_dir)
    vocab = tok.vocab_size
    letter = tok.encode(" the")[0]  # a token the regex below keeps allowing
    prefix = f"/bc{os.getpid()}-{uuid.uuid4().hex[:4]}-"
    objects = ChannelObjects(prefix, json_size=1 << 20, bin_size=max(args.batch) * vocab * 4)
    proc = subprocess.Popen([sys.executable, "-c", RUNTIME, prefix, model_dir], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    main_ch, side = MainClient(prefix, create=False), SideClient(prefix, create=False)
    rows = []
    try:
        main_ch.call("ping", timeout=120)
        cases = [("none", "")]
        if args.guidance:
            grammar = {"grammars": [{"lark_grammar": "start: /[a-z ]+/"}]}
            cases.append(("llguidance", json.dumps({"grammar": grammar})))
        for module, arg in cases:
            for batch in args.batch:
                row = measure(main_ch, side, batch, args.steps, module, arg, letter)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.kill()
        side.close()
        main_ch.close()
        objects.close()
    out = {"machine": {"cpu_flags": _cpu_flags(), "cores": os.cpu_count(),
                       "python": platform.python_version()},
           "vocab": vocab, "command": " ".join(["python", "bench/controllers.py", *sys.argv[1:]]),
           "rows": rows}
    if args.throughput:
        from bench.controlled_throughput import measure_throughput

        out["throughput"] = measure_throughput(rounds=args.rounds)
        print(json.dumps(out["throughput"]["vs_plain"]), flush=True)
    path = ROOT / "bench" / "results" / "controllers.json"
    path.parent.mkdir(parents=True, exist_ok=True)  # ignored by git: absent in a clone
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
