"""What one rank contributes to a checkpoint: its shards as `Pieces` of global tensors.

Every key is a name of the unmodified model at its global shape:

    params/<name>            the parameter
    optim/<name>/<state>     its optimizer state at the parameter's shape
                             (AdamW exp_avg, exp_avg_sq; SGD momentum_buffer),
                             optim/<name>/step a scalar

A rank's pieces of a parameter follow from how the plan cut it:

* whole (pp, dp replicas): one piece at offset 0 (replicas write it once: DCP
  keeps one copy of equal chunks);
* a TP slice: one piece, offset rank·⌈n/tp⌉ on its split dim (backends/parallel/tp/params.py);
  a fused projection split part by part (backends/parallel/tp/fused.py): one piece per
  part, rank r's 1/tp of each at its place in the model's own layout;
* an expert block: one piece, offset first-expert on dim 0 (expert_parallel.py);
* under ZeRO: the part of the above in this rank's flat range of its shard
  (zero.py), cut into rectangles (`flat_boxes`); values and optimizer states
  are views of the flat shard and of the optimizer's state of it.

Under DiLoCo (islands.py) the params/ and optim/ keys carry the island's prefix,
`island<d>/params/<name>`, and the outer state shared by the islands is added.

A name held by stages on several pipeline ranks (a tied weight) is written
only by the rank of the first stage holding it, so each key has one layout.
Loading fills the same views, so any plan's pieces read any plan's checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ....compiler.compiled import CompiledPlan
from .pieces import Pieces, flat_boxes


def parameter_shapes(compiled: CompiledPlan) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """(name -> global shape, name -> first stage holding it) over the whole model.

    Call before the stage rewrites (TP/EP replace parameters by their shards)."""
    shapes: dict[str, tuple[int, ...]] = {}
    first: dict[str, int] = {}
    for st in sorted(compiled.stages, key=lambda s: s.index):
        for name, p in st.module.named_parameters(remove_duplicate=False):
            shapes.setdefault(name, tuple(p.shape))
            first.setdefault(name, st.index)
    return shapes, first


@dataclass
class Placed:
    """One parameter object of this rank: its names, global shape and where its local
    tensor sits in the global one."""

    param: nn.Parameter
    names: list[str]  # every name it has on this rank, first stage first
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    written: list[str]  # the names this rank writes (it holds their first stage)
    rows: tuple = ()  # a fused TP shard: (local row, global row, rows) per part, on `dim`
    dim: int = 0  # the dim a fused shard's parts are cut on (1: a weight stored [in, out])

    def place(self, local_offsets, view: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """(global offsets, view) of `view`, which sits at `local_offsets` of the local tensor
        (a box across a fused shard's parts is cut at their edges)."""
        at = tuple(o + l for o, l in zip(self.offset, local_offsets))
        if not self.rows:
            return [(at, view)]
        d = self.dim
        lo, n, out = local_offsets[d], view.shape[d], []
        for local, glob, rows in self.rows:
            a, b = max(lo, local), min(lo + n, local + rows)
            if a < b:
                where = at[:d] + (glob + a - local,) + at[d + 1:]
                out.append((where, view.narrow(d, a - lo, b - a)))
        return out


def placed_parameters(trainer) -> list[Placed]:
    """Every parameter of this rank's stages, placed in the global tensors."""
    from ...parallel.tp import tp_shard_dims
    from ...parallel.tp.fused import SEGMENTS
    from ...parallel.tp.params import shard_offset

    out: dict[int, Placed] = {}
    for s in sorted(trainer.runners):
        module = trainer.runners[s].module
        st = trainer.layout.parallel.get(s)
        dims = tp_shard_dims(module) if st is not None and st.tensor is not None else {}
        fused = getattr(module, SEGMENTS, {}) if dims else {}
        experts = {}
        if st is not None:
            for lname, layer in st.experts.items():
                for pname in layer._parameters:
                    experts[f"{lname}.{pname}"] = layer.shard.first
        for name, p in module.named_parameters(remove_duplicate=False):
            shape = trainer.global_shapes[name]
            offset = [0] * len(shape)
            rows, d = (), dims[name] % len(shape) if name in dims else 0
            if name in fused:
                rows = _fused_rows(fused[name], st.groups.tp)
            elif name in dims:
                offset[d] = shard_offset(shape[d], st.groups.tp)
            if name in experts:
                offset[0] = experts[name]
            entry = out.setdefault(id(p), Placed(p, [], shape, tuple(offset), [], rows, d))
            if name not in entry.names:
                entry.names.append(name)
                if trainer.first_stage[name] == s:
                    entry.written.append(name)
    return list(out.values())


def _fused_rows(segments, group) -> tuple:
    """(local row, global row, rows) of each part of a fused shard (fused.pieces' layout)."""
    import torch.distributed as dist

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    out, local = [], 0
    for start, length in segments:
        out.append((local, start + rank * (length // tp), length // tp))
        local += length // tp
    return tuple(out)


def empty_optimizer_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """The state tensors the optimizer will hold for p, zero (as before its first step)."""
    if isinstance(optimizer, torch.optim.AdamW):
        return {"step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("momentum", 0):
        return {"momentum_buffer": torch.zeros_like(p)}
    return {}


def _states(optimizer, holder: torch.Tensor) -> dict[str, torch.Tensor]:
    """The optimizer's state of `holder`, created zero where missing (a parameter that got
    no gradient yet steps as from a fresh state: the same update)."""
    if optimizer is None:
        return {}
    state = optimizer.state[holder]
    if not state:
        state.update(empty_optimizer_state(optimizer, holder))
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def _add(out: dict, key: str, pl: Placed, local_offsets, view: torch.Tensor) -> None:
    """`view` at `local_offsets` of pl's local tensor, under `key`; a scalar (an AdamW step)
    is a key of shape ()."""
    if view.dim() == 0:
        out.setdefault(key, Pieces((), view.dtype)).add((), view)
        return
    pieces = out.setdefault(key, Pieces(pl.shape, view.dtype))
    for at, part in pl.place(local_offsets, view):
        pieces.add(at, part)


def rank_pieces(trainer, names: str = "written", with_optimizer: bool = True) -> dict[str, Pieces]:
    """This rank's pieces of every key it saves (`names="written"`) or loads (`"first"`:
    each parameter under its first name here)."""
    out: dict[str, Pieces] = {}
    optimizer = trainer.optimizer if with_optimizer else None
    island = island_prefix(trainer)
    flat = {}  # id(param) -> (FlatShard, offset in its buffer)
    if trainer.zero is not None:
        for fs in trainer.zero.optimizer.shards:
            for p, off in zip(fs.params, fs.layout.offsets):
                flat[id(p)] = (fs, off)
    for pl in placed_parameters(trainer):
        keys = pl.written if names == "written" else pl.names[:1]
        if id(pl.param) in flat:  # the part of the parameter in this rank's flat range
            fs, off = flat[id(pl.param)]
            start, stop = fs.layout.shard_range(fs.rank)
            lo, hi = max(off, start) - off, min(off + pl.param.numel(), stop) - off
            boxes = flat_boxes(tuple(pl.param.shape), lo, hi)
            sources = [(island + "params/{}", fs.shard.data)] + [
                (f"{island}optim/{{}}/{k}", v) for k, v in _states(optimizer, fs.shard).items()]
            for name in keys:
                for pattern, src in sources:
                    if src.dim() == 0:
                        _add(out, pattern.format(name), pl, (), src)
                        continue
                    for box in boxes:
                        view = src[off + box.lo - start:off + box.hi - start].view(box.sizes)
                        _add(out, pattern.format(name), pl, box.offsets, view)
            continue
        states = _states(optimizer, pl.param) if pl.param.requires_grad else {}
        zeros = (0,) * pl.param.dim()
        for name in keys:
            _add(out, f"{island}params/{name}", pl, zeros, pl.param.data)
            for k, v in states.items():
                _add(out, f"{island}optim/{name}/{k}", pl, zeros, v)
    if getattr(trainer, "diloco", None) is not None:
        from .islands import diloco_pieces

        out.update(diloco_pieces(trainer, placed_parameters(trainer), names))
    return out


def island_prefix(trainer) -> str:
    """DiLoCo: the islands hold different parameters and inner optimizer states between
    syncs, so each island's are kept apart (`island<d>/params/...`); "" otherwise."""
    return f"island{trainer.topo.coords.dp}/" if getattr(trainer, "diloco", None) else ""


def after_load(trainer) -> None:
    """ZeRO 1-2: every rank's loaded slice back into everyone's full buffer (stage 3
    gathers at use)."""
    if trainer.zero is None:
        return
    for fs in trainer.zero.optimizer.shards:
        fs.after_step()
