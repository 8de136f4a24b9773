"""SGLang tests: they run in `.venv-sglang` (scripts/setup_sglang.sh) and skip where SGLang is
absent.

torchvision: SGLang's host memory pools import `sglang.srt.mem_cache.memory_pool`, which imports
SGLang's whole model-config registry, and two vision-language configs there import torchvision
at module load (they use it only to preprocess images). PyPI's torchvision is a CUDA build that
cannot load against the CPU torch of this venv, so where torchvision is not installed these
tests put a stand-in module in its place: importing it works, using anything in it raises. No
code these tests run touches it. transformers is asked first whether torchvision is available,
so it keeps answering no (it caches the answer) and never reaches for the stand-in.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

_STAND_IN = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")


class _Unavailable:
    """Any name looked up in the torchvision stand-in: calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not installed in this venv "
                           "(tests/sglang/conftest.py)")


def _install_torchvision_stand_in() -> None:
    import transformers.utils.import_utils as hf_imports

    hf_imports.is_torchvision_available()  # cached now, before the stand-in exists: False
    for name in _STAND_IN:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []

        def lookup(attr: str, prefix: str = name) -> _Unavailable:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Unavailable(f"{prefix}.{attr}")

        module.__getattr__ = lookup  # type: ignore[method-assign]
        sys.modules[name] = module
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]  # type: ignore[attr-defined]
    sys.modules["torchvision.transforms"].functional = (  # type: ignore[attr-defined]
        sys.modules["torchvision.transforms.functional"])


if importlib.util.find_spec("sglang") and not importlib.util.find_spec("torchvision"):
    _install_torchvision_stand_in()
