"""notebooks/multi_protocol_tour.ipynb, executed against the session gateway (real vLLM behind
Ray Serve) with nbclient: every cell runs, each client gets its answer, and the timing cell
draws its plot. The committed copy keeps the outputs of a run against a `ray up` cluster."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "multi_protocol_tour.ipynb"


def test_the_tour_notebook_runs_against_the_gateway(gateway_url, monkeypatch):
    monkeypatch.setenv("GATEWAY_URL", gateway_url)  # the kernel inherits this environment
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    for line in ("chat:", "streamed:", "LMQL ANSWER:", "text-generation:", "huggingface_hub:",
                 "LMI: 200", "MindIE SSE:"):
        assert line in text, line
    table = text[text.index("median tok/s"):].splitlines()[1:6]
    assert [row.split()[0] for row in table] == ["OpenAI", "TGI", "LMI", "MindIE", "LMTP"]
    assert all(float(row.split()[-1]) > 0 for row in table)
    assert any("image/png" in o.get("data", {}) for o in outputs)
