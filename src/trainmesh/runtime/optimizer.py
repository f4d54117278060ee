"""The optimizer `Runtime.setup` returns: the user's optimizer, whose `step()` is the precision's step. A thin
subclass wrapper with no state of its own, so `isinstance` checks, LR schedulers and DCP accept it.

Details: docs/internals.md#runtimeoptimizerpy
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, SupportsIndex, cast

from torch.optim import Optimizer

from trainmesh.precision import Precision

_INNER, _PRECISION, _SKIPPED = "_trainmesh_optimizer", "_trainmesh_precision", "_trainmesh_skipped"


class RuntimeOptimizer(Optimizer):
    """Mixed in before the wrapped optimizer's class by `guard_optimizer`; build it only through that."""

    def __init__(self, optimizer: Optimizer, precision: Precision) -> None:
        # Not Optimizer.__init__: the state is `optimizer`'s, reached through __getattr__.
        self.__dict__.update({_INNER: optimizer, _PRECISION: precision, _SKIPPED: False})

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped because its (16-mixed) gradients overflowed, on every rank alike."""
        return bool(self.__dict__[_SKIPPED])

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """`rt.step(optimizer)`: unscale (unless `rt.clip_grad_norm` did), skip an overflowing step, update the
        loss scale. Returns the closure's (first) loss, or None, as torch's optimizers do; `step_was_skipped` (or
        `rt.step`'s bool) tells whether it was skipped. A closure goes to the optimizer, which may call it several
        times (LBFGS); 16-mixed refuses one (GradScaler's step takes none): call it before the step there."""
        losses: list[float] = []

        def recorded() -> float:
            assert closure is not None
            losses.append(closure())
            return losses[-1]

        self.__dict__[_SKIPPED] = not _precision(self).step(_inner(self), recorded if closure is not None else None)
        return losses[0] if losses else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        _inner(self).zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _inner(self).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Optimizer.load_state_dict replaces the state in `self.__dict__`: it must be the wrapped optimizer's.
        _inner(self).load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _inner(self).add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        """Whatever this class does not define is the wrapped optimizer's (param_groups, state, defaults)."""
        try:
            inner = self.__dict__[_INNER]
        except KeyError:  # not built yet (copy's or pickle's __new__)
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A method patched onto this object stays here (an LR scheduler counting calls of `step`, DCP's patched
        # `state_dict`); data goes to the wrapped optimizer, which its own methods read (what GradScaler sets too).
        if callable(getattr(type(self), name, None)):
            object.__setattr__(self, name, value)
        else:
            setattr(_inner(self), name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__:
            object.__delattr__(self, name)
        else:
            delattr(_inner(self), name)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """A copy (deepcopy, pickle) is of the wrapped optimizer alone: the Runtime does not travel with it.
        `rt.setup_optimizer(copy)` guards it again."""
        del protocol
        return (_as_it_is, (_inner(self),))

    def __copy__(self) -> Optimizer:
        return copy.copy(_inner(self))

    def __repr__(self) -> str:
        return repr(_inner(self))


def guard_optimizer(optimizer: Optimizer, precision: Precision) -> Optimizer:
    """`optimizer` behind a RuntimeOptimizer stepping through `precision`. One set up for this precision
    already is returned as it is (no second unscale or step); one set up by another Runtime is unwrapped and
    guarded afresh."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"the optimizer given to rt.setup (or rt.setup_optimizer) is a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer. Fix: pass one built from the model's parameters, e.g. "
            "torch.optim.AdamW(model.parameters())."
        )
    if isinstance(optimizer, RuntimeOptimizer):
        if _precision(optimizer) is precision:
            return optimizer
        optimizer = _inner(optimizer)
    return _guarded_class(type(optimizer))(optimizer, precision)


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer inside a RuntimeOptimizer; any other optimizer as it is."""
    return _inner(optimizer) if isinstance(optimizer, RuntimeOptimizer) else optimizer


# Read from the instance's own __dict__: no property name that could hide an attribute of the user's optimizer.
def _inner(optimizer: RuntimeOptimizer) -> Optimizer:
    return cast(Optimizer, optimizer.__dict__[_INNER])


def _precision(optimizer: RuntimeOptimizer) -> Precision:
    return cast(Precision, optimizer.__dict__[_PRECISION])


def _as_it_is(optimizer: Optimizer) -> Optimizer:
    """What a pickled RuntimeOptimizer loads as: the optimizer it wrapped (a copy of it, by then)."""
    return optimizer


def _guarded_class(base: type[Optimizer]) -> type[RuntimeOptimizer]:
    """A subclass of `base` with RuntimeOptimizer's methods first, named as `base` (its repr, its errors); one
    per class, so that two optimizers of a class set up are of one class again."""
    if base not in _CLASSES:
        namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__}
        _CLASSES[base] = cast(type[RuntimeOptimizer], type(base.__name__, (RuntimeOptimizer, base), namespace))
    return _CLASSES[base]


_CLASSES: dict[type[Optimizer], type[RuntimeOptimizer]] = {}
