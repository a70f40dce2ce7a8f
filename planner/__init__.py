"""`pipeplan plan`: the plan-space search over the compiler's estimates (space, cost, search, report)."""
