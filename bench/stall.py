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

from bench import load, servers

# The serving processes: Ray's workers and daemons, vLLM's, HAProxy, bare vLLM's API server.
_SERVING_PREFIXES = ("ray::", "VLLM::")
_SERVING_NAMES = ("raylet", "gcs_server", "haproxy")


def _label(cmdline: list[str], name: str) -> str:
    title = " ".join(cmdline)
    if title.startswith(_SERVING_PREFIXES) or not cmdline:
        return title[:40] or name
    # A plain interpreter (Ray's dashboard, log monitor, agents; `serve run`): name its script.
    return " ".join(Path(a).name for a in cmdline[:3])[:40]


def _serving_pids(root_pid: int | None = None) -> dict[int, str]:
    """The serving processes: the tree under the server the benchmark started, and anything
    titled like Ray's or vLLM's (Ray's workers are not always that tree's descendants)."""
    tree = set()
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            tree = {root.pid, *(c.pid for c in root.children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    out = {}
    for proc in psutil.process_iter(["cmdline", "name"]):
        cmdline = proc.info["cmdline"] or []
        title = " ".join(cmdline)
        if (proc.pid in tree or title.startswith(_SERVING_PREFIXES)
                or proc.info["name"] in _SERVING_NAMES
                or "vllm.entrypoints.openai.api_server" in title):
            out[proc.pid] = _label(cmdline, proc.info["name"])
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


def _threads(pids: dict[int, str], before: dict, after: dict,
             born: frozenset[int] = frozenset()) -> list[dict]:
    """Every serving thread's run-queue wait, time on a CPU and slices between two readings.
    A process in ``born`` started between them (Serve restarts HAProxy when it reloads it): its
    threads count from zero; other threads without a first reading are left out."""
    rows = []
    for key, (comm, run, wait, slices) in after.items():
        if key in before or key[0] in born:
            _, run0, wait0, slices0 = before.get(key, (comm, 0, 0, 0))
            rows.append({"process": pids[key[0]], "thread": comm,
                         "wait_ms": round((wait - wait0) / 1e6), "run_ms": round((run - run0) / 1e6),
                         "slices": slices - slices0})
    return rows


def _per_process(rows: list[dict]) -> list[dict]:
    """On-CPU and waiting time summed per process, most CPU first: where the CPU went."""
    totals: dict[str, dict] = {}
    for r in rows:
        t = totals.setdefault(r["process"], {"process": r["process"], "run_ms": 0, "wait_ms": 0})
        t["run_ms"] += r["run_ms"]
        t["wait_ms"] += r["wait_ms"]
    return sorted(totals.values(), key=lambda t: t["run_ms"], reverse=True)


def measure_target(target: str, model: tuple[str, str, dict], runs: int, concurrency: int,
                   top: int, client: str = "normal", sort: str = "wait_ms") -> dict:
    name, model_dir, overrides = model
    port = servers.PORTS[target]
    proc = servers.STARTERS[target](name, model_dir, overrides)
    try:
        servers.wait_ready(f"http://127.0.0.1:{port}", name, proc)
        pids = _serving_pids(proc.pid)
        before, start = _schedstat(pids), time.monotonic()
        out = []
        for i in range(runs):
            r = load.run_load(port, name, model_dir, concurrency, max(64, 2 * concurrency),
                               "openai", client)
            row = {"target": target, "run": i, "t_s": round(time.monotonic() - start, 1),
                   "tok_s": round(r["output_throughput"]),
                   "ttft_p50": round(r["median_ttft_ms"]), "ttft_p90": round(r["p90_ttft_ms"]),
                   "tpot_p50": round(r["median_tpot_ms"], 2)}
            out.append(row)
            print(json.dumps(row), flush=True)
        wall = round(time.monotonic() - start, 1)
        # Serving processes the first reading did not list started since (or just before it,
        # as Serve's HAProxy reloads race it): counted from zero, marked as new.
        born = {pid: f"{label} (new)" for pid, label in _serving_pids(proc.pid).items()
                if pid not in pids}
        pids = {**pids, **born}
        threads = _threads(pids, before, _schedstat(pids), frozenset(born))
        return {"runs": out, "wall_s": wall, "processes": _per_process(threads),
                "threads": sorted(threads, key=lambda r: r[sort], reverse=True)[:top]}
    finally:
        servers.stop(proc)
        if target != "bare":
            subprocess.run([servers.venv_bin("ray"), "stop", "--force"], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["embedded", "tiny"])
    parser.add_argument("--targets", type=lambda s: s.split(","),
                        default=["gateway-colocated-haproxy", "bare"])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--hog", action="store_true")
    parser.add_argument("--client-priority", dest="client", choices=load.CLIENT_PRIORITIES,
                        default="realtime", help="scheduling of the load generator")
    parser.add_argument("--top", type=int, default=25, help="threads listed per server")
    parser.add_argument("--sort", choices=["wait", "run"], default="wait",
                        help="list the threads that waited longest, or those that ran longest")
    args = parser.parse_args()
    unknown = set(args.targets) - set(servers.STARTERS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}: {sorted(servers.STARTERS)}")
    (model,) = servers.models([args.model])
    client = load.client_priority(args.client)
    hog = servers.start_hog() if args.hog else None
    try:
        results = {t: measure_target(t, model, args.runs, args.concurrency, args.top, client,
                                     f"{args.sort}_ms")
                   for t in args.targets}
    finally:
        if hog:
            servers.stop(hog)
    servers.RESULTS.mkdir(exist_ok=True)
    (servers.RESULTS / "stall.json").write_text(json.dumps(results, indent=1))
    for target, res in results.items():
        print(f"\n{target}: {res['wall_s']} s; process: on-CPU ms, run-queue wait ms")
        for p in res["processes"]:
            print(f"{p['run_ms']:8d} {p['wait_ms']:8d}  {p['process']}")
        print(f"{target}: thread: run-queue wait ms, on-CPU ms, slices")
        for t in res["threads"]:
            print(f"{t['wait_ms']:8d} {t['run_ms']:8d} {t['slices']:7d}  "
                  f"{t['process'][:38]:38s} {t['thread']}")


if __name__ == "__main__":
    main()
