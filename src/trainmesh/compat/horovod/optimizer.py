"""hvd.DistributedOptimizer: an optimizer that all-reduces the gradients during backward, as Horovod's: one asynchronous
all-reduce per parameter, started in the same fixed order on every rank.

Details: docs/internals.md#compathorovodoptimizerpy
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from trainmesh.compat.horovod.agreement import Call
from trainmesh.compat.horovod.basics import ReduceOp, size
from trainmesh.compat.horovod.compression import Compression, Compressor
from trainmesh.compat.horovod.exchange import sparse_allreduce_async
from trainmesh.compat.horovod.ops import resolve_op
from trainmesh.compat.horovod.process_sets import ProcessSet, resolve
from trainmesh.compat.horovod.rounds import Kind, Round, register_optimizer, start_round

TOO_MANY_PASSES = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
ZERO_GRAD_RACE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


def DistributedOptimizer(  # Horovod's name, and a function that returns an optimizer
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: object = None,
    sparse_as_dense: bool = False,
    process_set: object = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` (see the module's docstring). `num_groups`/`groups` (Horovod's explicit fusion
    groups) are accepted and change nothing: every gradient is its own all-reduce either way."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"hvd.DistributedOptimizer takes a torch.optim.Optimizer, not {type(optimizer).__name__}")
    reduce_op = resolve_op(op, None, "hvd.DistributedOptimizer")
    if reduce_op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(
            f"hvd.DistributedOptimizer(op={reduce_op.name}): gradients can be combined with hvd.Average or hvd.Sum. "
            "Fix: op=hvd.Average (the default)."
        )
    if gradient_predivide_factor != 1.0 and reduce_op != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: must be a whole number >= 1")
    ps = resolve(process_set, "hvd.DistributedOptimizer", members_only=False)  # a non-member steps alone
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    wrapped: _DistributedOptimizer = object.__new__(cls)
    init: Any = base.__init__  # the wrapped class's own constructor, over the same param groups (as Horovod)
    init(wrapped, optimizer.param_groups)
    wrapped.defaults = optimizer.defaults  # a group added later gets the user's defaults, not the class's
    options = (compression, backward_passes_per_step, reduce_op, gradient_predivide_factor, sparse_as_dense, ps)
    wrapped._hvd_setup(named_parameters, *options)
    return wrapped


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods DistributedOptimizer mixes in before the wrapped optimizer's class. Its attributes are
    prefixed _hvd_ so that they cannot collide with the wrapped optimizer's."""

    backward_passes_per_step: int

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's own attribute (scripts and its tests read it): each parameter's all-reduce name."""
        return self._hvd_names

    def _hvd_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: ReduceOp,
        predivide: float,
        sparse_as_dense: bool,
        ps: ProcessSet,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self._hvd_names = _names(named_parameters, params)
        self._hvd_compression = compression
        self._hvd_op = op
        self._hvd_predivide = predivide
        self._hvd_sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._hvd_order = [p for p in reversed(params) if p.requires_grad]  # the fixed all-reduce order
        self._hvd_slot = {p: i for i, p in enumerate(self._hvd_order)}
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_reset()
        self._hvd_ps = ps
        # The join registry's index counts every optimizer in creation order, the same on every rank (members of
        # its process set or not); -1: one rank. A non-member of the set steps alone, as under Horovod.
        self._hvd_index = register_optimizer(self._hvd_shadow) if size() > 1 else -1
        self._hvd_reduces = ps.included() and ps.size() > 1
        if self._hvd_reduces:
            ref = weakref.ref(self)
            handles = [p.register_post_accumulate_grad_hook(_hook(ref)) for p in self._hvd_order]
            weakref.finalize(self, _remove, handles)  # a dropped optimizer stops reducing

    def _hvd_reset(self) -> None:
        n = len(self._hvd_order)
        self._hvd_delay = [self.backward_passes_per_step] * n  # backward passes left before each all-reduce
        self._hvd_sent: list[tuple[torch.Tensor, Any, dist.Work] | Callable[[], torch.Tensor] | None] = [None] * n
        self._hvd_next = 0  # the first parameter (in the fixed order) whose all-reduce has not started
        self._hvd_header: Round | None = None
        self._hvd_round_open = False

    def _hvd_on_grad(self, param: torch.Tensor) -> None:
        """A backward pass has finished accumulating `param`'s gradient."""
        i = self._hvd_slot[param]
        if self._hvd_delay[i] == 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._hvd_delay[i] -= 1
        while self._hvd_next < len(self._hvd_order) and self._hvd_delay[self._hvd_next] == 0:
            self._hvd_send(self._hvd_next)
            self._hvd_next += 1

    def _hvd_send(self, i: int) -> None:
        if not self._hvd_round_open:  # the round's header goes first, for ranks inside hvd.join()
            call = Call("hvd.DistributedOptimizer.step", f"optimizer #{self._hvd_index}")
            try:
                self._hvd_header = start_round(Kind.OPTIMIZER, call, [self._hvd_index], self._hvd_ps.group)
            except Exception:
                self._hvd_reset()  # no round opened: forget this backward pass, so that zero_grad() and the
                raise  # next step work (the delays were counted down already)
            self._hvd_round_open = True
        param = self._hvd_order[i]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        if grad.is_sparse:
            # Horovod's sparse path: indices and values gathered, not summed. A rank inside hvd.join() answers
            # with one dense all-reduce of zeros per parameter (_hvd_shadow), so while one has joined the
            # gradient goes dense, as with sparse_as_dense: the same sum, and still a sparse gradient after.
            assert self._hvd_header is not None
            if not self._hvd_sparse_as_dense and not self._hvd_header.someone_joined():
                name = self._hvd_names.get(param)
                self._hvd_sent[i] = sparse_allreduce_async(grad, name, self._hvd_op, self._hvd_ps)
                return
            grad = grad.to_dense()  # all-reduced dense; the result goes back to sparse (_hvd_receive), as Horovod's
        tensor, ctx = self._hvd_compression.compress(grad)
        if not tensor.is_contiguous():  # e.g. channels_last: c10d wants contiguous tensors
            tensor = tensor.contiguous()
        if self._hvd_predivide != 1.0:
            tensor.mul_(1.0 / self._hvd_predivide)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._hvd_ps.group, async_op=True)
        self._hvd_sent[i] = (tensor, ctx, work)

    def _hvd_receive(self, i: int) -> None:
        sent = self._hvd_sent[i]
        assert sent is not None, i
        if callable(sent):  # a sparse gradient: the gathered one replaces it
            self._hvd_order[i].grad = sent()
            return
        tensor, ctx, work = sent
        work.wait()
        if self._hvd_op == ReduceOp.Average:
            tensor.div_(self._hvd_ps.size())
            if self._hvd_predivide != 1.0:
                tensor.mul_(self._hvd_predivide)
        result = self._hvd_compression.decompress(tensor, ctx)
        param = self._hvd_order[i]
        assert param.grad is not None
        if param.grad.is_sparse:  # sparse_as_dense: the optimizer gets a sparse gradient, as it would alone
            param.grad = result.to_sparse()
        elif result is not param.grad:
            param.grad.copy_(result)

    def _hvd_shadow(self) -> None:
        """What a rank inside hvd.join() does for this optimizer's round: zeros for every gradient."""
        works = []
        for param in self._hvd_order:
            dtype = self._hvd_compression.compress(torch.zeros((), dtype=param.dtype))[0].dtype
            zeros = torch.zeros(param.shape, dtype=dtype, device=param.device)
            works.append(dist.all_reduce(zeros, op=dist.ReduceOp.SUM, async_op=True))
        for work in works:
            work.wait()

    def _hvd_busy(self) -> bool:
        return any(d != self.backward_passes_per_step for d in self._hvd_delay) or self._hvd_round_open

    def synchronize(self) -> None:
        """Finish the gradients' all-reduces (starting those that have not started) and write the results
        into .grad. Call it before changing gradients (clipping, unscaling), then step() inside
        skip_synchronize()."""
        if self._hvd_reduces:
            for i in range(self._hvd_next, len(self._hvd_order)):
                self._hvd_send(i)
            if self._hvd_header is not None:
                self._hvd_header.wait()
            for i in range(len(self._hvd_order)):
                self._hvd_receive(i)
            self._hvd_reset()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """step() inside this block does not synchronize (it was done by an explicit synchronize())."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_busy():
            raise AssertionError(ZERO_GRAD_RACE)
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._hvd_reset()
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._hvd_reset()


def _names(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None, params: list[torch.Tensor]
) -> dict[torch.Tensor, str]:
    """Horovod's checks of named_parameters: (name, parameter) tuples, unique names, every parameter named."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()."
        )
    counts = collections.Counter(name for name, _ in named)
    dups = sorted(name for name, count in counts.items() if count > 1)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    names: dict[torch.Tensor, str] = {p: name for name, p in named}
    unnamed = [i for i, p in enumerate(params) if p not in names]
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} of the optimizer's {len(params)} parameters were "
            f"not named (positions {unnamed[:5]} in param_groups). Fix: pass model.named_parameters() of the "
            "model the optimizer trains, or leave named_parameters out."
        )
    return names


def _hook(ref: weakref.ReferenceType[_DistributedOptimizer]) -> Callable[[torch.Tensor], None]:
    """A parameter's hook; it holds the optimizer weakly, so that a dropped optimizer can go."""

    def hook(param: torch.Tensor) -> None:
        optimizer = ref()
        if optimizer is not None:
            optimizer._hvd_on_grad(param)

    return hook


def _remove(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
