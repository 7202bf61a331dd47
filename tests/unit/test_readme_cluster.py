"""The README's cluster path ("On a Ray cluster") against what it names and where else its
commands are written: the files exist (``test_cluster_config.py`` validates them), the node's
checkout is where ``cluster.yaml`` puts it, ``cluster.yaml``'s header and docs/cluster.md say
the same commands, and the recorded ``ray up`` run ran them. The two-node e2e test runs the
deploy and status commands themselves (``tests/e2e/cluster_models.py``)."""

from __future__ import annotations

import shlex

import yaml

from tests.readme_cluster import NODE_CHECKOUT, ROOT, readme_cluster_commands

COMMANDS = readme_cluster_commands()
RECORDED = ROOT / "docs/results/ray-up-2026-11-24.log"


def test_the_commands_name_files_of_this_checkout():
    assert (ROOT / COMMANDS.cluster_file).is_file()
    assert (ROOT / COMMANDS.serve_config).is_file()
    for command in (COMMANDS.deploy, COMMANDS.status):
        bash, script, *_ = shlex.split(command)
        assert bash == "bash" and script.startswith(f"{NODE_CHECKOUT}/")
        assert (ROOT / script.removeprefix(f"{NODE_CHECKOUT}/")).is_file()


def test_the_node_checkout_is_where_the_cluster_file_mounts_it():
    mounts = yaml.safe_load((ROOT / COMMANDS.cluster_file).read_text())["file_mounts"]
    assert mounts[NODE_CHECKOUT] == "."


def test_the_cluster_file_and_the_cluster_doc_say_the_same_commands():
    header = (ROOT / COMMANDS.cluster_file).read_text().split("\ncluster_name:")[0]
    doc = (ROOT / "docs/cluster.md").read_text()
    for text in (header, doc):
        for line in (COMMANDS.up, COMMANDS.down):
            assert line in text
        for command in (COMMANDS.deploy, COMMANDS.status):
            assert f"ray exec {COMMANDS.cluster_file} '{command}'" in text


def _as_the_readme_writes_it(words: list[str]) -> str:
    """A recorded ``ray`` command with the recording's own choices undone: ``-y`` answered
    ``ray up``'s prompt, ``--no-config-cache`` and a copy of the cluster file with ``ssh_user``
    edited (as the README asks a user to edit it)."""
    kept = [w for w in words if w not in ("-y", "--no-config-cache")]
    return shlex.join([COMMANDS.cluster_file if w.endswith("/cluster.local.yaml") else w
                       for w in kept])


def test_the_recorded_ray_up_run_ran_these_commands():
    ran = {_as_the_readme_writes_it(shlex.split(line[2:]))
           for line in RECORDED.read_text().splitlines() if line.startswith("+ ray ")}
    on_head = {shlex.join(["ray", "exec", COMMANDS.cluster_file, command])
               for command in (COMMANDS.deploy, COMMANDS.status)}
    assert {COMMANDS.up, COMMANDS.down, *on_head} <= ran, ran
