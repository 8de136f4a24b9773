"""Errors raised by the copy kernels' Python API.

Every argument problem is a ``KernelArgumentError`` (a ``ValueError``), with a
subclass saying what kind of problem it is, so callers can catch one type and
tests can assert the precise one. A missing GPU toolchain is a separate
``KernelUnavailableError`` (a ``RuntimeError``): nothing is wrong with the call.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgumentError


class KernelArgumentError(InvalidArgumentError):
    """An argument to ``kernels.gather``/``kernels.scatter`` is invalid."""


class ShapeError(KernelArgumentError):
    """A tensor's shape or rank does not fit the layout or the other tensors."""


class DTypeError(KernelArgumentError):
    """A tensor's dtype is unsupported or differs from the others."""


class DeviceError(KernelArgumentError):
    """Tensors sit on devices that cannot be combined, or memory is not reachable."""


class StrideError(KernelArgumentError):
    """A tensor's memory layout cannot be described to the kernel."""


class LayoutError(KernelArgumentError):
    """An engine's cache layout is not one the kernels know (a vLLM backend or version whose
    layout was not read from its source): refused, never guessed."""


class BlockIdError(KernelArgumentError):
    """A page or slot id is out of range, or ids collide on the written side."""


class KernelUnavailableError(RuntimeError):
    """The CUDA path was needed but cupy/NVRTC or a GPU is not available."""
