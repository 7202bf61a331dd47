"""notebooks/multi_protocol_tour.ipynb, executed against the session gateway (real vLLM behind
Ray Serve) with nbclient: every cell runs, each client gets its answer, and the timing cell
draws its plot. The committed copy keeps the outputs of a run against a `ray up` cluster."""

from __future__ import annotations

from tests.e2e.notebooks import run_notebook


def test_the_tour_notebook_runs_against_the_gateway(gateway_url, monkeypatch):
    monkeypatch.setenv("GATEWAY_URL", gateway_url)  # the kernel inherits this environment
    outputs, text = run_notebook("multi_protocol_tour.ipynb")
    for line in ("chat:", "streamed:", "LMQL ANSWER:", "text-generation:", "huggingface_hub:",
                 "LMI: 200", "MindIE SSE:"):
        assert line in text, line
    table = text[text.index("median tok/s"):].splitlines()[1:6]
    assert [row.split()[0] for row in table] == ["OpenAI", "TGI", "LMI", "MindIE", "LMTP"]
    assert all(float(row.split()[-1]) > 0 for row in table)
    assert any("image/png" in o.get("data", {}) for o in outputs)
