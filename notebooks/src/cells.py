"""One notebook from a list of ``(kind, source)`` cells, unexecuted (the builders' one writer)."""

from pathlib import Path

import nbformat


def write_notebook(cells: list[tuple[str, str]], name: str) -> Path:
    """Write ``notebooks/<name>`` from ``cells`` and return its path."""
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    for kind, source in cells:
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        notebook.cells.append(make(source))
    out = Path(__file__).resolve().parent.parent / name
    nbformat.write(notebook, out)
    return out
