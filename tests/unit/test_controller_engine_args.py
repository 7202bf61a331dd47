"""What a model with controllers may not combine with, refused before anything starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.kit.config import Controllers
from engines.vllm.engine import VLLMEngine


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"async_scheduling": True}, "async_scheduling off"),
    ({"tensor_parallel_size": 2}, "one vLLM worker"),
])
def test_controllers_refuse_engine_args_their_hook_cannot_serve(kwargs, needle):
    # async scheduling: a step's last token is a placeholder until after the forward pass,
    # where the hook has sent the step's command already
    engine = SimpleNamespace(config=SimpleNamespace(name="m"))
    with pytest.raises(ValueError, match=needle):
        VLLMEngine._start_controllers(engine, Controllers(), dict(kwargs))
