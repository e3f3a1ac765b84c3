"""Kernel registry: for each op, implementations in preference order, chosen by JAX backend and device
kind, with an explicit override (argument or environment), falling through on NotImplementedError
(the tokamax pattern: an implementation may refuse a shape or dtype at trace time).

    choose("grouped_matmul")                             -> first available for this machine (its name)
    choose("grouped_matmul", impl="pallas_triton")       -> that one (on CPU: interpreted)
    choose("grouped_matmul", (args, kwargs), ...)        -> the first that accepts each of these calls
    call("grouped_matmul", lhs, rhs, sizes, impl=None)   -> run the first that accepts this call
    C2JAX_KERNEL_IMPL="grouped_matmul=xla,permute_quantize=pallas_triton"   same, from the environment

An implementation lists the platforms it runs on natively and, optionally, substrings of
`jax.Device.device_kind` it needs ("H100", "H200" for Hopper-only kernels). Implementations marked
`interpretable` also run on CPU with `interpret=True`; they are used there only when named explicitly
(the interpreter is for checking equivalence, not speed), as are implementations with `auto=False`
(oracles, optional backends). Nothing here imports a GPU-only module.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax

ENV_OVERRIDE = "C2JAX_KERNEL_IMPL"
# (platform, device_kind) to choose implementations for instead of this process's device: set by `target()` while
# lowering for another platform (experiments/bench/gpu_check --lower-only lowers for CUDA on a CPU machine)
_TARGET: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("c2jax_kernel_target", default=None)


@contextlib.contextmanager
def target(platform: str, device_kind: str = ""):
    """Choose implementations as on (platform, device_kind), e.g. ("gpu", "NVIDIA H100 80GB HBM3"), while tracing
    a program to lower for that platform: native implementations run without their interpreter."""
    token = _TARGET.set((platform, device_kind))
    try:
        yield
    finally:
        _TARGET.reset(token)


@dataclass(frozen=True)
class Implementation:
    name: str
    fn: Callable
    platforms: tuple[str, ...]  # jax.default_backend() values it runs on natively
    device_kinds: tuple[str, ...] = ()  # substrings of device_kind it needs; empty: any device
    interpretable: bool = False  # accepts interpret=True and then runs anywhere
    auto: bool = True  # False: used only when named explicitly (oracles, optional backends)
    description: str = ""

    def native(self, platform: str, device_kind: str) -> bool:
        kind_ok = not self.device_kinds or any(k.lower() in device_kind.lower() for k in self.device_kinds)
        return platform in self.platforms and kind_ok


_REGISTRY: dict[str, list[Implementation]] = {}


def register(op: str, impl: Implementation) -> None:
    impls = _REGISTRY.setdefault(op, [])
    if any(existing.name == impl.name for existing in impls):
        raise ValueError(f"{op}: implementation {impl.name!r} is already registered")
    impls.append(impl)


def implementations(op: str) -> list[Implementation]:
    try:
        return list(_REGISTRY[op])
    except KeyError:
        raise ValueError(f"unknown kernel op {op!r}; registered: {sorted(_REGISTRY)}") from None


def env_override(op: str) -> str | None:
    """The implementation $C2JAX_KERNEL_IMPL names for `op` ("op=impl,op2=impl2"), or None."""
    for item in filter(None, os.environ.get(ENV_OVERRIDE, "").split(",")):
        name, _, value = item.partition("=")
        if name.strip() == op:
            return value.strip()
    return None


def current_device() -> tuple[str, str]:
    """(platform, device_kind) implementations are chosen for: `target()`'s, else this process's first device."""
    chosen = _TARGET.get()
    if chosen is not None:
        return chosen
    device = jax.devices()[0]
    return jax.default_backend(), getattr(device, "device_kind", "")


def candidates(op: str, impl: str | None = None, platform: str | None = None,
               device_kind: str | None = None) -> list[tuple[Implementation, bool]]:
    """(implementation, interpret) pairs to try in order: just the override if one is given, else every
    implementation native to (platform, device_kind)."""
    if platform is None or device_kind is None:
        here = current_device()
        platform, device_kind = platform or here[0], device_kind if device_kind is not None else here[1]
    impls = implementations(op)
    impl = impl or env_override(op)
    if impl is not None:
        chosen = [i for i in impls if i.name == impl]
        if not chosen:
            raise ValueError(f"{op}: unknown implementation {impl!r}; registered: {[i.name for i in impls]}")
        chosen = chosen[0]
        if chosen.native(platform, device_kind):
            return [(chosen, False)]
        if chosen.interpretable:
            return [(chosen, True)]
        raise ValueError(f"{op}: implementation {impl!r} needs platform {chosen.platforms} "
                         f"{chosen.device_kinds or ''}, this is {platform} {device_kind!r} and it has no interpreter")
    native = [(i, False) for i in impls if i.auto and i.native(platform, device_kind)]
    if not native:
        raise ValueError(f"{op}: no implementation runs on {platform} {device_kind!r}")
    return native


def choose(op: str, *calls: tuple[tuple, dict], impl: str | None = None) -> str:
    """The name of the implementation `call(op, *args, impl=impl, **kwargs)` runs for every `(args, kwargs)` of
    `calls`: the first candidate that refuses none of them (NotImplementedError while tracing each abstractly with
    `jax.eval_shape`, so the arguments may be `jax.ShapeDtypeStruct`s). Without calls: the first candidate. Raises
    NotImplementedError, listing the refusals, when every candidate refuses some call."""
    refusals = []
    for implementation, interpret in candidates(op, impl):
        extra = {"interpret": True} if interpret else {}
        try:
            for args, kwargs in calls:
                jax.eval_shape(partial(implementation.fn, **kwargs, **extra), *args)
        except NotImplementedError as e:
            refusals.append(f"{implementation.name}: {e}")
            continue
        return implementation.name
    raise NotImplementedError(f"{op}: every implementation refused: {refusals}")


def call(op: str, *args, impl: str | None = None, **kwargs):
    """Run `op` with the first candidate that does not raise NotImplementedError."""
    refusals = []
    for implementation, interpret in candidates(op, impl):
        extra = {"interpret": True} if interpret else {}
        try:
            return implementation.fn(*args, **kwargs, **extra)
        except NotImplementedError as e:
            refusals.append(f"{implementation.name}: {e}")
    raise NotImplementedError(f"{op}: every implementation refused: {refusals}")
