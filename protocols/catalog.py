"""The protocols this gateway can mount: name → the module whose ``SPEC`` describes it.

Modules are imported when an app is built with that protocol enabled (``GatewayConfig.protocols``);
their order here is the default mount order, and the first enabled protocol also renders errors
on paths no protocol owns.
"""

from __future__ import annotations

import importlib

from protocols.spec import ProtocolSpec

__all__ = ["PROTOCOLS", "load_spec"]

PROTOCOLS: dict[str, str] = {
    "openai": "protocols.openai.spec",
    "lmtp": "protocols.lmtp.spec",
    "mindie": "protocols.mindie.spec",
    "lmi": "protocols.lmi.spec",
    "tgi": "protocols.tgi.spec",
    "aici": "protocols.aici.spec",
    "anthropic": "protocols.anthropic.spec",
    "responses": "protocols.responses.spec",
}


def load_spec(name: str) -> ProtocolSpec:
    spec = importlib.import_module(PROTOCOLS[name]).SPEC
    assert isinstance(spec, ProtocolSpec) and spec.name == name, name
    return spec
