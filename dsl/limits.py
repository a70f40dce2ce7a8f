"""The largest value of each size a plan gives.

Far above any real job, low enough that `pipeplan check` never allocates or loops
without bound: the schema refuses a larger value at its plan line
(docs/plan-language.md, "Limits"), and dsl/checks.py bounds the products.
"""
MAX_RANKS = 2**16  # per mesh axis, and pp * dp * tp
MAX_MICROBATCHES = 2**16
MAX_VIRTUAL = 64
MAX_SCHEDULE_SLOTS = 2**18  # pp * virtual * microbatches: forwards in one step's schedule
MAX_BATCH = 2**24  # sequences per step
MAX_SEQ_LEN = 2**24
MAX_VOCAB = 2**24  # synthetic tokens
MAX_STEP_TOKENS = 2**31  # global_batch * (seq_len + 1): the tokens one step reads
MAX_STEPS = 10**9
MAX_SEED = 2**32 - 1
MAX_EXPERTS = 2**16
MAX_DIM = 2**31  # an integer dimension of a model input
MAX_LAYER = 2**20  # a bound of a layer range

# Counted on the raw text before the parser runs (dsl/scan.py): parsing costs ~35 us of CPU
# per value, so these keep the parse of any accepted plan under ~1 s; a real plan has ~100.
MAX_LIST_ITEMS = 4096  # elements of one list (a split of 4096 stages is far above any job)
MAX_PLAN_VALUES = 32768  # names, numbers and strings in the whole plan
