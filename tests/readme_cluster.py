"""The README's cluster commands (its section "On a Ray cluster"), read from the README itself,
so that the tests that run them (``tests/e2e/cluster_models.py``) and the checks of the files
they name (``tests/unit/test_readme_cluster.py``) cannot drift from what a reader types."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## On a Ray cluster"
NODE_CHECKOUT = "~/llm-gateway"  # where cluster.yaml's file_mounts put the checkout on a node


class ClusterCommands(msgspec.Struct, frozen=True, kw_only=True):
    """One line each, as the README writes it (comments dropped); ``deploy`` and ``status`` are
    what ``ray exec`` runs on the head node."""

    up: str
    deploy: str
    status: str
    check: str
    down: str
    cluster_file: str  # what ray up / exec / down name
    serve_config: str  # what deploy names


def _block(readme: str) -> list[str]:
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under {SECTION!r}"
    return [line.split("  #", 1)[0].strip() for line in block.group(1).splitlines()
            if line.strip()]


def _one(lines: list[str], pattern: str) -> str:
    found = [line for line in lines if re.match(pattern, line)]
    assert len(found) == 1, (pattern, lines)
    return found[0]


def readme_cluster_commands(readme: Path = ROOT / "README.md") -> ClusterCommands:
    lines = _block(readme.read_text())
    on_head: dict[str, str] = {}  # 'bash <script> VERB ...' by its VERB
    for line in lines:
        if line.startswith("ray exec "):
            inner = shlex.split(line)[3]
            on_head[shlex.split(inner)[2]] = inner
    files = {shlex.split(line)[2] for line in lines if re.match(r"ray (up|down|exec) ", line)}
    assert len(files) == 1, files  # every ray command names the same cluster file
    assert {"deploy", "status"} <= on_head.keys(), on_head
    return ClusterCommands(up=_one(lines, r"ray up "), down=_one(lines, r"ray down "),
                           check=_one(lines, r"curl "), deploy=on_head["deploy"],
                           status=on_head["status"], cluster_file=files.pop(),
                           serve_config=shlex.split(on_head["deploy"])[-1])


def on_this_machine(command: str, serve_config: Path | None = None) -> list[str]:
    """A command the README runs on the head node, as this checkout runs it: the node's
    checkout is this one, and ``serve_config`` (if given) replaces the README's config."""
    commands = readme_cluster_commands()
    words = [word.replace(NODE_CHECKOUT, str(ROOT)) for word in shlex.split(command)]
    if serve_config is not None:
        words = [str(serve_config) if w == commands.serve_config else w for w in words]
    return words
