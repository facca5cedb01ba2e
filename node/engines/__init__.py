"""Generation engines: the contract in :mod:`.base`, a PyTorch engine, and (later) a vLLM engine.

Engines are imported on demand by :func:`create_engine`, so importing this package costs neither
transformers nor vLLM.
"""

from __future__ import annotations

import importlib

from veriroll.node.engines.base import Engine, EngineUnavailable, GenerationRequest, SampleResult

__all__ = ["ENGINES", "Engine", "EngineUnavailable", "GenerationRequest", "SampleResult", "create_engine"]

# kind -> (module, class). A module that does not exist yet makes its kind "not available".
ENGINES: dict[str, tuple[str, str]] = {
    "torch": ("veriroll.node.engines.torch", "TorchEngine"),
    "vllm": ("veriroll.node.engines.vllm", "VLLMEngine"),
}

_INSTALL_HINT = {"vllm": "install it with `pip install 'veriroll[vllm]'` on a machine with a CUDA GPU"}


def create_engine(kind: str, **kwargs) -> Engine:
    """Build the engine called ``kind`` (``'torch'`` or ``'vllm'``) with its constructor's ``kwargs``.

    Raises :class:`EngineUnavailable` when that engine cannot run here, saying why.
    """
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; choose one of {sorted(ENGINES)}")
    module_name, class_name = ENGINES[kind]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise EngineUnavailable(
                f"the {kind!r} engine is not available in this version of veriroll"
            ) from exc
        hint = _INSTALL_HINT.get(kind, f"install the missing package {exc.name!r}")
        raise EngineUnavailable(f"the {kind!r} engine needs {exc.name!r}: {hint}") from exc
    engine_cls = getattr(module, class_name, None)
    if engine_cls is None:
        raise EngineUnavailable(f"the {kind!r} engine is not available: {module_name} has no {class_name}")
    return engine_cls(**kwargs)
