"""``collect_state``: save and load a distributed layer's state as the sequential layer's.

A layer that mixes in :class:`CollectStateMixin` and is built with ``collect_state=True``:

- ``state_dict()`` (collective over the root partition: every worker calls it) returns on rank 0 of the root partition
  (the one every partition derives from; usually the world's) the same keys and *global* shapes as
  the equivalent torch layer; on every other worker this layer's keys are omitted. Where the
  layer's partition leaves that worker out, its own rank 0 collects the state and hands it over.
  Split tensors, and every tensor handed over from another worker, come back as new tensors, with
  ``keep_vars=True`` too (not the parameters).
- ``load_state_dict()`` (collective over the root partition too) takes the values of rank 0 of the root
  partition (handed to the layer's rank 0 where that is another worker), checks their global shapes
  and sends each worker its block; the other workers may pass the same dict or one without these
  keys (no missing-key error). That holds for such layers' keys only: plain torch modules in the model
  load each worker's own dict, as in torch, so a dict on rank 0 alone leaves them missing on the others
  (an error there; with ``strict=False``, their replicas silently keep their own values). Load the file on
  every worker (``torch.load(path)``), or broadcast it (``comm.bcast(state, root=0)``), and pass it
  everywhere. Workers outside the partition keep their (unused) values. Strict
  loading still reports missing and unexpected keys and wrong global shapes, as found in the dict that
  decided: on every member, and on rank 0 of the root where the partition leaves it out (the other
  workers outside the partition report nothing about this layer's keys).
  Load pre-hooks on the layer (``register_load_state_dict_pre_hook``) run first, on each worker's own dict,
  so they see the checkpoint's global entries, as on torch's layer.
- The layer's partition must be one every worker knows: a partition made by ``create_subpartition``
  (each worker's own sub-grid) raises ValueError on every worker; use ``collect_state=False`` there.
- Call both on every worker: ``state = model.state_dict()`` everywhere, then
  ``if rank == 0: torch.save(state, path)``. Either call on rank 0 alone waits forever for the others;
  in check mode (``DISTDL_CHECK=1``) it raises CollectiveTimeoutError naming the call instead. Make the calls
  of several models in the same order on every worker: check mode names layers of another type, partition or
  split layout paired up, but two models of the same architecture would exchange their states silently.
- Save state dicts, not modules: ``torch.save(model, path)`` (pickling the module) raises TypeError, since a
  partition holds an MPI communicator; build the model again where the state is loaded.

How a tensor is laid out is a :class:`StateLayout`: by default every parameter and persistent
buffer is replicated on every worker; a layer with split tensors returns a layout per name
from ``_state_layouts()`` (balanced blocks along partition axes), or a subclass of
:class:`StateLayout` for any other layout. With ``collect_state=False`` the state dict holds
each worker's own local tensors (one checkpoint per worker).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from distdl.checks import check_mode, checksum, verify
from distdl.functional.all_sum_reduce import fibre
from distdl.partition import MPIPartition
from distdl.utilities.slicing import compute_start_index, compute_subshape

__all__ = ["StateLayout", "CollectStateMixin"]


class StateLayout:
    """A tensor of ``global_shape`` whose dim ``d`` is split in balanced blocks along partition axis
    ``axes[d]`` (``None``: not split); replicated over the partition axes not listed, except along ``first``,
    where only the workers at index 0 hold it (a bias held by column 0 of ``P_w``)."""

    def __init__(self, global_shape: Sequence[int], axes: Sequence[int | None] | None = None,
                 first: Sequence[int] = ()) -> None:
        self.global_shape = tuple(int(n) for n in global_shape)
        self.axes = tuple(axes) if axes is not None else (None,) * len(self.global_shape)
        self.first = tuple(first)

    @property
    def replicated(self) -> bool:
        return all(a is None for a in self.axes)

    def _grid(self, P_shape: Sequence[int], index: Sequence[int]) -> tuple[list[int], list[int]]:
        return ([1 if a is None else P_shape[a] for a in self.axes],
                [0 if a is None else index[a] for a in self.axes])

    def holds(self, index: Sequence[int]) -> bool:
        """Return whether the worker at ``index`` sends its block when gathering (one copy of each)."""
        return all(i == 0 for a, i in enumerate(index) if a not in self.axes)

    def block(self, x_global: torch.Tensor, P_shape: Sequence[int], index: Sequence[int]) -> torch.Tensor:
        """Return the block of ``x_global`` held by the worker at ``index``."""
        if not self.axes:
            return x_global.clone()
        grid, at = self._grid(P_shape, index)
        start = compute_start_index(grid, at, self.global_shape)
        size = compute_subshape(grid, at, self.global_shape)
        return x_global[tuple(slice(a, a + n) for a, n in zip(start, size))].clone()

    def assemble(self, blocks: dict[tuple[int, ...], torch.Tensor], P_shape: Sequence[int]) -> torch.Tensor:
        """Return the global tensor from the blocks of the holders, keyed by partition index."""
        some = next(iter(blocks.values()))
        out = some.new_empty(self.global_shape)
        for index, block in blocks.items():
            grid, at = self._grid(P_shape, index)
            start = compute_start_index(grid, at, self.global_shape) if self.axes else ()
            out[tuple(slice(a, a + n) for a, n in zip(start, block.shape))] = block
        return out


def check_unparametrized(where: str, module: torch.nn.Module) -> None:
    """Raise ValueError for a distdl layer whose parameters torch.nn.utils.parametrize has moved: their blocks'
    layouts are known by the parameters' names, so the blocks under the new names could not be gathered or
    counted once (they were taken for replicated copies, silently)."""
    if not isinstance(module, CollectStateMixin):
        return
    if torch.nn.utils.parametrize.is_parametrized(module):
        raise ValueError(f"{where}: expected no torch.nn.utils.parametrize parametrization (weight_norm, "
                         f"spectral_norm...) on a distdl layer's parameters, got one on {type(module).__name__}")
    split = module._state_layouts()
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, SpectralNorm) and hook.name in split:  # its power iteration's vectors are the block's
            raise ValueError(f"{where}: expected no torch.nn.utils.spectral_norm on a tensor a distdl layer splits, "
                             f"got one on {hook.name} of {type(module).__name__}")


def check_materialised(where: str, module: torch.nn.Module) -> None:
    """Raise TypeError where one of ``module``'s own parameters or buffers is on the meta device (no values: a layer
    built there and not materialised since; it failed in torch, on some workers only, or ran on). Empty ones too,
    as every worker decides alike (its blocks may be empty where the others' are not)."""
    for name, t in itertools.chain(module._parameters.items(), module._buffers.items()):
        if t is not None and t.is_meta:
            raise TypeError(f"{where}: expected parameters and buffers with values, got {name} on the meta device; "
                            "materialise the module first (module.to_empty(device=...), then reset_parameters())")


def parameter_layouts(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, StateLayout | None]]:
    """Return the parameters ``module`` holds itself, by name, with their layouts: a distdl layer's (see
    :meth:`CollectStateMixin._parameter_layouts`), or another module's with None (it sums nothing)."""
    if isinstance(module, CollectStateMixin):
        return module._parameter_layouts()
    return [(name, p, None) for name, p in module.named_parameters(recurse=False)]


def block_holders(P_layer: MPIPartition, split: tuple[int | None, ...], P: MPIPartition) -> frozenset[int]:
    """Return the root ranks of the members of ``P`` that hold copies of this member's block of a tensor of
    ``P_layer`` split along its partition axes ``split`` (the fibre of the other axes; built once per partition)."""
    def build() -> list[int]:
        return [P_layer.root_ranks[r] for r in range(P_layer.size)
                if all(i == j for a, (i, j) in enumerate(zip(P_layer.cartesian_index(r), P_layer.index)) if a in split)]
    ranks = P_layer._memo(("block_holders", split), build)
    if P_layer._root is not P._root:  # partitions derived from roots of one communicator share its duplicate
        mine, theirs = P_layer._root.Get_group(), P._root.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(mine, ranks, theirs)  # MPI.UNDEFINED outside it
        finally:
            mine.Free()
            theirs.Free()
    return frozenset(int(r) for r in ranks) & frozenset(P.root_ranks)


class CollectStateMixin:
    """Give an ``nn.Module`` with ``P_x`` and ``collect_state`` attributes a sequential-layer state dict.

    Mixing it in also makes the module a distdl layer for :func:`~distdl.nn.clip_grad_norm_`, ``DataParallel`` and
    check mode. To write your own layer with it:

    - List it before ``torch.nn.Module`` among the bases (``class MyLayer(CollectStateMixin, torch.nn.Module)``);
      the other order raises TypeError (its state dict methods would never run).
    - Return the layout of every split parameter and persistent buffer from ``_state_layouts()`` (the others are
      replicated over the partition), and override ``_state_partition()`` where they live on another partition
      than ``P_x`` (as ``DistributedLinear``'s on ``P_w``). A layout with ``first`` (a bias held by index 0 along
      some axes) needs ``_held_elsewhere()`` on the other workers: the names they hold no block of.
    - Sum the gradients of replicated parameters over the partition in the layer itself, as distdl's layers do
      (with the adjoints of the primitives, or ``all_sum_reduce_backward``): ``DataParallel`` and
      ``all_reduce_gradients`` take a distdl layer's parameters as summed already and leave them out of their
      reductions.
    - Call ``self._verify_replicas(name)`` at the start of ``forward`` to have check mode compare the copies of
      replicated parameters and buffers, and the settings ``_replicated_settings()`` returns.
    """

    P_x: MPIPartition
    collect_state: bool

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        order = cls.__mro__
        if torch.nn.Module in order and order.index(torch.nn.Module) < order.index(CollectStateMixin):
            raise TypeError(f"{cls.__name__}: expected CollectStateMixin before torch.nn.Module among the bases, got "
                            f"{[base.__name__ for base in cls.__bases__]} (torch's state dict methods would run "
                            "instead of its own)")

    def _state_partition(self) -> MPIPartition:
        """Return the partition the parameters live on (rank 0 of it holds the collected state)."""
        return self.P_x

    def _state_layouts(self) -> dict[str, StateLayout]:
        """Return the layout of every split tensor by name; the others are replicated."""
        return {}

    def _layouts(self) -> dict[str, StateLayout]:
        """Return :meth:`_state_layouts`, with the names ``torch.nn.utils.prune`` keeps a pruned tensor under (the
        original ``<name>_orig``, a parameter, and ``<name>_mask``, a buffer), each laid out as that tensor, and
        those of the hook-based ``weight_norm`` (``<name>_v`` as that tensor, ``<name>_g`` along its ``dim``) and
        ``spectral_norm`` (``<name>_orig``; see :func:`check_unparametrized` for its vectors)."""
        layouts = self._state_layouts()
        dim = self._state_partition().dim
        for name, layout in layouts.items():  # the same on every worker: wrong ones raise on all
            if len(layout.axes) != len(layout.global_shape) or not all(
                    a is None or 0 <= a < dim for a in layout.axes) or not all(0 <= a < dim for a in layout.first):
                raise ValueError(f"{type(self).__name__}: expected the StateLayout of {name} to give an axis of its "
                                 f"partition (of {dim} axes) or None per dimension of {layout.global_shape}, got "
                                 f"axes {layout.axes} and first {layout.first}")
        for hook in self._forward_pre_hooks.values():
            if isinstance(hook, prune.BasePruningMethod) and hook._tensor_name in layouts:
                name = hook._tensor_name
                layouts[name + "_orig"] = layouts[name + "_mask"] = layouts[name]
            elif isinstance(hook, SpectralNorm) and hook.name in layouts:
                layouts[hook.name + "_orig"] = layouts[hook.name]
            elif isinstance(hook, WeightNorm) and hook.name in layouts:
                layout = layouts[hook.name + "_v"] = layouts[hook.name]
                if hook.dim == -1:  # the norm of the whole tensor, a scalar (torch's reading of -1)
                    layouts[hook.name + "_g"] = StateLayout(())
                else:  # one norm per slice along dim (another negative one counts from the end)
                    keep = [d == hook.dim % len(layout.axes) for d in range(len(layout.axes))]
                    layouts[hook.name + "_g"] = StateLayout([n if k else 1 for n, k in zip(layout.global_shape, keep)],
                                                            [a if k else None for a, k in zip(layout.axes, keep)],
                                                            layout.first)
        return layouts

    def _parameter_layouts(self) -> list[tuple[str, torch.Tensor, StateLayout]]:
        """Return the layer's parameters, by name, with their layouts: its own and, where torch.nn.utils.parametrize
        moved a tensor into ``parametrizations.<name>``, the originals there (laid out as that tensor)."""
        layouts = self._layouts()
        found = [(name, p, layouts.get(name) or StateLayout(p.shape)) for name, p in self._parameters.items()
                 if p is not None]
        for name, holder in getattr(self, "parametrizations", {}).items():
            for original, p in holder.named_parameters(recurse=False):
                found.append((f"parametrizations.{name}.{original}", p, layouts.get(name) or StateLayout(p.shape)))
        return found

    def _collected_on(self, where: str, prefix: str) -> MPIPartition:
        """Return the partition the state is collected from; ValueError (on every worker) where it was made from a
        sub-grid, which is each worker's own and unknown outside its parent: rank 0 of the root could not know
        whose state to take, and sub-grids holding copies of the layer would each hand theirs over."""
        P = self._state_partition()
        if P._fibre is not None:
            raise ValueError(f"{where}: collect_state needs a partition every worker knows, but "
                             f"{type(self).__name__}'s was made by create_subpartition (each worker's own sub-grid); "
                             "build it with create_partition_inclusive and create_cartesian_topology_partition, or "
                             "use collect_state=False")
        # The call is collective over the root partition: in check mode, a worker that skipped it (rank 0 saving
        # alone) is named here, before the exchange below would wait for it forever, and so is a worker calling it
        # on another layer (two models saved in different orders): by type, partition and split tensors' layouts as
        # the layer declares them (the same on every worker, unlike the tensors held, which are empty outside the
        # partition or held by some, and unlike the names pruning adds, on the workers holding a bias only).
        if check_mode():
            layouts = tuple((name, layout.global_shape, layout.axes, layout.first)
                            for name, layout in sorted(self._state_layouts().items()))
            verify(where, P._root, agree={"prefix": prefix, "layer": type(self).__name__,
                                          "partition": (P.root_ranks, P.shape), "state": layouts})
        # Every worker's layer object must be the same layer: a partition chosen per worker (each data-parallel
        # replica's own stage) sent the state to one of the holders only, and the others waited for it forever.
        seen = P._root.allgather((P.root_ranks, P.shape))
        if any(layout != seen[0] for layout in seen):
            other = next(r for r, layout in enumerate(seen) if layout != seen[0])
            raise ValueError(f"{where}: collect_state needs {type(self).__name__} on the same partition on every "
                             f"worker, got workers {list(seen[0][0])} of shape {seen[0][1]} on worker 0 and "
                             f"{list(seen[other][0])} of shape {seen[other][1]} on worker {other} (a partition chosen "
                             "per worker, as a data-parallel replica's own stage: use collect_state=False there; or "
                             "models saved or loaded in different orders on different workers)")
        return P

    def _held_elsewhere(self) -> set[str]:
        """Return the names of the layer's tensors that this worker holds no block of (a bias held by column 0 of
        ``P_w`` only): a state dict's entry for one is another worker's to load."""
        return set()

    def _state_tensors(self) -> dict[str, tuple[torch.Tensor, StateLayout]]:
        layouts = self._layouts()
        tensors = {**self._parameters, **{k: v for k, v in self._buffers.items()
                                          if k not in self._non_persistent_buffers_set}}
        return {name: (t, layouts.get(name) or StateLayout(t.shape)) for name, t in tensors.items() if t is not None}

    def _replicated_settings(self) -> dict[str, object]:
        """Return the settings every worker of the partition must share that no collective of the layer checks (a
        norm's epsilon, its training mode): check mode compares them at each forward."""
        return {}

    def _verify_replicas(self, where: str) -> None:
        """In check mode, verify that the workers holding copies of a parameter or buffer hold equal ones, and that
        every worker of the partition has the same :meth:`_replicated_settings`.

        Every worker of the layer's partition holds a copy of its replicated parameters (a feature
        convolution's kernel, a norm's affine parameters and running statistics, the blocks of a tensor-parallel
        layer along its other axes). A copy changed on some workers only (initialised again, or a state dict
        loaded, under ``if rank == 0``, as DistDL's examples do where a root held the only copy) leaves the copies
        apart and the results wrong. Also refuses (TypeError, in any mode) a layer built on the meta device and not
        materialised since.
        """
        check_materialised(where, self)
        if not check_mode():
            return
        P = self._state_partition()
        if not P.active:
            return
        if settings := self._replicated_settings():
            verify(f"{where} (settings)", P, agree=settings)

        def copied(layout: StateLayout) -> tuple[int, ...]:  # the axes along which workers hold copies of a block
            return tuple(a for a in range(P.dim) if a not in layout.axes + layout.first and P.shape[a] > 1)
        # the fibres of every declared layout, held here or not, so that every worker builds the same ones
        layouts = self._layouts()
        sums = {axes: {} for layout in layouts.values() if (axes := copied(layout))}
        buffers = [(name, t, layouts.get(name) or StateLayout(t.shape)) for name, t in self._buffers.items()
                   if t is not None and name not in self._non_persistent_buffers_set]
        for name, t, layout in self._parameter_layouts() + buffers:
            if axes := copied(layout):
                sums.setdefault(axes, {})[f"the values of {name} (checksum)"] = checksum([t])
        for axes in sorted(sums):
            verify(f"{where} (copies of its parameters and buffers)", fibre(P, axes), agree=sums[axes])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.collect_state:
            return
        check_unparametrized("state_dict", self)
        check_materialised("state_dict", self)
        P, tensors = self._collected_on("state_dict", prefix), self._state_tensors()
        split = {name: entry for name, entry in tensors.items() if not entry[1].replicated}
        pieces = None
        if P.active and split:
            mine = {name: t.detach().cpu() for name, (t, layout) in split.items() if layout.holds(P.index)}
            pieces = P.comm.gather((P.index, mine), root=0)
        keys, holder = [prefix + name for name in tensors], _holder(P)
        if P.rank != 0:
            for key in keys:
                destination.pop(key, None)
            if P._root.rank == 0 and holder not in (None, 0):  # P's rank 0 hands the layer's state over here
                received = P._root.recv(source=holder, tag=_STATE_TAG)
                device = next((t.device for t, _ in tensors.values()), "cpu")  # also for tensors held elsewhere
                destination.update({key: value.to(device) for key, value in received.items()})
            return
        for name, (t, layout) in split.items():
            blocks = {index: held[name] for index, held in pieces if name in held}
            destination[prefix + name] = layout.assemble(blocks, P.shape).to(t.device)
        if holder not in (None, 0):  # the state is saved from rank 0 of the root partition: hand it over
            moved = {key: value for key, value in destination.items() if key in keys}
            P._root.send({key: value.detach().cpu() for key, value in moved.items()}, dest=0, tag=_STATE_TAG)
            for key in moved:
                del destination[key]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        reports = (missing_keys, unexpected_keys, error_msgs)
        found = [len(report) for report in reports]  # what this layer adds to each is reported below
        P, hooks = None, self._load_state_dict_pre_hooks
        try:
            if self.collect_state:
                # torch runs the layer's load pre-hooks in the call below; they are to see the checkpoint's
                # entries (global tensors, which a hook may rename or convert), not the blocks scattered from them
                for hook in hooks.values():
                    hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
                self._load_state_dict_pre_hooks = {}
                check_unparametrized("load_state_dict", self)
                P = self._collected_on("load_state_dict", prefix)
                self._receive_state(state_dict, prefix)
                self._distribute_state(state_dict, prefix, error_msgs, missing_keys if strict else None)
            for name in self._held_elsewhere():  # not unexpected here: after _receive_state, which may send it on
                state_dict.pop(prefix + name, None)
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            self._load_state_dict_pre_hooks = hooks
        if P is not None:
            self._agree_on_reports(P, reports, found)

    def _agree_on_reports(self, P: MPIPartition, reports: tuple[list, list, list], found: list[int]) -> None:
        """Make this layer's missing keys, unexpected keys and errors those of the layer's rank 0, whose dict
        decided: on every member, and on rank 0 of the root where the partition leaves it out (it read the
        checkpoint); the other workers outside the partition report nothing about this layer's keys."""
        unexpected_keys = reports[1]
        if P.active and P.size > 1:  # the missing keys and errors agree already (_distribute_state)
            unexpected_keys[found[1]:] = P.comm.bcast(unexpected_keys[found[1]:] if P.rank == 0 else None, root=0)
        holder = _holder(P)
        if P.active and P.rank == 0 and 0 not in P.root_ranks:
            P._root.send([report[n:] for report, n in zip(reports, found)], dest=0, tag=_STATE_TAG)
        elif not P.active:
            verdict = P._root.recv(source=holder, tag=_STATE_TAG) if P._root.rank == 0 else [[], [], []]
            for report, n, theirs in zip(reports, found, verdict):
                report[n:] = theirs

    def _receive_state(self, state_dict: dict, prefix: str) -> None:
        """Where rank 0 of the root partition is not rank 0 of the layer's, hand its entries for this layer (it may
        be the only worker given the checkpoint) to the layer's rank 0, whose values then decide."""
        P = self._state_partition()
        holder = _holder(P)
        if holder in (None, 0):
            return
        # this layer's own keys and any others torch would find unexpected here (not its children's)
        own = [key for key in state_dict if key.startswith(prefix)
               and key[len(prefix):].split(".", 1)[0] not in self._modules]
        if P._root.rank == 0:
            P._root.send({key: state_dict[key] for key in own}, dest=holder, tag=_STATE_TAG)
        elif P.rank == 0:
            for key in own:
                del state_dict[key]
            state_dict.update(P._root.recv(source=0, tag=_STATE_TAG))

    def _distribute_state(self, state_dict: dict, prefix: str, error_msgs: list[str],
                          missing_keys: list[str] | None = None) -> None:
        """Replace this layer's entries of ``state_dict`` by this worker's blocks of rank 0's values."""
        P, tensors = self._state_partition(), self._state_tensors()
        if not P.active:  # its own tensors, which no computation reads; off meta, so that assign=True leaves none there
            for name, (t, _) in tensors.items():
                state_dict[prefix + name] = torch.zeros_like(t, device=torch.get_default_device()) if t.is_meta else \
                    t.detach()
            return
        replicated = {name for name, (_, layout) in tensors.items() if layout.replicated}
        checked = summary = None
        if P.rank == 0:  # rank 0 decides for everyone: ("ok", value), ("missing", None) or ("error", message)
            checked = {name: _check_entry(state_dict, prefix + name, layout) for name, (_, layout) in tensors.items()}
            # replicated values travel with the decision; split ones are marked and scattered below
            summary = {name: ("split", None) if entry[0] == "ok" and name not in replicated else entry
                       for name, entry in checked.items()}
        status = P.comm.bcast(summary, root=0)
        if any(entry[0] == "split" for entry in status.values()):
            per_rank = None
            if P.rank == 0:
                per_rank = [{name: tensors[name][1].block(checked[name][1], P.shape, P.cartesian_index(r))
                             for name, entry in status.items() if entry[0] == "split"} for r in range(P.size)]
            status.update({name: ("ok", block) for name, block in P.comm.scatter(per_rank, root=0).items()})
        for name, (t, _) in tensors.items():
            kind, value = status[name]
            if kind == "missing":
                state_dict.pop(prefix + name, None)
            elif kind == "error":
                state_dict[prefix + name] = t.detach()
                error_msgs.append(value)
            elif P.rank != 0 or name not in replicated:
                state_dict[prefix + name] = value
        # Rank 0's tensors that this worker holds no block of (a bias held by column 0 of P_w): their errors and
        # missing keys are every member's too.
        for name, (kind, value) in status.items():
            if name not in tensors and kind == "error":
                error_msgs.append(value)
            elif name not in tensors and kind == "missing" and missing_keys is not None:
                missing_keys.append(prefix + name)


_STATE_TAG = 0x5d2  # a layer's state between rank 0 of the root partition and rank 0 of the layer's


def _holder(P: MPIPartition) -> int | None:
    """Return the root rank of rank 0 of ``P``, which holds a layer's collected state (None where unknown)."""
    return P.root_ranks[0] if P.root_ranks else None


def _check_entry(state_dict: dict, key: str, layout: StateLayout) -> tuple[str, object]:
    if key not in state_dict:
        return ("missing", None)
    value = state_dict[key]
    if not isinstance(value, torch.Tensor):
        return ("error", f'While copying the parameter named "{key}", expected torch.Tensor from checkpoint but '
                         f"received {type(value)}")
    if tuple(value.shape) != layout.global_shape:
        return ("error", f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                         f"checkpoint, the shape in current (global) model is {layout.global_shape}.")
    return ("ok", value.detach().cpu())

