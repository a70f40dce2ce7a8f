"""The runtime side: what runs the compiled plan on torch.distributed.

    runtime/   one rank's training loop: launch, worker, trainer, executor, stages,
               split backward, recompute, gradient sync, data, failures
    parallel/  per-stage parallelism, one subpackage per axis (tp, ep, cp, zero, diloco)
               and the one `parallelize_stage()` that applies them in order
    state/     what outlives a process: checkpoints (DCP), weights in, export, init
    observe/   what a run shows: progress, metrics, measured timings, traces, reports
    verify/    `pipeplan verify`: the pipelined run against the single-process reference

Everything here consumes the CompiledPlan (compiler/); nothing below imports it.
"""
