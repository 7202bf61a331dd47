"""Executing a committed notebook in the tests (nbclient, the kernel in this environment)."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def run_notebook(name: str) -> tuple[list, str]:
    """Execute ``notebooks/<name>`` in memory (the committed file is left as it is); its
    code cells' outputs, and their stream text. The kernel inherits this process's environment;
    a cell that raised fails the call."""
    path = NOTEBOOKS / name
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs, "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
