"""One running server, one setting of vLLM's scheduler process changed between loads: what the
setting does, without the box's drift between server starts.

bench/compare.py starts every server afresh each round, and rounds of the same server have read
up to a third apart on these boxes (docs/results/benchmarks-2026-12-07.md, "Telling the box's drift from the
server's"). Here one server stays up, and the CPUs or the niceness of its ``VLLM::EngineCore``
(the scheduler: it feeds the worker each step and takes its outputs) change between loads in
ABBA order, so that a drift linear in time cancels. The worker and every other process stay as
the server placed them. Settings:

- ``cpus=serving``: the CPUs no vLLM worker is pinned to (where engines/kit/placement.py puts the
  gateway's scheduler);
- ``cpus=worker``: the worker's own CPUs;
- ``cpus=all``: every CPU (bare vLLM leaves its scheduler so);
- ``nice=N``: the scheduler's niceness (a negative one needs root);
- ``second=present|absent`` (``--target gateway-two-apps`` only): the idle second model's
  application deployed or deleted between loads (``servers.set_second_app``), the measured
  model's replica and engine and the gateway's ingress running on: what serving a second model
  costs the one in use, read without the drift between server starts that ``compare.py``'s
  ``gateway`` against ``gateway-two-apps`` carries.

Each load records the rate and latencies, CPU per token by process, the scheduler's and the
worker's CPU and run-queue wait per token (``cputime.schedstat``), and the load generator's own
CPU per token, its start included (it shares the box). Results: ``bench/results/alternate.json``
and ``alternate.md``; docs/results/benchmarks-2026-12-07.md, "vLLM's busy wait". A setting slow to change
(``second``: a deploy takes minutes) can run ``--visit K`` loads in a row; each load then pairs
with its like in the next visit ("The two-model bar over two more runs")::

    python bench/alternate.py --target gateway --settings cpus=serving,cpus=worker --passes 3
    python bench/alternate.py --target gateway-two-apps --settings second=present,second=absent \
        --passes 8 --visit 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cputime
from bench.load import CLIENT_PRIORITIES, client_priority, run_load
from bench.pooled import pool
from bench.servers import (
    PORTS,
    RESULTS,
    SECOND_APP,
    STARTERS,
    machine,
    models,
    set_second_app,
    stop_tree,
    wait_ready,
)

CPU_CHOICES = ("serving", "worker", "all")
SCHEDULER, WORKER = cputime.ENGINE_TITLES


class Setting(msgspec.Struct, frozen=True):
    """One value of the alternated setting: ``cpus`` (one of CPU_CHOICES), ``nice`` or
    ``second`` (present or absent)."""

    knob: str
    value: str

    @property
    def name(self) -> str:
        return f"{self.knob}={self.value}"


class Engine(msgspec.Struct, frozen=True):
    """A running server's vLLM processes, and its scheduler as the server placed it."""

    scheduler: int  # the pid of VLLM::EngineCore
    titles: dict[int, str]  # every engine process: pid -> VLLM title
    worker_cpus: frozenset[int]
    placed_cpus: frozenset[int]
    placed_nice: int


def parse_setting(text: str) -> Setting:
    knob, _, value = text.partition("=")
    if knob == "cpus" and value in CPU_CHOICES:
        return Setting(knob, value)
    if knob == "nice" and value.lstrip("-").isdigit() and -20 <= int(value) <= 19:
        return Setting(knob, str(int(value)))
    if knob == "second" and value in ("present", "absent"):
        return Setting(knob, value)
    raise ValueError(f"{text!r}: expected cpus=serving|worker|all, nice=N (-20 to 19) or "
                     "second=present|absent")


def abba(settings: list[Setting], passes: int, visit: int = 1) -> list[Setting]:
    """The loads' order: every setting once per pass, forward then backward (A B, B A, A B),
    each ``visit`` loads in a row (a setting that takes long to change, ``second``, then
    changes once per ``visit`` loads instead of every other load)."""
    order: list[Setting] = []
    for i in range(passes):
        for setting in settings if i % 2 == 0 else settings[::-1]:
            order += [setting] * visit
    return order


def refuse_unprivileged_niceness(settings: list[Setting]) -> None:
    """Before any server starts: a negative niceness needs root (or CAP_SYS_NICE), which a
    run would otherwise find out only at its first load of that setting."""
    wanted = [s.name for s in settings if s.knob == "nice" and int(s.value) < 0]
    if wanted and os.geteuid() != 0:
        raise SystemExit(f"{', '.join(wanted)}: a negative niceness needs root; run as root "
                         "or choose nice=0 and above")


def refuse_second_without_two_apps(settings: list[Setting], target: str) -> None:
    """Before any server starts: only ``gateway-two-apps`` has a second model to take away."""
    if target != "gateway-two-apps" and any(s.knob == "second" for s in settings):
        raise SystemExit("second=present|absent needs --target gateway-two-apps")


def find_engine(root_pid: int) -> Engine:
    """The measured model's engine (a second model's reads apart: ``cputime.labels``)."""
    titles = {pid: role for pid, role in cputime.labels(root_pid, apart=(SECOND_APP,)).items()
              if role in cputime.ENGINE_TITLES}
    schedulers = [pid for pid, role in titles.items() if role == SCHEDULER]
    workers = [pid for pid, role in titles.items() if role == WORKER]
    if len(schedulers) != 1 or not workers:
        raise SystemExit(f"expected one vLLM scheduler and its workers under pid {root_pid} "
                         f"(one model), found {titles}")
    scheduler = schedulers[0]
    worker_cpus = frozenset().union(*(os.sched_getaffinity(pid) for pid in workers))
    return Engine(scheduler, titles, worker_cpus, frozenset(os.sched_getaffinity(scheduler)),
                  os.getpriority(os.PRIO_PROCESS, scheduler))


def scheduler_cpus(setting: Setting, engine: Engine, every: set[int]) -> set[int]:
    """Where ``setting`` runs the scheduler; a niceness setting leaves it where it was placed."""
    if setting.knob != "cpus":
        return set(engine.placed_cpus)
    return {"serving": (every - engine.worker_cpus) or every,
            "worker": set(engine.worker_cpus), "all": every}[setting.value]


def apply(setting: Setting, engine: Engine) -> None:
    """Every thread of the scheduler onto ``setting``'s CPUs and niceness."""
    cpus = scheduler_cpus(setting, engine, set(os.sched_getaffinity(0)))
    nice = int(setting.value) if setting.knob == "nice" else engine.placed_nice
    for tid in os.listdir(f"/proc/{engine.scheduler}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except ProcessLookupError:  # a thread that just ended
            continue


def per_token(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]],
              titles: dict[int, str], tokens: int) -> dict[str, dict[str, float]]:
    """Milliseconds on a CPU and waiting for one per output token, by engine process title."""
    out: dict[str, dict[str, float]] = {}
    for pid, (cpu, wait) in after.items():
        cpu0, wait0 = before.get(pid, (0.0, 0.0))
        got = out.setdefault(titles[pid], {"cpu": 0.0, "wait": 0.0})
        got["cpu"] += 1000 * (cpu - cpu0) / tokens
        got["wait"] += 1000 * (wait - wait0) / tokens
    return {t: {k: round(v, 4) for k, v in got.items()} for t, got in out.items()}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load(args, setting: Setting, engine: Engine, server: subprocess.Popen, port: int,
          model: str, model_dir: str) -> dict:
    apply(setting, engine)
    if setting.knob == "second":
        set_second_app(server, present=setting.value == "present")
    root_pid = server.pid
    pids = list(engine.titles)
    sched, tree, client = cputime.schedstat(pids), cputime.snapshot(root_pid), _children_cpu_s()
    box, started = cputime.box(), time.monotonic()
    result = run_load(port, model, model_dir, args.concurrency, args.num_prompts, "openai",
                      args.client)
    client = _children_cpu_s() - client
    sched_after, tree_after = cputime.schedstat(pids), cputime.snapshot(root_pid)
    tokens = result["total_output_tokens"]
    roles = cputime.spent_by_role(tree, tree_after, cputime.labels(root_pid, apart=(SECOND_APP,)))
    return {"setting": setting.name, "concurrency": args.concurrency, "prompts": args.num_prompts,
            **cputime.box_spent(box, cputime.box(), sum(roles.values()),
                                time.monotonic() - started),
            **{k: result[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms",
                                      "total_output_tokens", "failed") if k in result},
            "ms_per_token": {role: round(1000 * s / tokens, 4) for role, s in roles.items()},
            "engine_sched_ms_per_token": per_token(sched, sched_after, engine.titles, tokens),
            "client_ms_per_token": round(1000 * client / tokens, 4),
            "engine_cpus": _engine_cpus(engine)}


def _engine_cpus(engine: Engine) -> dict[str, list[int]]:
    """Where the measured engine's processes run now, by title: a setting that restarts other
    processes (``second``) must leave them where the server placed them."""
    out: dict[str, set[int]] = {}
    for pid, title in engine.titles.items():
        try:
            out.setdefault(title, set()).update(os.sched_getaffinity(pid))
        except OSError:  # gone
            continue
    return {title: sorted(cpus) for title, cpus in out.items()}


def measure(args) -> list[dict]:
    model, model_dir, overrides = models([args.model])[0]
    port = PORTS[args.target]
    proc = STARTERS[args.target](model, model_dir, overrides)
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{port}", model, proc)
        engine = find_engine(proc.pid)
        run_load(port, model, model_dir, args.concurrency, 2 * args.concurrency, "openai",
                 args.client)  # the first load after a start is slower; not recorded
        for setting in abba(args.settings, args.passes, args.visit):
            rows.append(_load(args, setting, engine, proc, port, model, model_dir))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_tree(proc, args.target)
    return rows


def _mean(rows: list[dict], pick) -> float:
    return statistics.fmean(pick(r) for r in rows)


def _setting_line(name: str, got: list[dict], first: float) -> str:
    """One setting's loads in the summary's columns."""
    rate = _mean(got, lambda r: r["output_throughput"])
    rates = ", ".join(f"{r['output_throughput']:.1f}" for r in got)
    sched_cpu = _mean(got, lambda r: r["engine_sched_ms_per_token"][SCHEDULER]["cpu"])
    sched_wait = _mean(got, lambda r: r["engine_sched_ms_per_token"][SCHEDULER]["wait"])
    worker = _mean(got, lambda r: r["engine_sched_ms_per_token"][WORKER]["cpu"])
    outside = _mean(got, lambda r: sum(v for k, v in r["ms_per_token"].items()
                                       if k not in cputime.ENGINE_TITLES))
    client = _mean(got, lambda r: r["client_ms_per_token"])
    return (f"| {name} | {rates} | {rate:.1f} | {rate / first:.3f}x | {sched_cpu:.3f} / "
            f"{sched_wait:.3f} | {worker:.3f} | {outside:.3f} | {client:.3f} |")


class Paired(msgspec.Struct, frozen=True):
    """Two settings' loads read as neighbouring pairs: ``second`` against ``first``."""

    first: str
    second: str
    mean: float  # of each pair's second-setting rate over its first-setting rate
    error: float  # the mean's standard error
    pairs: int


def paired(rows: list[dict], visit: int = 1) -> Paired | None:
    """Two settings' loads in ABBA order as neighbouring pairs: with one load a visit loads 1-2,
    3-4, ...; with ``visit`` loads a visit, the i-th load of each visit with the i-th of the
    next (visits 1-2, 3-4, ...). A drift of the box between pairs cancels within each pair;
    None for other than two settings or under two pairs."""
    names = list(dict.fromkeys(r["setting"] for r in rows))
    if len(names) != 2:
        return None
    ratios = []
    visits = [rows[i:i + visit] for i in range(0, len(rows), visit)]
    for one, other in zip(visits[::2], visits[1::2], strict=False):  # an odd last has no pair
        for a, b in zip(one, other, strict=False):
            by = {a["setting"]: a["output_throughput"], b["setting"]: b["output_throughput"]}
            if len(by) == 2:
                ratios.append(by[names[1]] / by[names[0]])
    if len(ratios) < 2:
        return None
    pooled = pool(ratios)
    return Paired(first=names[0], second=names[1], mean=pooled.mean, error=pooled.error,
                  pairs=len(ratios))


def summarize(rows: list[dict], args) -> str:
    first = _mean([r for r in rows if r["setting"] == rows[0]["setting"]],
                  lambda r: r["output_throughput"])
    lines = [f"{args.target}, {args.model} model, c={args.concurrency}, {args.num_prompts} prompts"
             f" a load, settings in ABBA order ({args.visit} loads a visit), load generator at "
             f"{args.client} priority.", "",
             "| setting | output tok/s (loads) | mean | vs first | scheduler CPU / wait ms a token"
             " | worker CPU ms a token | outside the engine ms a token | load generator ms a token |",
             "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["setting"] for r in rows):
        lines.append(_setting_line(name, [r for r in rows if r["setting"] == name], first))
    pairs = paired(rows, args.visit)
    if pairs is not None:
        lines += ["", f"Paired loads ({pairs.pairs} pairs of neighbours): {pairs.second} vs "
                  f"{pairs.first} {pairs.mean:.3f}x, standard error {pairs.error:.3f}."]
    lines += ["", f"Failed requests: {sum(r.get('failed', 0) for r in rows)}. "
              f"Machine: {machine()}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="gateway", choices=sorted(STARTERS))
    parser.add_argument("--model", default="tiny", choices=["tiny", "embedded"])
    parser.add_argument("--settings", default=[parse_setting("cpus=serving"),
                                               parse_setting("cpus=worker")],
                        type=lambda s: [parse_setting(x) for x in s.split(",") if x])
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--visit", type=int, default=1,
                        help="loads in a row of each setting (1: A B B A; 2: A A B B B B A A)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--client-priority", dest="client", choices=CLIENT_PRIORITIES,
                        default="realtime")
    args = parser.parse_args()
    if args.visit < 1:
        parser.error("--visit: at least one load a visit")
    refuse_unprivileged_niceness(args.settings)
    refuse_second_without_two_apps(args.settings, args.target)
    args.client = client_priority(args.client)
    RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = measure(args)
    (RESULTS / "alternate.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows, args)
    (RESULTS / "alternate.md").write_text(summary + "\n")
    print(f"\n{summary}\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
