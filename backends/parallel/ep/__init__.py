"""Expert parallelism around the model's own experts module: the module wrapper
(experts.py) and the token all-to-all (dispatch.py). What the compiler knows about
experts (the MoE interface, placement) is compiler/parallel/ep.py."""
