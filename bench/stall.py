"""Where a server's TTFT goes under contention: one start per server, then back-to-back runs.

``compare.py`` starts every server afresh per round; this keeps one server up and drives it
with ``--runs`` back-to-back ``vllm bench serve`` runs (``compare.py``'s load: 128-in / 64-out,
at least 64 prompts), so a start-up transient and a steady loss tell apart. Around those runs
it reads every serving thread's scheduler statistics (``/proc/<pid>/task/<tid>/schedstat``:
time on a CPU, time runnable but waiting in the run queue, slices), which says who waits for a
core, not who computes. Usage::

    python bench/stall.py [--model tiny] [--targets gateway-colocated-haproxy,bare] \
        [--runs 6] [--concurrency 16] [--hog]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare

# The serving processes: Ray's workers and daemons, vLLM's, HAProxy, bare vLLM's API server.
_SERVING_PREFIXES = ("ray::", "VLLM::")
_SERVING_NAMES = ("raylet", "gcs_server", "haproxy")


def _serving_pids() -> dict[int, str]:
    out = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        cmdline = proc.info["cmdline"] or []
        title = " ".join(cmdline)
        if (title.startswith(_SERVING_PREFIXES) or proc.info["name"] in _SERVING_NAMES
                or "vllm.entrypoints.openai.api_server" in title):
            out[proc.pid] = title[:40] or proc.info["name"]
    return out


def _schedstat(pids: dict[int, str]) -> dict[tuple[int, int], tuple[str, int, int, int]]:
    """(pid, tid) -> (thread name, ns on a CPU, ns waiting in the run queue, slices)."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                run, wait, slices = map(int, (task / "schedstat").read_text().split())
                out[(pid, int(task.name))] = ((task / "comm").read_text().strip(), run, wait,
                                              slices)
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    return out


def _waits(pids: dict[int, str], before: dict, after: dict, top: int) -> list[dict]:
    rows = []
    for key, (comm, run, wait, slices) in after.items():
        if key in before:
            _, run0, wait0, slices0 = before[key]
            rows.append({"process": pids[key[0]], "thread": comm,
                         "wait_ms": round((wait - wait0) / 1e6), "run_ms": round((run - run0) / 1e6),
                         "slices": slices - slices0})
    return sorted(rows, key=lambda r: r["wait_ms"], reverse=True)[:top]


def measure_target(target: str, model: tuple[str, str, dict], runs: int, concurrency: int,
                   top: int, client: str = "normal") -> dict:
    name, model_dir, overrides = model
    port = compare.PORTS[target]
    proc = compare.STARTERS[target](name, model_dir, overrides)
    try:
        compare._wait_ready(f"http://127.0.0.1:{port}", name, proc)
        pids = _serving_pids()
        before, start = _schedstat(pids), time.monotonic()
        out = []
        for i in range(runs):
            r = compare._bench(port, name, model_dir, concurrency, max(64, 2 * concurrency),
                               "openai", client)
            row = {"target": target, "run": i, "t_s": round(time.monotonic() - start, 1),
                   "tok_s": round(r["output_throughput"]),
                   "ttft_p50": round(r["median_ttft_ms"]), "ttft_p90": round(r["p90_ttft_ms"]),
                   "tpot_p50": round(r["median_tpot_ms"], 2)}
            out.append(row)
            print(json.dumps(row), flush=True)
        wall = round(time.monotonic() - start, 1)
        return {"runs": out, "wall_s": wall, "threads": _waits(pids, before, _schedstat(pids), top)}
    finally:
        compare._stop(proc)
        if target != "bare":
            subprocess.run([compare._bin("ray"), "stop", "--force"], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["embedded", "tiny"])
    parser.add_argument("--targets", type=lambda s: s.split(","),
                        default=["gateway-colocated-haproxy", "bare"])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--hog", action="store_true")
    parser.add_argument("--client-priority", dest="client", choices=compare.CLIENT_PRIORITIES,
                        default="realtime", help="scheduling of the load generator")
    parser.add_argument("--top", type=int, default=25, help="threads listed per server")
    args = parser.parse_args()
    unknown = set(args.targets) - set(compare.STARTERS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}: {sorted(compare.STARTERS)}")
    (model,) = compare._models([args.model])
    client = compare.client_priority(args.client)
    hog = compare._hog() if args.hog else None
    try:
        results = {t: measure_target(t, model, args.runs, args.concurrency, args.top, client)
                   for t in args.targets}
    finally:
        if hog:
            compare._stop(hog)
    compare.RESULTS.mkdir(exist_ok=True)
    (compare.RESULTS / "stall.json").write_text(json.dumps(results, indent=1))
    for target, res in results.items():
        print(f"\n{target}: {res['wall_s']} s; thread: run-queue wait ms, on-CPU ms, slices")
        for t in res["threads"]:
            print(f"{t['wait_ms']:8d} {t['run_ms']:8d} {t['slices']:7d}  "
                  f"{t['process'][:38]:38s} {t['thread']}")


if __name__ == "__main__":
    main()
