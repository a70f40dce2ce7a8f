"""ZeRO stages 0-3 over a data-parallel group (sharding.py) and ZeRO-3's prefetch window
(window.py). The flat layout and its memory formula are compiler/parallel/zero.py."""
