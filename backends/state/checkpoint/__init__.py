"""Sharded checkpoints for every plan, with torch.distributed.checkpoint (DCP).

    DIR/step_000010/
        .metadata, __*_*.distcp   DCP: every key's chunks (offsets, sizes) and their bytes
        manifest.json             what it came from (manifest.py): plan hash, mesh, optimizer,
                                  parameter names and global shapes, step, data position, lr

Keys are the unmodified model's parameter names at their global shapes, so a
checkpoint does not depend on the plan that wrote it:

    params/<name>             the parameter
    optim/<name>/<state>      its optimizer state (AdamW: step, exp_avg, exp_avg_sq;
                              SGD with momentum: momentum_buffer)
    step                      optimizer steps done (also the data position: step t's
                              batch is a function of t; the LR schedule replays to it)
    rng/<rank>/cpu            each rank's RNG state (restored under the same plan only)

Each rank writes only what it holds (state.py): whole parameters, TP slices,
expert blocks (experts by global index: one stacked tensor per expert weight,
sharded on dim 0), or under ZeRO its flat range of them, with the optimizer
state in the same layout (pieces.py: rectangles DCP stores with their global
offsets; replicas are written once). Loading asks for this rank's pieces
under the new plan, and DCP reads whatever saved chunks overlap them: any
change of pp, dp, tp, ep, zero stage, schedule, virtual stages or split
reshards on load. What cannot carry over (the optimizer kind, a parameter
missing or of another shape) is refused before launch (manifest.py), with
the choices: `--reset-optimizer` (weights only), or start fresh.

    state.py     this rank's pieces of every key (the concept; read it first)
    pieces.py    pieces as DCP chunks: the hooks and planners, flat-range rectangles
    islands.py   DiLoCo: each island's keys apart (`island<d>/params/...`), the outer state shared
    manifest.py  manifest.json and what a plan can load of it
    store.py     save (atomic: tmp folder, barrier, rename by rank 0), load, the newest;
                 decoupled DiLoCo: one series per island, DIR/island<d>/step_N
"""
from .manifest import check_loadable, read_manifest
from .state import parameter_shapes
from .store import Checkpointer, checkpoint_folder, latest_step, step_dir

__all__ = ["Checkpointer", "check_loadable", "checkpoint_folder", "latest_step",
           "parameter_shapes", "read_manifest", "step_dir"]
