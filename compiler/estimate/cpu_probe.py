"""The measured CPU device model: what `check`/`compile` assume on a machine without CUDA when
the plan has no `device` section (not a 400 TFLOP/s accelerator).

Microbenchmarks, each on one thread (the local launcher gives each rank one or a few), none of
them a plan's own model or shapes:

* sustained FLOP/s: the best of a few timed float32 matmuls (512 x 512);
* attention: `scaled_dot_product_attention` (causal, 2 x 4 heads, sequence 128) at head
  dimensions 16, 32, 64 and 128: forward FLOP/s and backward/forward time ratio per head
  dimension (a CPU's fused attention runs far below its matmul rate at small heads);
* host time per op and the memory-bound rate: a small model runs op by op, and on a CPU
  each aten op costs dispatch, autograd bookkeeping and allocation on top of its kernel.
  The example GPT's transformer block runs twice, overhead-bound (width 8, FLOPs
  negligible) and kernel-bound (width 32, 128 tokens), the median of 20 runs each, the
  two in turn three times (`probe_blocks`: the median of the three); their
  forward times less their GEMMs and attention give seconds per op (the count the meta
  run takes per node, analysis.py) and seconds per float element the other kernels move
  (`fit_host`; the backward's host time per op by least squares). The element rate comes
  from the difference of two measured times, so it is the probe's noisiest number;
* links: the local launcher's ranks talk through gloo over 127.0.0.1: two processes
  all-reduce 4 KiB and 1 MiB (best of 20 each, back to back) and the slope of the two
  times gives the bandwidth every collective and transfer of the plan is costed at. The
  latency and the CPU are measured as a step meets its collectives and transfers: after
  the group's threads idle (10 ms, an action's length; the two ranks late in turn, the
  median of 16: `_after_idle`). A 2-rank all-reduce is two ring steps (reduce-scatter,
  then all-gather: `ring_steps`), so the latency per message is half the late rank's
  time of a 4 KiB all-reduce (measured here: 0.4-0.5 ms back to back, 0.9-1.5 ms after
  2-20 ms idle: the threads' wake-up and cold caches; until probe v7 the back-to-back
  best was taken); the CPU time of the pair's processes beside the calling threads is
  what gloo's own threads (the process group's workers) spend, which ranks sharing the
  cores pay too: per ring step of the 4 KiB all-reduce (180-190 us after idle, 120-260
  back to back) and per p2p message (70-85 us after idle, 14-30 back to back); and, for
  N > 2 ranks, a pair's 4 KiB all-reduce after idle while N - 2 other processes compute
  (per message: over its two ring steps): with more busy processes than cores a blocked
  peer waits for the scheduler;
* host time per op on DTensors: eager tensor parallelism runs a stage's ops on DTensors
  (backends/parallel/tp/dtensor.py), and each op then also pays DTensor's dispatch
  (sharding propagation, wrapping) on the host. Two gloo processes run transformer blocks
  (layer norm, q/k/v, attention on heads, projection, GELU MLP; width 32, FLOPs small)
  plain and in the TP rewrite's pattern (`_TpBlock`: every parameter wrapped per call,
  column layers' outputs and row layers' inputs sharded, a redistribution at each column
  entry and row output, attention on the local heads); the wraps and redistributions are
  timed in place (a wrap costs ~1.5x in a stage what it does in a tight loop: the caches
  hold the whole stage's code and data there), the rest of the difference per op the
  forward dispatches, forward and backward, the median of 20 runs; and the rest of a
  wrap's round trip (`to_local` and both backwards) beyond a plain tensor's backward;
* the expert dispatcher: an experts call the runtime dispatches runs its own code around
  the model's experts (compiler/parallel/ep_dispatch.routed_call: the slots sorted by
  expert, the counts exchanged, the split sizes read on the host, rows and weights out and
  the terms back through gloo all-to-alls, summed per token) that no stage graph holds.
  Two gloo processes run that function on 128 tokens of width 32, top-2 of 4 experts, with
  a small experts module timed in place (`measure_dispatch`): its thread CPU per call
  beyond the experts' own, forward and backward (the experts' backward alone on the same
  rows subtracted), dropless, with a capacity, and a capacity on one rank; the slower
  process, the median of three pairs;
* sharing (posting and resuming): the local launcher starts every rank on this machine,
  so a rank computes at the speed N processes get together, not at 1/N of one. N
  processes (one thread each) run a pipeline's pattern as the executor runs an action, a
  ring in which each posts the receive of the previous rank's tensor, computes a block
  (width 32) forward and backward, posts the send of a 32 KiB tensor to the next and
  waits for both: the mean CPU time of posting one transfer there is the host work each
  send or receive adds to the action around it (between computes it costs about twice
  what a post in a tight loop does: 85-105 us against 45 here); measured per N (nothing
  for one rank), the median of five runs (`ring_slowdown`). What an action costs beyond
  its own CPU time when its rank resumes on a core another process used meanwhile (caches
  refilled after each blocking handoff) is `measure_resume`'s: two processes pinned to one
  core hand it back and forth, a block right after the other process ran a block against
  one right after its own, alternating, the median over a 1.8 ms host-bound block and a
  4 ms one (0.19-0.42 ms here from probe to probe; until probe v7 the ring's block CPU
  over alone was taken as a
  factor on all compute: 1.0 to 1.4 from one probe to the next, where the example plans'
  actions of 1 to 11 ms measured 0.4-1.1 ms above their CPU alone each). The fair share of
  the cores is waiting, not CPU time: the time model adds it from the simulated timeline
  (device.Sharing).

Rounded to two significant digits and cached per machine and torch version in
~/.cache/pipeplan/cpu_flops.json (PIPEPLAN_CACHE moves it), so every compile on
one machine — `check`, the launcher's precompile, rank 0's compile, whatever
their thread settings — sees the same numbers and the cost-aware schedules stay
deterministic.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import multiprocessing
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import ring_steps
from .devices import DTENSOR_FIELDS  # measure_dtensor's order

N, REPEATS, ROUNDS = 512, 8, 5
WIDTH, TOKENS, BLOCKS = 8, 16, 4  # the op-time probe: FLOPs negligible, ops as a model's
TP_WIDTH, TP_HEADS, DTENSOR_PAIRS = 32, 4, 3  # the DTensor probe's transformer blocks (FLOPs
# small), run by this many pairs of processes
HEAD_DIMS, ATTN_SEQ, ATTN_BH = (16, 32, 64, 128), 128, (2, 4)  # the attention probe
# the sharing probe: one width-32 block of 128 tokens (~1 ms forward and backward here, an
# action's length in the example plans: the shorter the compute between handoffs, the more
# of it goes to refilling caches), 100 rounds; at most 32 ranks probed
CONTENTION_WIDTH, CONTENTION_BLOCKS, CONTENTION_ITERS, MAX_PROCESSES = 32, 1, 100, 32
RING_PAIRS = 5  # the sharing probe's runs (alone, then the n ranks), the median ratio (3 pairs
# gave 1.0 to 1.24 at 4 ranks from one probe to the next here)


@dataclass(frozen=True)
class CpuModel:
    flops_per_s: float
    op_s: float  # host seconds per aten op of a forward
    op_backward_s: float  # host seconds of backward per aten op of the forward
    origin: str
    bytes_per_s: float = 0.0  # memory-bound kernels' effective bandwidth
    link_latency_s: float = 0.0  # gloo between local processes: per message ...
    link_bytes_per_s: float = 0.0  # ... and bandwidth
    post_s: float = 0.0  # host seconds to post one transfer (send or receive), shared
    loaded_latency_s: float = 0.0  # a small collective's seconds with all the ranks busy
    attention: tuple = ()  # ((head dim, forward FLOP/s, backward/forward), ...)
    resume_s: float = 0.0  # an action's CPU beyond its own on a core another process used
    dtensor_op_s: float = 0.0  # host seconds DTensor adds per op of a forward (eager tp) ...
    dtensor_op_backward_s: float = 0.0  # ... and to backward per op of the forward
    dtensor_wrap_s: float = 0.0  # ... per tensor wrapped as a DTensor, forward ...
    dtensor_wrap_backward_s: float = 0.0  # ... and the rest of its round trip
    dtensor_redistribute_s: float = 0.0  # ... per redistribution, beyond its collective
    collective_cpu_s: float = 0.0  # gloo's own threads' CPU per ring step of a collective
    transfer_cpu_s: float = 0.0  # ... and per p2p message (beside the posting thread's)
    split_call_s: float = 0.0  # host seconds per autograd call of a separate W
    optimizer_ops: tuple = ()  # (name, decay, momentum, ops a step, ops per tensor), each
    dispatch_s: tuple = ()  # (case, forward s, backward s): the expert dispatcher per call


def cache_path() -> str:
    base = os.environ.get("PIPEPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "pipeplan")
    return os.path.join(base, "cpu_flops.json")


PROBE_VERSION = 7  # 2: latencies per message (a 2-rank all-reduce is two ring steps);
# 3: contention and posting a transfer measured per rank count in a ring of handoffs;
# 4: gloo's own threads' CPU per collective ring step and per p2p message; the ring's
# block and post CPU as means; 5: DTensor's host time on transformer blocks in the TP
# rewrite's pattern, its parts timed in place; 6: a separate W's autograd calls, the
# optimizers' op counts; 7: the expert dispatcher's host time per experts call; the link's
# latency and gloo's CPU after idle (as a step meets them), not back to back; an action's
# resume on a shared core, per action (the ring's CPU ratio no longer a factor)


def _key() -> str:
    return f"{platform.machine()} {platform.processor() or '-'} {os.cpu_count()} cpus, " \
           f"torch {torch.__version__}, probe v{PROBE_VERSION}"


def _two_digits(x: float) -> float:
    return float(f"{x:.2g}")


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def _best(fn, repeats: int, rounds: int = ROUNDS) -> float:
    """Best mean seconds of one `fn()` over `rounds` rounds of `repeats` calls (after one)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.thread_time() - t) / repeats)
    return max(best, 1e-9)


def measure_flops() -> float:
    """Best sustained one-thread float32 matmul FLOP/s over ROUNDS rounds of REPEATS."""
    def run():
        a, b = torch.randn(N, N), torch.randn(N, N)
        return _best(lambda: a @ b, REPEATS)
    return _two_digits(2 * N ** 3 / _one_thread(run))


def measure_attention() -> tuple:
    """Per head dimension: causal fused attention's forward FLOP/s (counted as torch's flop
    counter does, 4 b h s^2 d) and its backward's time over the forward's."""
    def run():
        out = []
        b, h = ATTN_BH
        for d in HEAD_DIMS:
            q = torch.randn(b, h, ATTN_SEQ, d, requires_grad=True)
            with torch.no_grad():
                fwd = _best(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), 4)

            def both():
                o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
                o.backward(torch.ones_like(o))
            total = _best(both, 2)
            out.append((d, _two_digits(4 * b * h * ATTN_SEQ ** 2 * d / fwd),
                        _two_digits(max(total - fwd, fwd) / fwd)))
        return tuple(out)
    return _one_thread(run)


def _block(width: int, tokens: int, blocks: int):
    from ...examples.models.gpt import Block  # the example models' pre-norm block: their op mix
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(width, 2, 4 * width) for _ in range(blocks)))
    return model, torch.randn(2, tokens, width, requires_grad=True)


@dataclass(frozen=True)
class BlockRun:
    """One probe block: what its forward dispatches (ops, GEMMs, float elements the other
    kernels move; counted as the compiler counts a stage, work.py) and its median one-thread
    CPU seconds forward and backward."""

    ops: int
    gemms: tuple
    elements: float
    forward_s: float
    backward_s: float


def run_block(width: int, tokens: int, blocks: int) -> BlockRun:
    from ..capture.analysis import OpCounter

    def run():
        model, x = _block(width, tokens, blocks)
        with OpCounter() as counted:
            model(x)
        forward_s, backward_s = _typical_forward_backward(model, x)
        log = counted.log
        return BlockRun(counted.count, tuple(log.gemms), log.float_elements, forward_s,
                        backward_s)
    return _one_thread(run)


def fit_host(runs: tuple, flops: float, attention: tuple) -> tuple[float, float, float]:
    """(forward s per op, backward s per op, float elements per s) solving each probe's time
    = its ops x host time per op + its GEMMs and attention at the measured rates (optime.py)
    + its other kernels' float elements over the memory-bound rate: forward on the two
    probes exactly, backward (twice the forward's products and elements, attention at its
    measured ratio) by least squares for its host time per op."""
    from .devices import cpu_profile
    from .optime import attention_backward, gemm_time
    dev = cpu_profile(flops, 0.0, 0.0, 0.0, attention)
    kf = [sum(gemm_time(g, dev, flops, 4) for g in r.gemms) for r in runs]
    kb = [sum(gemm_time(g, dev, flops, 4) * (attention_backward(dev, g.k / 2)
                                                if g.attention else 2) for g in r.gemms)
          for r in runs]
    (small, large), (k0, k1) = runs, kf
    det = small.ops * large.elements - large.ops * small.elements
    per_element = (small.ops * (large.forward_s - k1) - large.ops * (small.forward_s - k0)) / det
    per_element = max(per_element, 1e-12)  # noise: a memory-bound rate of at most 1e12/s
    op_s = max(sum(r.ops * (r.forward_s - k - r.elements * per_element)
                   for r, k in zip(runs, kf)) / sum(r.ops ** 2 for r in runs), 0.0)
    op_b = max(sum(r.ops * (r.backward_s - k - 2 * r.elements * per_element)
                   for r, k in zip(runs, kb)) / sum(r.ops ** 2 for r in runs), 0.0)
    return op_s, op_b, 1.0 / per_element


def _ring_worker(rank: int, port: int, results, n: int) -> None:
    """One of `n` processes in a pipeline's pattern, as the runtime's executor runs an
    action: post the receive of the previous rank's tensor (`batch_isend_irecv`, prefetched
    before the compute), compute a block forward and backward, post the send of a tensor to
    the next rank, wait for both; again and again. Puts the mean of a block's CPU
    seconds on this thread, the median of a round's wall seconds (all n blocks of a round
    must run before the next: n blocks on the machine's cores), and the mean CPU seconds
    of posting one transfer. Alone (n = 1): the same blocks, no group, no transfers."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    if n > 1:
        store = dist.TCPStore("127.0.0.1", port, n, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    try:
        model, x = _block(CONTENTION_WIDTH, 128, CONTENTION_BLOCKS)
        out = torch.zeros(POST_BYTES // 4)
        cpu, wall, posts = [], [], []
        for i in range(CONTENTION_ITERS + 5):  # 5 warm-up rounds
            t, c = time.perf_counter(), time.thread_time()
            works = dist.batch_isend_irecv([dist.P2POp(
                dist.irecv, torch.empty(POST_BYTES // 4), (rank - 1) % n)]) if n > 1 else []
            post = time.thread_time() - c
            c = time.thread_time()
            model(x).sum().backward()
            c = time.thread_time() - c
            if n > 1:
                c1 = time.thread_time()
                works += dist.batch_isend_irecv([dist.P2POp(dist.isend, out, (rank + 1) % n)])
                post += time.thread_time() - c1
                for work in works:
                    work.wait()
            if i >= 5:
                cpu.append(c)
                wall.append(time.perf_counter() - t)
                posts.append(post / 2)
        # means: a total of CPU seconds is what the ranks pay, the preempted blocks'
        # refills included (the median leaves them out: 1.22 against 1.36 at 4 here)
        results.put((statistics.mean(cpu), statistics.median(wall), statistics.mean(posts)))
    finally:
        if n > 1:
            dist.destroy_process_group()


def ring_slowdown(n: int) -> tuple[float, float, float]:
    """When `n` processes run the ring of `_ring_worker` together: a block's CPU seconds and
    a round's wall seconds per process, each over the same for one process alone (the mean
    over the ring's processes), and the mean CPU seconds of posting one transfer; the
    median of RING_PAIRS pairs of runs, each pair alone then together, its ratios from
    the two (the machine's speed moved 15-25% within minutes here, and one run's ratio
    with it: 1.0 to 1.3 at 8 ranks from one run to the next)."""
    def run(k: int) -> tuple[float, float, float]:
        got = _ranks(_ring_worker, k, k)
        return tuple(sum(g[i] for g in got) / k for i in range(3))
    pairs = []
    for _ in range(RING_PAIRS):
        alone, (cpu, wall, post) = run(1), run(n)
        pairs.append((cpu / alone[0], wall / alone[1], post))
    return tuple(statistics.median(p[i] for p in pairs) for i in range(3))


LINK_BYTES = (1 << 12, 1 << 20)  # the link probe's two message sizes
LINK_REPEATS = 20
IDLE_S, IDLE_CALLS = 0.01, 16  # the link probe's latency and gloo CPU: calls after 10 ms idle
POST_BYTES = 1 << 15  # the ring probe's transfers (the runtime posts each as it goes)


def _after_idle(rank: int, call, messages: int) -> tuple[float, float]:
    """(the late rank's wall seconds, the CPU seconds the process's other threads (gloo's)
    spend) per message of `call` in a 2-rank group, made as a step meets its collectives
    and transfers: after IDLE_S with nothing to do (an action, a wait), the two ranks late
    in turn; medians of IDLE_CALLS (back to back, warm, the same calls took a half to a
    third of either here)."""
    import torch.distributed as dist
    walls, behind = [], []
    for i in range(IDLE_CALLS):
        dist.barrier()
        late = i % 2 == rank
        if late:
            time.sleep(IDLE_S)
        own, all_, t = time.thread_time(), time.process_time(), time.perf_counter()
        call()
        wall = time.perf_counter() - t
        behind.append(((time.process_time() - all_) - (time.thread_time() - own)) / messages)
        if late:
            walls.append(wall / messages)
    return statistics.median(walls), statistics.median(behind)


def _link_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        out = []
        for nbytes in LINK_BYTES:
            x = torch.zeros(nbytes // 4)
            dist.all_reduce(x)  # warm-up: the pair's buffers
            best = float("inf")
            for _ in range(LINK_REPEATS):
                dist.barrier()
                t = time.perf_counter()
                dist.all_reduce(x)
                best = min(best, time.perf_counter() - t)
            out.append(best)
        x = torch.zeros(LINK_BYTES[0] // 4)

        def one_way():
            if rank == 0:
                dist.send(x, 1)
            else:
                dist.recv(x, 0)
        step_s, step_behind = _after_idle(rank, lambda: dist.all_reduce(x),
                                          ring_steps("allreduce", 2))
        out += [step_behind, _after_idle(rank, one_way, 1)[1], step_s]
        results.put(out)
    finally:
        dist.destroy_process_group()


def measure_link() -> tuple[float, float, float, float]:
    """(latency s per message, bytes/s) of this machine's gloo transport between two local
    processes (127.0.0.1), and the CPU seconds gloo's own threads spend (the process's CPU
    time beside the calling thread's) per ring step of a small all-reduce and per p2p
    message. A 2-rank all-reduce of n bytes sends n (the ring's 2(n-1)/n) in two ring steps:
    the bandwidth is the slope of its best times at two sizes; the latency and the CPU are
    what a call costs as a step meets it, after its threads idle (`after_idle`: a 4 KiB
    all-reduce's late rank's wall over its two ring steps; back to back, warm, the same
    all-reduce took 0.4-0.5 ms here, after 2 ms idle 0.9-1.3 ms, after 20 ms 0.9-1.5 ms, and
    its process CPU 0.34, 0.42-0.50 and 0.73-0.83 ms)."""
    rows = _pair(_link_worker)
    small, large = (max(r[i] for r in rows) for i in range(2))
    per_byte = max(large - small, 1e-15) / (LINK_BYTES[1] - LINK_BYTES[0])
    behind = statistics.mean(r[2] for r in rows)
    sent = statistics.mean(r[3] for r in rows)
    latency = statistics.mean(r[4] for r in rows)
    return (_two_digits(max(latency, 1e-7)), _two_digits(1 / per_byte),
            _two_digits(max(behind, 0.0)), _two_digits(max(sent, 0.0)))


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_context():
    """How to start probe processes that start a gloo group of their own: forked, unless this
    process is a rank already in a default process group (a fork would inherit it, and its
    `init_process_group` would fail): then fresh interpreters (spawn: a few seconds more,
    once per machine)."""
    import torch.distributed as dist
    fresh = dist.is_available() and dist.is_initialized()
    return multiprocessing.get_context("spawn" if fresh else "fork")


def _ranks(worker, n: int, *args) -> list:
    """What `worker(rank, port, results, *args)` puts, from each of `n` processes (one gloo
    group's ranks; the port is free for its store)."""
    port = _free_port()
    ctx = _group_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, results, *args), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _pair(worker) -> list:
    """What `worker(rank, port, results)` puts, from each of two processes."""
    return _ranks(worker, 2)


class _TpBlock(nn.Module):
    """A pre-norm transformer block (attention on heads, GELU MLP) that runs plain, or in
    the TP rewrite's pattern (backends/parallel/tp/rewrite.py) when handed its hooks:
    `wrap(name, tensor)` every parameter per call, `entry(x)` at each column layer's input
    and `row(y)` at each row layer's output (redistributions to Replicate), `attend` the
    attention core (on the local heads, as dtensor.HeadLocal runs it)."""

    def __init__(self, width: int = TP_WIDTH):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.proj = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.width = width

    def forward(self, x, hooks=None):
        wrap, entry, row, attend = hooks or (
            lambda n, t: t, lambda t: t, lambda t: t, F.scaled_dot_product_attention)
        p = {n: wrap(n, t) for n, t in self.named_parameters()}
        b, s, _ = x.shape
        h = entry(F.layer_norm(x, (self.width,), p["ln1.weight"], p["ln1.bias"]))
        q, k, v = (F.linear(h, p[f"{n}.weight"], p[f"{n}.bias"])
                   .view(b, s, -1, self.width // TP_HEADS).transpose(1, 2) for n in "qkv")
        a = attend(q, k, v).transpose(1, 2).reshape(b, s, -1)
        x = x + row(F.linear(a, p["proj.weight"], p["proj.bias"]))
        h = entry(F.layer_norm(x, (self.width,), p["ln2.weight"], p["ln2.bias"]))
        up = F.gelu(F.linear(h, p["up.weight"], p["up.bias"]))
        return x + row(F.linear(up, p["down.weight"], p["down.bias"]))


def _tp_placement(name: str):
    """The rewrite's placement of a _TpBlock parameter: column layers (q, k, v, up) split
    their outputs (dim 0), row layers (proj, down) their weights' inputs (dim 1)."""
    from torch.distributed.tensor import Replicate, Shard
    module, _, leaf = name.partition(".")
    if module in ("q", "k", "v", "up"):
        return Shard(0)
    return Shard(1) if module in ("proj", "down") and leaf == "weight" else Replicate()


def _typical_forward_backward(model, x) -> tuple[float, float]:
    """Median thread-CPU seconds of forward and of backward (the output summed): a stage's
    typical time, not its best (the best of 20 is 2-4% under the median here)."""
    times = _in_place(lambda y, _: model(y), x, False, {})
    return times["f"], times["b"]


def _dtensor_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ..capture.analysis import OpCounter
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        blocks = nn.ModuleList(_TpBlock() for _ in range(BLOCKS))
        x = torch.randn(2, TOKENS, TP_WIDTH, requires_grad=True)
        spent: dict[str, list] = {"wrap": [0.0, 0], "redistribute": [0.0, 0]}

        def timed(kind, fn):  # thread CPU inside the rewrite's own calls, in place
            def call(*args):
                t = time.thread_time()
                out = fn(*args)
                spent[kind][0] += time.thread_time() - t
                spent[kind][1] += 1
                return out
            return call

        def local_heads(q, k, v):
            out = F.scaled_dot_product_attention(q.to_local(), k.to_local(), v.to_local())
            return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)
        replicate = timed("redistribute", lambda t: t.redistribute(mesh, [Replicate()]))
        hooks = (timed("wrap", lambda n, t: DTensor.from_local(t, mesh, [_tp_placement(n)],
                                                               run_check=False)),
                 replicate, replicate, local_heads)
        wrap_input = timed("wrap", lambda t: DTensor.from_local(t, mesh, [Replicate()],
                                                                run_check=False))

        def stack(y, tp):
            y = wrap_input(y) if tp else y
            for block in blocks:
                y = block(y, hooks if tp else None)
            return y.to_local() if tp else y

        with OpCounter() as counted:
            stack(x, False)
        rows = 2 * BLOCKS  # row outputs: one all-reduce each forward, one column entry's back
        plain, tp = _in_place(stack, x, False, spent), _in_place(stack, x, True, spent)
        reduce = statistics.median(_cpu_of(lambda: dist.all_reduce(torch.ones(
            2, TOKENS, TP_WIDTH))) for _ in range(4 * ROUNDS))
        wrap_s = tp["wrap"][0] / tp["wrap"][1]
        redistribute_s = max(tp["redistribute"][0] - rows * reduce, 0.0) / rows
        op_s = max(tp["f"] - plain["f"] - tp["wrap"][0] - tp["redistribute"][0], 0.0) \
            / counted.count
        # the rest of a wrap's round trip (to_local, both backwards), beyond a plain tensor's
        # backward (paired round by round, the median; it cannot be timed in place)
        t = torch.randn(2, TOKENS, 4 * TP_WIDTH, requires_grad=True)
        trips = []
        for _ in range(2 * ROUNDS + 1):
            plain_backward = _best(lambda: t.sum().backward(), LINK_REPEATS, rounds=1)
            one = _best(lambda: DTensor.from_local(t, mesh, [Replicate()], run_check=False),
                        LINK_REPEATS, rounds=1)
            trip = _best(lambda: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                         .to_local().sum().backward(), LINK_REPEATS, rounds=1)
            trips.append(trip - plain_backward - one)
        wrap_back = max(statistics.median(trips), 0.0)
        op_b = max(tp["b"] - plain["b"] - tp["wrap"][1] * wrap_back
                   - rows * (redistribute_s + reduce), 0.0) / counted.count
        results.put((op_s, op_b, wrap_s, wrap_back, redistribute_s))
    finally:
        dist.destroy_process_group()


def _cpu_of(fn) -> float:
    """Thread CPU seconds of one `fn()`."""
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def _in_place(stack, x, tp: bool, spent: dict) -> dict:
    """Median thread-CPU seconds of `stack(x, tp)`'s forward ("f") and backward ("b", the
    output summed) over 4 x ROUNDS runs (after ROUNDS: the allocator's caches, lazy
    initialisation), and per kind in `spent` (which `stack`'s timed calls add to) the
    median seconds and calls of its forward: its parts timed where the stage runs them."""
    for _ in range(ROUNDS):
        stack(x, tp).sum().backward()
    runs = []
    for _ in range(4 * ROUNDS):
        for v in spent.values():
            v[:] = [0.0, 0]
        t = time.thread_time()
        out = stack(x, tp)
        t1 = time.thread_time()
        parts = {k: tuple(v) for k, v in spent.items()}
        out.sum().backward()
        runs.append((t1 - t, time.thread_time() - t1, parts))
    out = {"f": statistics.median(r[0] for r in runs), "b": statistics.median(r[1] for r in runs)}
    for k in spent:
        out[k] = (statistics.median(r[2][k][0] for r in runs), runs[0][2][k][1])
    return out


def count_optimizer_ops() -> list:
    """[name, weight decay on, momentum on, aten ops a step, ops per tensor] of torch's
    single-tensor AdamW and SGD (foreach off, as backends/runtime/optim.py builds them) in a
    step after the first (its state made), counted on 4 and on 8 tensors of 8 elements (the
    count does not depend on their size). A count, not a time: the same on every machine
    with this torch; cached with the probe (making an optimizer imports torch._dynamo,
    which a rank's compile would otherwise pay)."""
    from ..capture.analysis import OpCounter

    def count(name: str, decay: bool, momentum: bool, tensors: int) -> int:
        params = [nn.Parameter(torch.ones(8)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.ones(8)
        wd = 0.1 if decay else 0.0
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9 if momentum else 0.0,
                              weight_decay=wd, foreach=False) if name == "sgd" else \
            torch.optim.AdamW(params, lr=1e-3, weight_decay=wd, foreach=False)
        opt.step()
        with OpCounter() as counted:
            opt.step()
        return counted.count
    out = []
    for name, decay, momentum in (("adamw", False, False), ("adamw", True, False),
                                  ("sgd", False, False), ("sgd", True, False),
                                  ("sgd", False, True), ("sgd", True, True)):
        four, eight = (count(name, decay, momentum, n) for n in (4, 8))
        per = (eight - four) // 4
        out.append([name, decay, momentum, four - 4 * per, per])
    return out


SPLIT_RUNS = 3  # measure_split's runs, the median (the first of a process ran ~2x the rest)


def measure_split() -> float:
    """Host seconds per autograd call of a separate W beyond the fused backward (the
    runtime's split, backends/runtime/split_backward.py: B saves each weight-using op's
    incoming gradient in a pre-hook, W makes one autograd call per such op from it to its
    parameters). The overhead-bound probe blocks run forward then the fused backward, and
    forward then B (to the input, the pre-hooks on each parameter-owning module's output
    node) and W (a call per module); (B + W - BW) over the calls, medians of 4 x ROUNDS runs
    after ROUNDS, the median of SPLIT_RUNS such runs. The per-op host time of the fused
    backward is in op_backward_s."""
    from torch.autograd.graph import GradientEdge

    def run():
        model, x = _block(WIDTH, TOKENS, BLOCKS)
        owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        outs: dict = {}
        for m in owners:
            m.register_forward_hook(lambda m, _, o: outs.__setitem__(m, o))
        grad = torch.randn(x.shape)

        def split():
            y = model(x)
            t = time.thread_time()
            saved: dict = {}
            nodes = [(outs[m].grad_fn, list(m.parameters(recurse=False))) for m in owners]
            hooks = [n.register_prehook(lambda g, n=n: saved.__setitem__(n, g))
                     for n, _ in nodes]
            torch.autograd.grad(y, x, grad, retain_graph=True)
            for h in hooks:
                h.remove()
            for n, params in nodes:
                torch.autograd.backward([GradientEdge(n, 0)], [saved[n][0]], inputs=params,
                                        retain_graph=True)
            return time.thread_time() - t

        def backward_of_fused():
            y = model(x)
            return _cpu_of(lambda: torch.autograd.backward(y, grad))

        for _ in range(ROUNDS):
            split()
            backward_of_fused()
        pairs = [(split(), backward_of_fused()) for _ in range(4 * ROUNDS)]
        extra = statistics.median(s for s, _ in pairs) - statistics.median(b for _, b in pairs)
        return max(extra, 1e-7 * len(owners)) / len(owners)  # a cached 0 would re-measure
    return _two_digits(statistics.median(_one_thread(run) for _ in range(SPLIT_RUNS)))


def measure_dtensor() -> tuple[float, ...]:
    """Host seconds DTensor adds in eager tensor parallelism, from two gloo processes (the
    slower process's numbers; the median of DTENSOR_PAIRS pairs run one after another: one
    pair's numbers all moved 10-40% together here when something else ran meanwhile), on
    transformer blocks in the rewrite's pattern (_TpBlock):
    per op of a forward, forward and backward, beyond the plain blocks' (its parts timed
    in place taken out); per tensor wrapped, forward (in place) and the rest of its round
    trip; per redistribution beyond its collective (in place: a row output's all-reduce
    and the next column entry's)."""
    pairs = [[max(t) for t in zip(*_pair(_dtensor_worker))] for _ in range(DTENSOR_PAIRS)]
    return tuple(_two_digits(max(statistics.median(t), 1e-7)) for t in zip(*pairs))


# the dispatcher probe: 128 tokens of width 32 routed top-2 over 4 experts (2 a rank), the
# slower of two processes; DISPATCH_PAIRS pairs one after another, the median
DISPATCH_TOKENS, DISPATCH_EXPERTS, DISPATCH_TOP_K, DISPATCH_PAIRS = 128, 4, 2, 3
DISPATCH_CAPACITY = 1.0  # the capacity probed (experts.capacity_factor; policy "probs")
DISPATCHES = ("ep", "ep_capacity", "capacity")  # DeviceProfile.dispatch_s's order


class _ProbeExperts(nn.Module):
    """An experts module of the MoE interface, small: each routed row times one matrix, by
    its weight (the probe subtracts what it costs; the dispatcher around it is measured)."""

    def __init__(self, width: int = TP_WIDTH):
        super().__init__()
        self.w = nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, rows, index, weights):
        return (rows @ self.w) * weights.to(rows.dtype)


def _dispatch_cost(local, shard, group, capacity) -> tuple[float, float]:
    """Median thread-CPU seconds (forward, backward) one routed experts call adds beyond its
    experts' own ops: the call's forward less `local`'s timed in place, its backward less
    the backward of `local` alone on the same rows."""
    from ..parallel.ep_dispatch import routed_call
    spent = [0.0]

    def timed(rows, index, weights):
        t = time.thread_time()
        out = local(rows, index, weights)
        spent[0] += time.thread_time() - t
        seen.append((rows.detach(), index, weights.detach()))
        return out
    hidden = torch.randn(DISPATCH_TOKENS, TP_WIDTH, requires_grad=True)
    logits = torch.randn(DISPATCH_TOKENS, DISPATCH_EXPERTS, requires_grad=True)
    seen: list = []

    def once():
        spent[0] = 0.0
        seen.clear()
        top_w, top_i = logits.softmax(-1).topk(DISPATCH_TOP_K, -1)
        t = time.thread_time()
        out = routed_call(timed, shard, group, hidden, top_i, top_w, capacity)
        forward = time.thread_time() - t - spent[0]
        backward = _cpu_of(lambda: out.sum().backward())
        rows, index, weights = seen[0]
        rows.requires_grad_(), weights.requires_grad_()
        alone = local(rows, index, weights)
        return forward, backward - _cpu_of(lambda: alone.sum().backward())
    for _ in range(ROUNDS):
        once()
    runs = [once() for _ in range(4 * ROUNDS)]
    return statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs)


def _dispatch_worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    from ..parallel.ep import ExpertShard
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        local, both = _ProbeExperts(), dist.group.WORLD
        pair = ExpertShard(DISPATCH_EXPERTS, 2, rank)
        results.put((*_dispatch_cost(local, pair, both, None),
                     *_dispatch_cost(local, pair, both, DISPATCH_CAPACITY),
                     *_dispatch_cost(local, ExpertShard(DISPATCH_EXPERTS, 1, 0), None,
                                     DISPATCH_CAPACITY)))
    finally:
        dist.destroy_process_group()


def measure_dispatch() -> list:
    """Host seconds the expert dispatcher (compiler/parallel/ep_dispatch.routed_call, the
    runtime's own: slots sorted by expert, the counts exchanged, the split sizes read, the
    rows and weights sent and the terms back through gloo all-to-alls, summed per token)
    adds to one experts call beyond the experts' own ops, forward and backward: [[name,
    forward s, backward s], ...] for DISPATCHES: expert parallel over 2 ranks, dropless
    and with a capacity, and a capacity on one rank (no all-to-all). Its all-to-alls'
    bytes and latencies are charged apart (predict.action_costs); thread CPU here, so a
    blocked all-to-all's wait is not in it. The slower process of a pair, the median of
    DISPATCH_PAIRS pairs."""
    pairs = [[max(t) for t in zip(*_pair(_dispatch_worker))] for _ in range(DISPATCH_PAIRS)]
    med = [_two_digits(max(statistics.median(t), 1e-7)) for t in zip(*pairs)]
    return [[name, med[2 * i], med[2 * i + 1]] for i, name in enumerate(DISPATCHES)]


def _spinner(stop, ready) -> None:
    torch.set_num_threads(1)
    model, x = _block(CONTENTION_WIDTH, 128, 2)
    model(x).sum().backward()
    ready.wait()  # every spinner busy before the pair measures
    while not stop.is_set():
        model(x).sum().backward()


def _loaded_pair(rank: int, port: int, results, ready) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        x = torch.zeros(LINK_BYTES[0] // 4)
        dist.all_reduce(x)
        ready.wait()
        results.put(_after_idle(rank, lambda: dist.all_reduce(x), 1)[0])
    finally:
        dist.destroy_process_group()


def measure_loaded_latency(n: int) -> float:
    """Seconds per message (of its two ring steps) a small (4 KiB) 2-rank gloo all-reduce takes
    after its threads idle (`_after_idle`), while n - 2 other processes compute: with more busy
    processes than cores a blocked peer waits for the scheduler, and that wait, not the
    wire, is what a collective costs then."""
    port = _free_port()
    ctx = _group_context()
    stop, results, ready = ctx.Event(), ctx.Queue(), ctx.Barrier(n)
    spin = [ctx.Process(target=_spinner, args=(stop, ready), daemon=True) for _ in range(n - 2)]
    pair = [ctx.Process(target=_loaded_pair, args=(r, port, results, ready), daemon=True)
            for r in range(2)]
    for p in spin + pair:
        p.start()
    try:
        seconds = max(results.get(timeout=300) for _ in pair) / ring_steps("allreduce", 2)
    finally:
        stop.set()
        for p in pair + spin:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return _two_digits(seconds)


# the resume probe: two processes on one core hand it back and forth; a block after the
# other ran on the core against one right after its own, RESUME_ROUNDS rounds alternating
# (drift hits both alike); RESUME_RUNS runs of each of two blocks (a host-bound one with a
# small working set, one of the example GPT's stage shape: 0.08-0.34 and 0.24-0.58 ms from run
# to run here, too noisy a pair to fit a per-byte term from), the median
RESUME_PROBES = ((8, 16, 4), (64, 64, 2))
RESUME_ROUNDS, RESUME_RUNS = 60, 3


def _resume_worker(me: int, port: int, results, ends, core: int, shape: tuple) -> None:
    """One of two processes on `core` (a `_ranks` worker; its end of the pipe `ends`, no
    group): process 0 times a block right after its own block (the other process blocked)
    and, in turn, right after the other process ran a block on the core (a blocking handoff
    both ways, as a pipeline rank resumes after its wait); puts the difference (process 1:
    None)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    conn = ends[me]
    model, x = _block(*shape)

    def block() -> float:
        return _cpu_of(lambda: model(x).sum().backward())
    for _ in range(5):
        block()
    stay, resumed = [], []
    for r in range(RESUME_ROUNDS):
        handoff = r % 2 == 1
        if me == 0:
            block()
            if handoff:
                conn.send(True)
                conn.recv()
                resumed.append(block())
            else:
                stay.append(block())
                conn.send(False)
                conn.recv()
        elif conn.recv():
            block()
            conn.send(True)
        else:
            conn.send(False)
    results.put(statistics.median(resumed) - statistics.median(stay) if me == 0 else None)


def _resume_run(shape: tuple) -> float:
    got = _ranks(_resume_worker, 2, _group_context().Pipe(), min(os.sched_getaffinity(0)),
                 shape)
    return next(g for g in got if g is not None)


def measure_resume() -> float:
    """The CPU seconds an action costs beyond its own when its rank resumes on a core another
    process used meanwhile (its caches refilled: the interpreter's and torch's code, the
    weights, the activations), as each action of ranks sharing the cores does after a
    blocking handoff: two processes pinned to one core (`_resume_worker`), the median over
    RESUME_PROBES x RESUME_RUNS runs. 0 where a process cannot be pinned."""
    if not hasattr(os, "sched_setaffinity"):
        return 0.0
    runs = [_resume_run(shape) for shape in RESUME_PROBES for _ in range(RESUME_RUNS)]
    return _two_digits(max(statistics.median(runs), 1e-7))


def measure_sharing(n: int) -> float:
    """The CPU seconds of posting one transfer between computes when `n` ranks share this
    machine in a pipeline's pattern (`ring_slowdown`): the runtime's host work per send or
    receive (a cache-warm post in a loop costs about half). What the ranks' compute pays
    beyond its fair share of the cores is `measure_resume`'s, per action."""
    if n <= 1:
        return 0.0
    return _two_digits(ring_slowdown(n)[2])


_FIELDS = ("flops_per_s", "op_s", "op_backward_s", "bytes_per_s", "link_latency_s",
           "link_bytes_per_s", "split_call_s") + DTENSOR_FIELDS


def _load(path: str, key: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
        if c.get("key") == key and min(float(c[k]) for k in _FIELDS) > 0 and c["attention"] \
                and c["optimizer_ops"] and c["dispatch_s"] and "resume_s" in c:
            return c
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return {}


def _model(c: dict, n: int, origin: str) -> Optional[CpuModel]:
    if not c:
        return None
    post = 0.0 if n <= 1 else c.get("posts", {}).get(str(n))  # one rank: nothing sent
    loaded = c["link_latency_s"] if n <= 2 else c.get("loaded", {}).get(str(n))
    if post is None or loaded is None:
        return None
    return CpuModel(float(c["flops_per_s"]), float(c["op_s"]), float(c["op_backward_s"]),
                    origin, bytes_per_s=float(c["bytes_per_s"]),
                    link_latency_s=float(c["link_latency_s"]),
                    link_bytes_per_s=float(c["link_bytes_per_s"]), post_s=float(post),
                    loaded_latency_s=float(loaded),
                    attention=tuple(tuple(float(v) for v in row) for row in c["attention"]),
                    resume_s=float(c["resume_s"]),
                    collective_cpu_s=float(c.get("collective_cpu_s", 0.0)),
                    transfer_cpu_s=float(c.get("transfer_cpu_s", 0.0)),
                    split_call_s=float(c["split_call_s"]),
                    optimizer_ops=tuple(tuple(row) for row in c["optimizer_ops"]),
                    dispatch_s=tuple((r[0], float(r[1]), float(r[2])) for r in c["dispatch_s"]),
                    **{k: float(c[k]) for k in DTENSOR_FIELDS})


@contextlib.contextmanager
def _exclusive(path: str):
    """One process of the machine measures at a time (ranks compiling at once then all read
    the first one's numbers: their cost-aware schedules must agree); no lock where the
    cache folder is read-only."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(f"{path}.lock", "a+")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cpu_model(processes: int = 1) -> CpuModel:
    """This CPU's model for `processes` ranks running on it at once: the cached measurement,
    else a fresh one of what is missing (then cached)."""
    n = max(1, min(int(processes), MAX_PROCESSES))
    path, key = cache_path(), _key()
    cached = _model(_load(path, key), n, _origin(key, f"cached in {path}"))
    if cached is not None:
        return cached
    with _exclusive(path):
        c = _load(path, key) or _measure(key)
        if n > 1 and str(n) not in c.setdefault("posts", {}):
            c["posts"][str(n)] = measure_sharing(n)
        if n > 2 and str(n) not in c.setdefault("loaded", {}):
            c["loaded"][str(n)] = measure_loaded_latency(n)
        _store(path, c)
        return _model(c, n, _origin(key, "measured now"))


def _origin(key: str, how: str) -> str:
    return (f"measured CPU model ({key}, one thread; {N}x{N} matmul, fused attention, "
            f"memory-bound kernel, width-{WIDTH} transformer block, sharing and resume probes; "
            f"{how})")


PROBES = ((WIDTH, TOKENS, BLOCKS), (32, 128, 2))  # overhead-bound, then kernel-bound
PROBE_RUNS = 3  # each run in turn this many times, the median: the fit solves two unknowns
# from the two exactly, so one slow run moved both (4.0 us and 8.5 GB/s quiet here; 5.4 us and
# 29 GB/s once, the machine busy for one of the two runs)


def probe_blocks() -> tuple:
    """The PROBES' BlockRuns, each the median of PROBE_RUNS runs taken in turn."""
    runs = [[run_block(*p) for p in PROBES] for _ in range(PROBE_RUNS)]
    return tuple(dataclasses.replace(
        rs[0], forward_s=statistics.median(r.forward_s for r in rs),
        backward_s=statistics.median(r.backward_s for r in rs)) for rs in zip(*runs))


def _measure(key: str) -> dict:
    flops, attention = measure_flops(), measure_attention()
    op_s, op_backward_s, elements_per_s = fit_host(probe_blocks(), flops, attention)
    latency, link, collective_cpu, transfer_cpu = measure_link()
    dtensor = dict(zip(DTENSOR_FIELDS, measure_dtensor()))
    return {"key": key, "flops_per_s": flops, "op_s": _two_digits(op_s), **dtensor,
            "op_backward_s": _two_digits(op_backward_s),
            "bytes_per_s": _two_digits(4 * elements_per_s),
            "link_latency_s": latency, "link_bytes_per_s": link,
            "collective_cpu_s": collective_cpu, "transfer_cpu_s": transfer_cpu,
            "split_call_s": measure_split(), "optimizer_ops": count_optimizer_ops(),
            "dispatch_s": measure_dispatch(), "resume_s": measure_resume(),
            "attention": [list(r) for r in attention], "posts": {}}


def _store(path: str, c: dict) -> None:
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(c, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
