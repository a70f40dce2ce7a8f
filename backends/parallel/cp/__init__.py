"""Context parallelism on a captured stage graph: each SDPA call swapped for a module
(attention.py) running Ulysses (ulysses.py) or ring attention (ring.py). What the
compiler checks and costs is compiler/parallel/cp.py."""
