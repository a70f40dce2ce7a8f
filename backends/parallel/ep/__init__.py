"""Expert parallelism around the model's own experts module: the module wrapper
(experts.py). Its token dispatch is compiler/parallel/ep_dispatch.py (the CPU probe times
it there), what the compiler knows about experts (the MoE interface, placement)
compiler/parallel/ep.py."""
