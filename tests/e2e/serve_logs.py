"""Serve replicas' log files in the test session's Ray logs directory."""

from __future__ import annotations

import glob
import os
from pathlib import Path


def replica_logs(app: str, deployment: str = "") -> dict[str, str]:
    """Replica id → the text of its log file, for the replicas of ``app`` (every
    application's when empty; of deployments whose names start with ``deployment``) that have
    one, dead ones included."""
    import ray

    directory = ray._private.worker.global_worker.node.get_logs_dir_path()
    name = f"replica_{app}_{deployment}*.log" if app else "replica_*.log"
    pattern = os.path.join(directory, "serve", name)
    return {path.removesuffix(".log").rsplit("_", 1)[1]: Path(path).read_text(errors="replace")
            for path in glob.glob(pattern)}
