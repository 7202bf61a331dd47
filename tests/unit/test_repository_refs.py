"""The repository stands alone: no file points at the spec folder beside the checkout that only
the project's developers have (its facts live in ``docs/protocols/``, in this project's words)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces, so this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "shared/" + "specs", "shared/" + "seeds"]))


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert len(files) > 100  # the listing worked
    found = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix in {".safetensors", ".png"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1)
                  if OUTSIDE.search(line)]
    assert not found, found


def test_the_protocol_notes_are_there():
    notes = {p.name for p in (ROOT / "docs" / "protocols").glob("*.md")}
    assert {"aici.md", "controller-runtime.md", "lmi-and-tgi.md", "mindie.md", "openai.md",
            "lmtp.md", "pipeline.md"} <= notes
