"""Data-parallel gradient synchronisation over a partition of replicas.

Each member of ``P`` holds a replica of the same parameters and computes gradients on its own
part of the batch; synchronising sets every replica's gradient to ``g = sum_{j in P} g_j``
(``op="sum"``) or ``g / P.size`` (``op="avg"``): an all-sum-reduce of the gradients, which is
self-adjoint. Gradients travel in *buckets*: the gradients of several parameters of one dtype,
flattened into one buffer and reduced in one sum, in reverse parameter order (the order
backward produces them). A gradient of at least ``IN_PLACE_BYTES`` has a bucket of its own and is
reduced where it lies, without the two copies through a flat buffer. Buckets below
``DISTDL_PAIRWISE_SUM_BYTES`` are summed by MPI's ``Iallreduce``, larger ones by distdl's pairwise sum
(``distdl.backends.mpi.InPlaceSum``), where ``op="avg"`` divides only this worker's share.
float16/bfloat16 gradients are summed in float32.

A distdl layer sums the gradients of the copies of a parameter it holds on several workers. Where those
workers include every member of ``P`` (a batch norm over the batch that ``P`` splits), that sum is already
the reduction over ``P``: such parameters are left out of the buckets (with ``op="avg"``, divided by
``P.size``); where they are this member alone, they are reduced as any parameter; otherwise ValueError (and
for a parameter summed over all of ``P`` that another module, one not summing it so, holds too: tied). Other
uses of such a parameter in the loss (a penalty on it) are not summed over ``P``: see docs/layers/data_parallel.md.

A parameter without a gradient (``grad is None``) counts as zeros: every bucket also sums one
presence count per parameter, so every member learns how many members had a gradient.
If any had one, every member gets the reduced gradient; if none had one, it stays ``None``
everywhere.

==============================  ==================================================
worker                          does
==============================  ==================================================
in P                            contributes its gradients, receives the reduction
outside P                       nothing (its gradients are left as they are)
==============================  ==================================================
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import sys
import weakref
import zlib
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import torch
from mpi4py import MPI

from distdl.backends import cuda
from distdl.backends import mpi as transport
from distdl.checks import CollectiveMismatchError, check_mode, checksum, verify, verify_later
from distdl.functional._common import check_flags, check_partition
from distdl.nn.module import CollectStateMixin, StateLayout, block_holders, check_materialised, parameter_layouts
from distdl.partition import MPIPartition
from distdl.utilities.caches import keep

__all__ = ["all_reduce_gradients", "DataParallel"]

_OPS = ("avg", "sum")
# From this many bytes, a gradient is reduced in its own memory: copying it into a flat buffer and back
# costs about what the calls it saves cost. 8 MiB of gradients on 2 ranks, each on its own against all
# bucketed: 4.8x the time at 16 KiB each, 1.7x at 64 KiB, 1.0x at 256 KiB, 0.74x at 1 MiB (and in place
# needs no flat buffer). Parameter sizes agree on every member, so every member decides alike.
IN_PLACE_BYTES = 256 * 1024


def all_reduce_gradients(module: torch.nn.Module, P: MPIPartition, op: str = "avg",
                         bucket_cap_mb: float = 25) -> None:
    """Reduce every parameter's ``.grad`` of ``module`` over ``P``, in buckets, in place.

    Blocking; once per step, after its last backward (with gradient accumulation, after the last micro-batch's).
    Called after each micro-batch instead, it would reduce again what the last call reduced: with ``op="sum"``
    every gradient, with ``op="avg"`` the gradients a distdl layer already summed over ``P`` (divided by
    ``P.size`` at each call). Where it finds a gradient reduced by the last call and then accumulated onto by a
    backward, it raises RuntimeError on every member instead. The buckets (and their buffers) are planned on the
    first call and kept for later calls with the same parameters.

    Args:
        module: the replica; the members of ``P`` must hold the same parameters (dtypes, shapes, order).
        P: the partition of replicas (e.g. the data-parallel fibre ``P_x.create_subpartition([0])``).
        op: ``"avg"`` (sum divided by ``P.size``) or ``"sum"``.
        bucket_cap_mb: the most megabytes of small gradients reduced in one sum.
    Raises:
        TypeError: ``module`` not a ``torch.nn.Module``, ``P`` not a partition, or a sparse gradient.
        ValueError: a bad ``op`` or ``bucket_cap_mb``, members of ``P`` holding different parameters, a layer
            summing the gradients of a parameter's copies over some members of ``P`` but not all, or such a
            parameter, summed over all of ``P``, held by another module too that does not sum it so.
        RuntimeError: a gradient that the last call reduced and a backward then accumulated onto (see above).
    """
    where = "all_reduce_gradients"
    params = _validate(where, module, P, op, bucket_cap_mb)
    for p in params:
        _check_dense(where, p)
    buckets, signature, summed, problem = _cached_plan(where, module, P, params, bucket_cap_mb)
    if not P.active or P.size == 1:
        return  # a sum over one worker changes nothing
    verify(where, P, agree={"op": op})  # check mode: a member skipping this (or with another op) is named
    # What a second reduction would change: every gradient summed, or divided where its layer summed it already
    changed = [p for b in buckets for p in b.params] if op == "sum" else list(summed.values())
    written = P._memo(("reduced gradients",), dict)  # id(p) -> (p, its .grad, weakly; the .grad's version)
    _check_agreement(where, P, lambda: _named(module, buffers=False), signature, problem,
                     _accumulated(where, op, changed, written))
    for p in summed.values() if op == "avg" else ():  # their layers summed these over P already
        if p.grad is not None:
            p.grad.div_(P.size)
    comm = _communicator(P)
    addresses = Counter(b.params[0].grad.data_ptr() for b in buckets if b.solo and b.params[0].grad is not None)
    claimed = {a for a, n in addresses.items() if n > 1}  # a .grad shared by parameters is copied, not summed twice
    for bucket in buckets:
        bucket.start(comm, claimed, P.size if op == "avg" else 1)
    _complete(buckets)
    written.clear()  # this call's only: the last call's parameters may be gone
    grads = [p.grad for p in changed if p.grad is not None]
    # Views and detached aliases of one tensor (a layer's weight and bias gradients, one tensor's halves) share its
    # memory and its version counter: count the gradients on each memory
    sharing = Counter(g.untyped_storage().data_ptr() for g in grads)
    for p in changed:
        if p.grad is not None:  # the version after one write to each gradient sharing its counter
            written[id(p)] = (weakref.ref(p), weakref.ref(p.grad),
                              p.grad._version + sharing[p.grad.untyped_storage().data_ptr()])


def _accumulated(where: str, op: str, params: list, written: dict) -> str | None:
    """Return what is wrong where a parameter's ``.grad`` is the one the last call reduced, written once since (a
    backward accumulating onto it; ``zero_()`` also writes once, but leaves nothing that a reduction changes)."""
    for p in params:
        found = written.get(id(p))
        if (found is not None and p.grad is not None and found[0]() is p and found[1]() is p.grad  # None: freed
                and p.grad._version == found[2] and bool(p.grad.any())):
            again = ("summed again (P.size times too large)" if op == "sum" else
                     "divided by P.size again (its layer summed it over P already)")
            return (f"{where}: expected the gradients zeroed between calls, got the gradient of a parameter of shape "
                    f"{tuple(p.shape)} accumulated onto its last reduced value by a backward; reduced again, that "
                    f"value would be {again}. Call it once per step, after the last backward (accumulate the "
                    "micro-batches first), or zero the gradients (with zero_grad(): a write through .data is not "
                    "seen)")
    return None


def _complete(buckets: list[_Bucket]) -> None:
    """Complete the reductions of started buckets: every bucket's sum continues before any is waited for, in
    bucket order (the same on every member, so the collectives they post match)."""
    for bucket in buckets:
        bucket.spread()
    for bucket in buckets:
        bucket.finish()


def _cached_plan(where: str, module: torch.nn.Module, P: MPIPartition, params: list,
                 bucket_cap_mb: float) -> tuple[list[_Bucket], int, dict[int, torch.Tensor], str | None]:
    """Return the buckets of ``params`` but those a distdl layer sums over ``P`` already, their signature, the ids of
    those left out and a problem found with them (see :func:`_summed_by_layers`), kept between calls with the same
    parameters held by the same modules.

    Checking and planning cost ~3.5 us a parameter, and buckets kept keep their buffers (fresh memory costs a page
    fault per page touched). The plans live as long as ``module`` (and ``P``); the last two per module.
    """
    plans = P._memo(("gradient_plans",), weakref.WeakKeyDictionary).setdefault(module, {})
    key = (bucket_cap_mb, _layout(module, params))
    found = plans.get(key)  # the buckets hold the parameters, so no other parameter can take their ids
    if found is None or _gone(found[-1]):
        buckets, summed, problem = _plan_reduced(where, module, P, params, bucket_cap_mb)
        found = keep(plans, key, (buckets, _signature(buckets, []), summed, problem, _holders(module)), 2)
    return found[:4]


def _plan_reduced(where: str, module: torch.nn.Module, P: MPIPartition, params: list,
                  bucket_cap_mb: float) -> tuple[list[_Bucket], dict[int, torch.Tensor], str | None]:
    """Return the buckets of ``params`` but those a distdl layer of ``module`` sums over ``P`` already, those by id,
    and a problem found with them (see :func:`_summed_by_layers`)."""
    ids, problem = _summed_by_layers(module, P)
    summed = {id(p): p for p in params if id(p) in ids}  # held, so no other parameter takes their ids while kept
    return _plan(where, [p for p in params if id(p) not in summed], bucket_cap_mb), summed, problem


class DataParallel(torch.nn.Module):
    """Wrap ``module`` so that backward reduces its gradients over ``P``, overlapped with backward.

    At construction the parameters (frozen ones too) and buffers are broadcast from rank 0 of ``P`` (one
    broadcast per dtype), and so are the buffers at every forward with grad mode on (``broadcast_buffers``, as
    torch's DDP: each replica's batch-norm statistics are rank 0's at the start of such a forward, and its own
    after it, until the next one). Such a forward is collective over ``P``: it also plans the buckets again where
    the parameters that take gradients changed since (frozen or unfrozen, converted with ``.double()``, replaced
    by ``load_state_dict(assign=True)``, a new layer), another module came to hold one or ceased to (a tie
    made or undone) or the buffers changed (one added, another dtype or shape), on every member alike, and then
    broadcasts from rank 0 of ``P`` the parameters and buffers new on some member. Members must enter
    :meth:`no_sync` alike and construct the wrapper with the same settings (ValueError on every member). During
    backward, as soon as every parameter of a bucket has its gradient, a non-blocking sum of the bucket starts
    (buckets start in a fixed order, the same on every member); all of them complete when backward ends, before
    anyone can read ``.grad``.
    Zero the gradients between steps (as with ``torch.nn.parallel.DistributedDataParallel``)
    and call backward once per step, or accumulate in :meth:`no_sync`; with ``op="sum"``, a backward that
    accumulates onto the last reduced gradients would sum them again: where a member finds them as the last
    reduction left them (not after they were changed in place, by clipping say), the reduction at the end of that
    backward (in :meth:`no_sync`, of the next backward that reduces, unless they were set to None since) raises
    RuntimeError on every member. Every member of ``P`` must run a backward through the module that reaches its
    parameters (a member whose output does not depend on them leaves the others waiting; check mode names it at
    its next forward). For parameters on a GPU the hooks
    run in autograd's thread for the device: ``MPI_THREAD_SERIALIZED`` suffices with CUDA-aware MPI and one device
    per rank; staging through the host or several devices per rank need ``MPI_THREAD_MULTIPLE``
    (see the GPU docs).

    The wrapper reduces while it lives (keep it, as with torch's DDP). One wrapper at a time
    reduces a parameter: wrapping it again while an earlier wrapper lives raises ValueError (drop
    the earlier one first; its hooks go with it; a dropped one caught in a reference cycle is
    collected first). A backward that ends inside another before the module's gradients are all
    ready (reentrant checkpointing of its last layers) raises RuntimeError: use
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. A backward that raises (on
    every member, at the same point or not) leaves sums in flight: the next forward through the wrapper in grad
    mode completes them on every member and drops that step's gradients; zero the gradients before the next
    backward, as after any step.

    Args:
        module: the replica; the members of ``P`` must hold the same parameters (dtypes, shapes, order).
        P: the partition of replicas, as for :func:`all_reduce_gradients`.
        bucket_cap_mb: the most megabytes of small gradients reduced in one sum (default 25). It comes third here,
            ``DataParallel(module, P, bucket_cap_mb, op)``, but fourth in ``all_reduce_gradients(module, P, op,
            bucket_cap_mb)``: pass it and ``op`` by keyword.
        op: ``"avg"`` (sum divided by ``P.size``) or ``"sum"``.
        broadcast_buffers: broadcast the buffers from rank 0 of ``P`` at every forward with grad mode on.
    """

    def __init__(self, module: torch.nn.Module, P: MPIPartition, bucket_cap_mb: float = 25,
                 op: str = "avg", broadcast_buffers: bool = True) -> None:
        super().__init__()
        params = _validate("DataParallel", module, P, op, bucket_cap_mb)
        for m in module.modules():
            check_materialised("DataParallel", m)
        (self.broadcast_buffers,) = check_flags("DataParallel", broadcast_buffers=broadcast_buffers)
        self.module, self.P, self.op, self.bucket_cap_mb = module, P, op, bucket_cap_mb
        self._divisor = P.size if op == "avg" else 1
        problem = self._plan_buckets(params)
        self._sync, self._forward_sync, self._in_flight, self._task = True, True, False, -1
        self._check: Callable[[], None] | None = None  # check mode: the check of the backward in flight
        self._written: dict[int, tuple] = {}  # op="sum": id(p) -> (its reduced .grad, weakly; the .grad's version)
        self._accumulated: list[tuple] = []  # op="sum": (p, its .grad weakly) a backward accumulated onto reduced
        if not P.active or P.size == 1:
            return
        _refuse_taken(P, params)
        # Its own communicator: the reductions of two wrappers over the same workers (a GAN's two models) may start
        # in another order on each member (a bucket with a parameter unused there starts at the end of backward).
        self._replicas = P.create_partition_inclusive(range(P.size))
        self._comm = self._replicas.comm
        # Check mode checks its forwards and the ends of its backwards on a third: the check of a backward that raised
        # on every member, started on some only, then meets no other check or collective on P (see forward)
        self._checks = P.create_partition_inclusive(range(P.size))
        states = list(module.parameters()) + list(module.buffers())
        _check_agreement("DataParallel", P, lambda: _named(module), _signature(self._buckets, states), problem,
                         settings=self._settings())
        transport.bcast_in_place_all(P.comm, states)
        self._known = {id(t): weakref.ref(t) for t in states}  # broadcast: a replan broadcasts only others
        # changed; no_sync() at this forward: off, on; 1 + the buckets a backward that raised had started; the check of
        # that backward left started here
        self._flags = np.zeros(5, dtype=np.int64)
        self._hooks: list = []
        # the buckets and check of a backward in flight, and their communicators: MPI may still write their buffers,
        # and freeing a communicator that a collective started on some members only never completes on made a later
        # collective of the job fail (a rank killed, at 4 processes; docs/concepts.md: forward before dropping it)
        self._flight: list = []
        # the hooks go with the wrapper (a dropped one does not reduce); what is in flight stays
        weakref.finalize(self, _remove, self._hooks, self._flight)
        self._hook(params)

    def _plan_buckets(self, params: list) -> str | None:
        """Plan the buckets of ``params``, but for those a distdl layer of the module sums over ``P`` already; return
        a problem found with those (see :func:`_summed_by_layers`)."""
        self._buckets, summed, problem = _plan_reduced("DataParallel", self.module, self.P, params, self.bucket_cap_mb)
        self._params, self._summed = params, list(summed.values())
        self._layout, self._holders = _layout(self.module, params), _holders(self.module)
        return problem

    def _hook(self, params: list) -> None:
        """Hook the parameters of the buckets (the hooks hold the wrapper weakly), and with ``op="avg"`` those their
        layers sum over ``P``: each gradient arriving there is divided by ``P.size``, as a bucket's sum is."""
        me = weakref.ref(self)
        # A hook on each gradient's accumulator, as torch's DDP: it runs after the parameter's own post-accumulate-grad
        # hooks (which may change the gradient), whenever they were registered. The accumulators are kept alive here
        # (a parameter holds its own weakly: autograd would make another, without the hook). Beside it, a hook on the
        # parameter for where autograd gives it another accumulator all the same (see _elsewhere). The accumulators'
        # hooks come first in self._hooks, in the order of self._accumulators.
        self._accumulators = [(index, p, torch.autograd.graph.get_gradient_edge(p).node)
                              for index, bucket in enumerate(self._buckets) for p in bucket.params]
        self._hooks += [node.register_hook(functools.partial(_gradient_ready, me, index, p))
                        for index, p, node in self._accumulators]
        self._hooks += [p.register_post_accumulate_grad_hook(functools.partial(_elsewhere, me, k))
                        for k, (_, p, _) in enumerate(self._accumulators)]
        if self._divisor > 1:
            self._hooks += [p.register_hook(functools.partial(torch.div, other=self._divisor)) for p in self._summed]
        for p in params:
            _REDUCING[id(p)] = self

    def forward(self, *args, **kwargs):
        cuda.refuse_unsupported("DataParallel")  # its broadcasts and hooks take real tensors, as the primitives
        if self.P._freed:  # it reduces on a communicator of its own, which P.free() leaves
            self.P._check_live("DataParallel")
        if torch.is_grad_enabled() and self.P.active and self.P.size > 1:
            # the last backward raised before its end where it left sums in flight (on some members only, where
            # the others raised before its first gradient)
            abandoned = self._in_flight and torch._C._current_graph_task_id() == -1
            if check_mode():
                self._verify_forward(abandoned)
            params = [p for p in self.module.parameters() if p.requires_grad]
            left = abandoned and self._check is not None  # with check mode off here (see _verify_forward)
            self._flags[:] = (_layout(self.module, params) != self._layout or _gone(self._holders), self._sync,
                              not self._sync, self._next + 1 if abandoned else 0, left)
            # every member plans again, or none; on P's communicator, as sums may be in flight on the wrapper's
            self.P.comm.Allreduce(MPI.IN_PLACE, self._flags, op=MPI.MAX)
            if self._flags[4]:  # some member left the check of that backward: the others make theirs, alike
                if not left:
                    self._check = verify_later("DataParallel (backward)", self._checks, force=True)
                self._complete_check()
            if self._flags[3]:
                self._abandon(int(self._flags[3]) - 1, abandoned)
            if self._flags[1] and self._flags[2]:
                raise ValueError("DataParallel: expected no_sync() alike on every member of P, got a forward within "
                                 "it on some members only (the backward would reduce on the others only: a hang)")
            if self._flags[0]:
                self._replan(params)
            if check_mode():  # names a member whose parameters differ
                verify("DataParallel (copies of its parameters)", self.P,
                       agree={"the values of its parameters (checksum)": checksum(self.module.parameters())})
            if self.broadcast_buffers:
                transport.bcast_in_place_all(self.P.comm, self.module.buffers())
        if torch.is_grad_enabled():
            self._forward_sync = self._sync  # as DDP: the forward decides whether its backward reduces
        return self.module(*args, **kwargs)

    def _replan(self, params: list) -> None:
        """Plan the buckets of ``params`` again, move the hooks to them and broadcast from rank 0 of ``P`` the
        parameters and buffers new on some member (a new head, a tensor loaded with ``assign=True``), so that they
        start alike on every member. The others are not written: a graph may hold them already."""
        _remove(self._hooks)
        self._hooks.clear()
        for p in self._params:
            if _REDUCING.get(id(p)) is self:
                del _REDUCING[id(p)]
        problem = self._plan_buckets(params)
        self._written = {}
        everything = list(self.module.parameters()) + list(self.module.buffers())  # as at construction
        try:
            _refuse_taken(self.P, params)
            _check_agreement("DataParallel", self.P, lambda: _named(self.module), _signature(self._buckets, everything),
                             problem, settings=self._settings())
        except ValueError:
            self._layout = None  # unhooked: plan (and raise) again at the next forward, rather than not reduce
            raise
        new = np.array([self._known.get(id(t), _dead)() is not t for t in everything], dtype=np.int64)
        self._comm.Allreduce(MPI.IN_PLACE, new, op=MPI.MAX)  # the same on every member (their layouts agree)
        transport.bcast_in_place_all(self.P.comm, [t for t, fresh in zip(everything, new) if fresh])
        self._known = {id(t): weakref.ref(t) for t in everything}
        self._hook(params)

    def _settings(self) -> dict:
        """What every member of ``P`` must construct alike (op="avg" on one member: replicas apart, silently;
        broadcast_buffers on some: a hang)."""
        try:
            cap = float(self.bucket_cap_mb)  # by value: 25 on one member, 25.0 on another agree
        except OverflowError:  # an int past float's range: no cap
            cap = math.inf
        return {"op": self.op, "broadcast_buffers": self.broadcast_buffers, "bucket_cap_mb": cap}

    def __deepcopy__(self, memo):
        raise TypeError("DataParallel: expected no deep copy of the wrapper (it holds a communicator and hooks on "
                        "its module's parameters); copy the module and wrap the copy: "
                        "DataParallel(copy.deepcopy(wrapper.module), P)")

    def __copy__(self):  # a copy would share the wrapper's hooks, which reduce for the wrapper copied (and go with it)
        raise TypeError("DataParallel: expected no copy of the wrapper (its hooks on its module's parameters reduce "
                        "for this wrapper alone); wrap the module once and keep that wrapper, or wrap a copy of the "
                        "module: DataParallel(copy.deepcopy(wrapper.module), P)")

    def _abandon(self, started: int, abandoned: bool) -> None:
        """Complete the reductions that a backward which raised left in flight, the first ``started`` buckets
        (``abandoned``: this member's backward started some), so that the members' collectives stay matched;
        that step's gradients are dropped. Gradients summed in place are zeroed; the others are left as the user
        left them (zero them after a failed step, as after any step)."""
        everything = {id(p) for p in self._params}
        for bucket in self._buckets[self._next if abandoned else 0:started]:  # where backward stopped may differ
            bucket.start(self._comm, set(), self._divisor, absent=everything)
        for bucket in self._buckets[:started]:
            bucket.spread()
        for bucket in self._buckets[:started]:
            bucket.finish(write=False)
            bucket.drop_in_place()
        self._next, self._in_flight, self._accumulated = len(self._buckets), False, []
        self._flight.clear()

    def _verify_forward(self, abandoned: bool) -> None:
        """Check mode: verify this forward on every member of ``P``, which names a member that skipped a step
        (forward or backward) before the collectives that follow (they would wait for peers still in that
        backward's sums). ``abandoned``: this member's last backward raised after its check started."""
        if abandoned:  # pairs with the others' check of that backward, or their forward's (see _raised_apart)
            self._complete_check(abandoned)
        try:
            verify("DataParallel", self._checks)
        except CollectiveMismatchError as error:
            if not self._raised_apart(error, False):
                raise
            verify("DataParallel", self._checks)  # where it started that backward's check, this forward's follows

    def _complete_check(self, abandoned: bool = False) -> None:
        """Complete the check mode's check of the backward in flight, if any (``abandoned``: in the forward after
        that backward raised)."""
        complete, self._check = self._check, None
        if complete is None:
            return
        try:
            complete()
        except CollectiveMismatchError as error:
            if not self._raised_apart(error, abandoned):
                raise

    def _raised_apart(self, error: CollectiveMismatchError, abandoned: bool) -> bool:
        """Whether a check's ``error`` is a backward that raised on every member of ``P``, some having started its
        check and the others not (those that raised before the wrapper's first gradient): then the check of that
        backward paired with the others' next forward's. Collective over ``P`` where ``error`` pairs exactly
        these two checks (every member saw it so): members that started that backward's check say whether it
        raised (``abandoned``), which those at the forward cannot know."""
        if set(error.differences) != {"primitive"} or set(error.differences["primitive"]) != {
                "DataParallel", "DataParallel (backward)"}:
            return False
        started = error.where == "DataParallel (backward)"
        return all(said is not False for said in self.P.comm.allgather(abandoned if started else None))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """The backward of a forward run within this context accumulates local gradients without reducing them,
        wherever it runs; as with DDP, the forward decides (the backward of a forward run outside is reduced, also
        within this context)."""
        self._sync, previous = False, self._sync
        try:
            yield
        finally:
            self._sync = previous

    def wait(self) -> None:
        """Complete every outstanding reduction (done at the end of backward; idempotent)."""
        if not self._in_flight:
            return
        self._complete_check()
        # Buckets with a parameter this backward did not reach. With op="sum", where its gradient is still the one
        # the last reduction wrote (a second backward in a step: another head, backward(inputs=...)), it counts as
        # absent, and stays as it is where it is absent on every member (summed again, it would be P.size times
        # that). With op="avg" it takes part: where some member's backward reached it, each member's share of the
        # average so far is in the new average (and averaging it again alone leaves it as it is).
        left = {id(p) for p, (grad, version) in ((p, self._written[id(p)]) for b in self._buckets[self._next:]
                                                  for p in b.params if id(p) in self._written)
                if grad() is p.grad and p.grad._version == version}  # recorded with op="sum" only
        for index in range(self._next, len(self._buckets)):
            self._buckets[index].start(self._comm, self._claimed, self._divisor, left, self._accumulating())
        self._next = len(self._buckets)
        _complete(self._buckets)
        self._in_flight = False
        self._flight.clear()
        if self.op == "sum":  # as the reduction left them
            self._written = {id(p): (weakref.ref(p.grad), p.grad._version)
                             for b in self._buckets for p in b.params if p.grad is not None}
        # The last bucket started after any member found an accumulation (found for a parameter, it is flagged in
        # that parameter's bucket and every later one): every member raises, after the sums every member started.
        self._accumulated = []
        if self._buckets[-1].flagged:
            raise RuntimeError("DataParallel: expected the gradients zeroed between steps with op='sum', got a "
                               "backward that accumulated onto the last reduced gradient (it would be summed "
                               "again: P.size times too large; the gradients are undefined now) on some member of "
                               "P; zero them before each step's first backward (micro-batches in no_sync() "
                               "accumulate after that)")

    def _gradient_ready(self, p: torch.Tensor, index: int, incoming: torch.Tensor | None) -> None:
        # op="sum": the first backward after a reduction, in no_sync() too, must not accumulate onto the sum. Its
        # gradient was written once since (zero_() writes once more); if only through .data (unseen by the version
        # counter: p.grad.data.zero_()), the gradient is the incoming one alone.
        if self.P._freed:  # reduced on a communicator of its own, the sums would go on silently
            self.P._check_live("DataParallel (backward)")
        written = self._written.pop(id(p), None) if self._written else None
        if (written is not None and p.grad is not None and written[0]() is p.grad
                and p.grad._version == written[1] + 1 and not _alone(p.grad, incoming)):
            self._accumulated.append((p, weakref.ref(p.grad)))  # told to every member by the next reduction
        elif self._accumulated and _alone(p.grad, incoming):  # zeroed since it was found accumulated onto
            self._accumulated = [(q, grad) for q, grad in self._accumulated if q is not p]
        if not self._forward_sync:
            return
        _check_dense("DataParallel", p)
        if not self._in_flight:
            task = torch._C._current_graph_task_id()  # graph tasks are numbered as they begin
            if task < self._task:  # the last round ended with a backward nested in this one
                raise RuntimeError("DataParallel: expected every gradient of the module within one backward, got a "
                                   "backward that ended inside another before they were all ready (reentrant "
                                   "checkpointing: use use_reentrant=False)")
            compiled = sys.modules.get("torch._dynamo.compiled_autograd")
            if compiled is not None and compiled.in_compiled_autograd_region:  # it refuses queue_callback
                raise NotImplementedError("DataParallel: expected a backward outside compiled autograd (it cannot "
                                          "complete the sums at the end of the backward); compile the model only")
            self._task, self._in_flight, self._next = task, True, 0
            # check mode: a member that skipped this backward, or made a forward its peers did not, is named (this
            # pairs with its next forward's check); completed at the end, as wrappers on other communicators may
            # start theirs in another order
            self._check = verify_later("DataParallel (backward)", self._checks)
            self._flight[:] = [self._buckets, self._check, self._replicas, self._checks]
            self._waiting = [len(b.params) for b in self._buckets]
            self._seen: set[int] = set()
            self._claimed: set[int] = set()
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        if id(p) in self._seen:
            raise RuntimeError("DataParallel: expected one gradient per parameter per backward, got a second "
                               "(reentrant checkpointing, several backward calls before the end of one, or a "
                               "backward after one that raised without a forward through the wrapper between)")
        self._seen.add(id(p))
        self._waiting[index] -= 1
        # Start buckets strictly in order, so every member issues the same sequence of collectives.
        while self._next < len(self._buckets) and self._waiting[self._next] == 0:
            self._buckets[self._next].start(self._comm, self._claimed, self._divisor, flag=self._accumulating())
            self._next += 1

    def _accumulating(self) -> bool:
        """Whether a gradient that a backward accumulated onto its reduced value (in no_sync() too) is still its
        parameter's, not zeroed since (zero_grad(), with set_to_none or not)."""
        return any(p.grad is not None and grad() is p.grad and bool(p.grad.any()) for p, grad in self._accumulated)


# id of a parameter -> the live DataParallel reducing it (which holds the parameter, so the id stays its own)
_REDUCING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _refuse_taken(P: MPIPartition, params: list) -> None:
    """Raise ValueError on every member of ``P`` if a member finds one of ``params`` reduced by a live DataParallel
    (collective)."""
    taken, anywhere = _taken(P, params)
    if anywhere:  # every member collects, whichever found one
        gc.collect()  # a dropped wrapper caught in a reference cycle lives until the collector runs
        taken, anywhere = _taken(P, params)
    if anywhere:  # every member raises
        raise ValueError(f"DataParallel: expected parameters that no other DataParallel reduces, got "
                         f"{'one of shape ' + str(taken[0]) if taken else 'one on another member'} that a live "
                         "DataParallel already reduces (drop it first)")


def _dead() -> None:
    """A dead weak reference's call, for a tensor never seen."""
    return None


def _taken(P: MPIPartition, params: list) -> tuple[list[tuple[int, ...]], bool]:
    """Return the shapes of ``params`` that a live DataParallel reduces here, and whether any member of ``P``
    found one (collective)."""
    taken = [tuple(p.shape) for p in params if _REDUCING.get(id(p)) is not None]
    return taken, P.comm.allreduce(bool(taken), op=MPI.LOR)


def _alone(grad: torch.Tensor, incoming: torch.Tensor | None) -> bool:
    """Whether ``grad`` holds only the ``incoming`` gradient just accumulated into it (what it held was zero)."""
    return incoming is not None and incoming.layout == grad.layout == torch.strided and torch.equal(grad, incoming)


def _gradient_ready(wrapper: weakref.ref, index: int, p: torch.Tensor, *grads) -> None:
    """The hook on ``p``'s gradient accumulator: tell its DataParallel, while that lives, that ``p``'s gradient is
    ready."""
    found = wrapper()
    if found is not None:
        incoming = grads[1][0] if len(grads) == 2 and grads[1] else None  # the gradient accumulated
        found._gradient_ready(p, index, incoming)


def _elsewhere(wrapper: weakref.ref, k: int, p: torch.Tensor) -> None:
    """A parameter's post-accumulate-grad hook: where its gradient accumulated in another accumulator than the one
    hooked (setting ``p.data`` to another dtype or device drops a parameter's accumulator: ``.half()`` then
    ``.float()`` leave the layout as it was), move the hook to that one, which runs it after the parameter's other
    hooks, this time already."""
    found = wrapper()
    if found is None:
        return
    index, _, hooked = found._accumulators[k]
    node = torch._C._current_autograd_node()  # the accumulator running this hook
    if node is not hooked and node is not None:
        found._hooks[k].remove()
        found._hooks[k] = node.register_hook(functools.partial(_gradient_ready, wrapper, index, p))
        found._accumulators[k] = (index, p, node)


def _layout(module: torch.nn.Module, params: list) -> tuple:
    """Return what the plan of ``params`` depends on: which parameters, of which dtypes, shapes and devices, which
    of ``module``'s modules hold each (a tie made or undone changes what the layers sum, not the parameters), and
    the dtypes and shapes of its buffers (which DataParallel broadcasts). Modules by id: a plan keeps
    :func:`_holders` beside, since a new module may take the id of one freed since."""
    modules = list(module.modules())
    return (tuple((id(p), p.dtype, p.shape, p.device, _grad_dtype(p)) for p in params),
            tuple((id(m), id(p)) for m in modules for p in m._parameters.values() if p is not None),
            tuple((b.dtype, b.shape) for m in modules for b in m._buffers.values() if b is not None))


def _holders(module: torch.nn.Module) -> list[weakref.ref]:
    """Return weak references to ``module``'s modules, for :func:`_gone` (made when planning, not at each call)."""
    return [weakref.ref(m) for m in module.modules()]


def _gone(refs: list) -> bool:
    """Whether a module that :func:`_holders` saw has been freed since (its id may be another's now)."""
    return any(r() is None for r in refs)


def _remove(hooks: list, flight: list = ()) -> None:
    for hook in hooks:
        hook.remove()
    if flight:  # dropped after a backward that raised: its requests and their buffers stay alive
        _ORPHANED.append(list(flight))


_ORPHANED: list[list] = []


class _Bucket:
    """Gradients of several parameters of one dtype, flattened into one buffer for one reduction; or one
    large gradient (``solo``), reduced in place. Beside it, one presence slot per parameter is summed, and a flag."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.params, self.dtype = params, dtype
        self.device = cuda.buffer_device(params[0].device)  # the host when CUDA tensors are staged
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.solo = len(params) == 1 and self.total * dtype.itemsize >= IN_PLACE_BYTES
        self.flat: torch.Tensor | None = None  # bucketed: allocated on first use, then reused
        self.scratch: torch.Tensor | None = None  # a row for a pairwise sum (transport.InPlaceSum), reused
        self.segments: list[torch.Tensor] = []  # of the flat buffer, one per parameter, shaped like it
        self.data: list[torch.Tensor] = []  # what is being reduced: the segments, or solo the gradient itself
        self.presence = np.zeros(len(params) + 1, dtype=np.int64)  # and last, how many members raised the flag
        self.counting: MPI.Request | None = None  # the sum of the presence counts
        self.sum: transport.InPlaceSum | None = None

    def start(self, comm: MPI.Comm, claimed: set[int], divisor: int, absent: set[int] = frozenset(),
              flag: bool = False) -> None:
        """Copy the gradients in (zeros where there is none) and start the reduction, divided by ``divisor``.
        ``claimed``: addresses of gradients not to reduce in place (already reduced in place this round, or
        shared by parameters); ``absent``: ids of parameters whose gradient counts as none; ``flag``: raised
        here (:attr:`flagged` once finished, if raised on any member)."""
        grads = [None if id(p) in absent else p.grad for p in self.params]
        with torch.no_grad():
            if self.solo:
                self.data = [self._solo_data(grads[0], claimed)]
                summed = self.data[0]
            else:
                if self.flat is None:  # its size, dtype and device are the bucket's: made once
                    self.flat = torch.empty(self.total, dtype=self.dtype, device=self.device)
                    self.segments = [t.view(p.shape) for p, t in zip(self.params, self.flat.split(self.sizes))]
                summed, self.data = self.flat, self.segments
                if any(g is None or transport._lazy(g) for g in grads):  # one by one (torch's copy_ resolves views)
                    for g, segment in zip(grads, self.segments):
                        segment.zero_() if g is None else segment.copy_(g)
                else:
                    torch._foreach_copy_(self.segments, grads)
        self.presence[:] = [g is not None for g in grads] + [flag]
        self.counting = comm.Iallreduce(MPI.IN_PLACE, self.presence, op=MPI.SUM)
        self.sum = transport.InPlaceSum(comm, summed, divisor, self.scratch)
        self.scratch = self.sum.scratch

    @property
    def flagged(self) -> bool:
        return bool(self.presence[-1])

    def spread(self) -> None:
        """Continue the reduction (after every bucket has started; see ``transport.InPlaceSum``)."""
        self.sum.spread()

    def finish(self, write: bool = True) -> None:
        """Wait for the reduction and (``write``) put the result in ``.grad``."""
        self.sum.wait()
        self.counting.Wait()
        self.sum = self.counting = None
        if not write:
            return
        data, self.data = self.data, []
        targets, sources = [], []
        with torch.no_grad():
            for p, reduced, count in zip(self.params, data, self.presence.tolist()):
                if count == 0 or reduced is p.grad:  # no member had a gradient (it stays None); reduced in place
                    continue
                if p.grad is None or p.grad._is_zerotensor():  # autograd's zero tensors cannot be written
                    p.grad = torch.empty_like(p, dtype=_grad_dtype(p), requires_grad=False)
                targets.append(p.grad)
                sources.append(reduced)
            if targets:
                torch._foreach_copy_(targets, sources)

    def drop_in_place(self) -> None:
        """Zero the gradient that a dropped reduction summed in place, if it is still the parameter's."""
        data, self.data = self.data, []
        if self.solo and data and data[0] is self.params[0].grad:
            with torch.no_grad():
                data[0].zero_()

    def _solo_data(self, grad: torch.Tensor | None, claimed: set[int]) -> torch.Tensor:
        """Return the gradient itself where MPI can sum it in place, else a copy in the bucket's dtype (also
        where another parameter's ``.grad`` is the same tensor: summing it twice in place would double it)."""
        if grad is None or grad._is_zerotensor():
            return torch.zeros(self.params[0].shape, dtype=self.dtype, device=self.device)
        if (grad.dtype == self.dtype and grad.device == self.device and grad.is_contiguous()
                and not transport._lazy(grad) and grad.data_ptr() not in claimed):
            claimed.add(grad.data_ptr())
            return grad
        return torch.empty(grad.shape, dtype=self.dtype, device=self.device).copy_(grad)


def _validate(where: str, module: object, P: object, op: object, bucket_cap_mb: object) -> list:
    """Check the arguments; return the parameters that take gradients, in module order."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(module).__name__}")
    check_partition(where, "P", P)
    if op not in _OPS:
        raise ValueError(f"{where}: expected op in {list(_OPS)}, got {op!r}")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"{where}: expected a positive bucket_cap_mb, got {bucket_cap_mb!r}")
    return [p for p in module.parameters() if p.requires_grad]  # their dtypes are checked by _plan


def _grad_dtype(p: torch.Tensor) -> torch.dtype:
    """Return the dtype of ``p``'s gradient (``Tensor.grad_dtype`` where set, else ``p``'s dtype)."""
    return getattr(p, "grad_dtype", None) or p.dtype


def _check_dense(where: str, p: torch.Tensor) -> None:
    if p.grad is not None and p.grad.layout != torch.strided:
        raise TypeError(f"{where}: expected dense gradients, got a {p.grad.layout} gradient of shape "
                        f"{tuple(p.shape)}")


def _plan(where: str, params: list, bucket_cap_mb: float) -> list[_Bucket]:
    """Group the parameters, in reverse order, into buckets of one dtype and device up to the cap; a gradient
    of ``IN_PLACE_BYTES`` or more alone. Buckets are ordered by their last member (when backward completes them)."""
    cap = bucket_cap_mb * 2 ** 20
    open_buckets: dict = {}
    closed: list[tuple[int, list, torch.dtype]] = []  # (position of the last member, members, dtype)
    for position, p in enumerate(reversed(params)):
        dtype = transport.reduction_dtype(where, _grad_dtype(p))
        key, nbytes_p = (dtype, p.device), p.numel() * dtype.itemsize
        if nbytes_p >= IN_PLACE_BYTES:
            closed.append((position, [p], dtype))
            continue
        last, members, nbytes = open_buckets.get(key, (position, [], 0))
        if members and nbytes + nbytes_p > cap:
            closed.append((last, members, dtype))
            members, nbytes = [], 0
        open_buckets[key] = (position, members + [p], nbytes + nbytes_p)
    closed += [(last, members, key[0]) for key, (last, members, _) in open_buckets.items()]
    return [_Bucket(members, dtype) for _, members, dtype in sorted(closed, key=lambda c: c[0])]


def _signature(buckets: list[_Bucket], tensors: list[torch.Tensor]) -> int:
    """Return a checksum of the bucket layout (and of ``tensors``' dtypes and shapes)."""
    layout = [(str(b.dtype), [tuple(p.shape) for p in b.params]) for b in buckets]
    layout += [(str(t.dtype), tuple(t.shape)) for t in tensors]
    return zlib.crc32(repr(layout).encode())


def _check_agreement(where: str, P: MPIPartition, tensors, signature: int, problem: str | None = None,
                     misuse: str | None = None, settings: dict | None = None) -> None:
    """Raise on every member if the members' layouts differ (MPI would hang or mix data up; naming the first of
    ``tensors()``, the named tensors the signature covers, whose dtype, shape or kind differs), if a member found a
    ``problem`` with a parameter a layer sums itself (see :func:`_summed_by_layers`; ValueError), a ``misuse``
    (RuntimeError, the message as it is), or if the members' ``settings`` differ (ValueError)."""
    mine = np.array([signature, problem is not None, misuse is not None, zlib.crc32(repr(settings).encode())],
                    dtype=np.int64)
    everyone = np.empty((P.size, 4), dtype=np.int64)
    P.comm.Allgather(mine, everyone)
    found = [int(r) for r in np.flatnonzero(everyone[:, 1])]
    if found:  # every member raises, naming what the first member that found a problem found
        raise ValueError(f"{where}: on P rank {found[0]}, {P.comm.bcast(problem, root=found[0])}")
    found = [int(r) for r in np.flatnonzero(everyone[:, 2])]
    if found:
        raise RuntimeError(P.comm.bcast(misuse, root=found[0]))
    differ = [int(r) for r in np.flatnonzero(everyone[:, 3] != everyone[0, 3])]
    if differ:
        first, other = P.comm.bcast(settings, root=0), P.comm.bcast(settings, root=differ[0])
        raise ValueError(f"{where}: expected the same settings on every worker of P, got {first} on P rank 0 and "
                         f"{other} on P rank {differ[0]}")
    everyone = everyone[:, 0]
    differ = [int(r) for r in np.flatnonzero(everyone != everyone[0])]
    if differ:
        mine = [(name, (str(t.dtype), tuple(t.shape), kind)) for name, t, kind in tensors()]
        first, other = P.comm.bcast(mine, root=0), P.comm.bcast(mine, root=differ[0])
        pair = next(((a, b) for a, b in itertools.zip_longest(first, other) if a is None or b is None or a[1] != b[1]),
                    None)
        name = lambda entry: "nothing" if entry is None else \
            f"{entry[0]} ({entry[1][0]}, shape {entry[1][1]}{entry[1][2]})"
        raise ValueError(f"{where}: expected the same parameters (dtypes, shapes, order) on every worker of P, "
                         f"got a different layout on P ranks {differ} than on P rank 0; " + (
                             f"the first difference: {name(pair[0])} on P rank 0, {name(pair[1])} on P rank "
                             f"{differ[0]}" if pair else "the same tensors in other buckets (another bucket_cap_mb, "
                             "or a layer that sums a parameter over P on some workers only)"))


def _named(module: torch.nn.Module, buffers: bool = True) -> list[tuple[str, torch.Tensor, str]]:
    """Return ``module``'s parameters (frozen ones too: one frozen on some workers only is the difference named)
    and ``buffers`` as (name, tensor, kind) for :func:`_check_agreement`."""
    found = [(n, p, "" if p.requires_grad else ", frozen") for n, p in module.named_parameters()]
    return found + ([(n, b, ", a buffer") for n, b in module.named_buffers()] if buffers else [])


def _summed_by_layers(module: torch.nn.Module, P: MPIPartition) -> tuple[set[int], str | None]:
    """Return the ids of the parameters of ``module`` whose gradients a distdl layer already sums over every member
    of ``P``, and a problem found with one (None if none). Local.

    A distdl layer holds a copy of a parameter's block on each worker of a fibre of its partition and sums the
    copies' gradients over it (the sequential gradient). Where that fibre holds all of ``P`` (a batch norm over
    the batch that ``P`` splits, as torch's SyncBatchNorm), a sum over ``P`` would count each member's part
    ``P.size`` times; where it holds this member of ``P`` only (a layer inside each replica), the sum over ``P``
    is the data-parallel one. A problem: a fibre holding some members of ``P`` but not all, or a parameter summed
    by its layer that another module holds too, one that does not sum it over ``P`` (tied to a plain torch module:
    the gradient from that use is not summed; tied to another distdl layer summing it alike, both uses are).
    """
    if not P.active or P.size == 1:
        return set(), None
    members = frozenset(P.root_ranks)

    def copies(m: torch.nn.Module, layout: StateLayout | None) -> frozenset[int]:
        """The members of P holding copies of the block of a parameter that layer ``m`` sums (none: ``m`` sums
        nothing)."""
        if not isinstance(m, CollectStateMixin) or not m._state_partition().active:
            return frozenset()
        return block_holders(m._state_partition(), layout.axes, P)

    # a distdl layer holds its parameters, also those torch.nn.utils.parametrize moved into its parametrizations
    moved = {id(holder) for m in module.modules() if isinstance(m, CollectStateMixin)
             for holder in getattr(m, "parametrizations", {}).values()}
    holders: dict[int, list] = {}  # id(p) -> every (module, layout) holding p
    for m in module.modules():
        if id(m) not in moved:
            for _, p, layout in parameter_layouts(m):
                holders.setdefault(id(p), []).append((m, layout))
    summed, problem = set(), None
    for prefix, m in module.named_modules():
        if not isinstance(m, CollectStateMixin) or not m._state_partition().active:
            continue
        for name, p, layout in m._parameter_layouts():
            if not p.requires_grad:  # not reduced: frozen, its copies need no sum
                continue
            held = copies(m, layout)
            what = f"{prefix + '.' if prefix else ''}{name} ({type(m).__name__})"
            if held == members and any(copies(other, theirs) != members for other, theirs in holders[id(p)]):
                problem = problem or (f"{what} is summed over P by its layer and held by another module too (tied) "
                                      "that does not sum it over P: the gradient of the other use would not be "
                                      "summed; untie it, or wrap over workers whose layers hold separate copies "
                                      "(the data-parallel fibre)")
            elif held == members:
                summed.add(id(p))
            elif len(held) > 1:
                problem = problem or (f"{what} is summed by its layer over some members of P but not all (they "
                                      "would be summed again); wrap over workers whose layers hold separate copies "
                                      "(the data-parallel fibre), or over all that hold one")
    return summed, problem


def _communicator(P: MPIPartition) -> MPI.Comm:
    """Return a communicator over P's members used only for gradients (built once per partition)."""
    return P._memo(("data_parallel",), lambda: P.create_partition_inclusive(range(P.size))).comm
