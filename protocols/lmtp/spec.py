"""LMTP (LMQL's websocket protocol) as the gateway mounts it. It owns no HTTP paths: errors on
its connections are LMTP messages, and plain HTTP on ``/`` belongs to TGI."""

from protocols.lmtp.routes import router
from protocols.lmtp.session import LMTPLimits
from protocols.spec import ProtocolSpec

SPEC = ProtocolSpec(name="lmtp", routers=(router,), listing="ws:///  or  ws:///lmtp",
                    options=LMTPLimits)
