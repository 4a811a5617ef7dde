"""Columns of one decision in the grid pass: ``res_i[O_*, config]`` (int64).

The float column (selected_queue_ms) is kept apart in ``res_f[config]``.
"""

O_WORKER = 0
O_REASON = 1
O_POLICY_REASON = 2
O_DECISION = 3
O_FAILURE = 4
O_MATCHED = 5
O_SELECTED_BLOCKS = 6
O_UNCACHED = 7
O_GATE_REJECTED = 8
O_EVALUATED = 9
O_ADM_REJECTED = 10
O_BEST_REJECTED = 11
O_ALL_QUEUED = 12
O_FELL_BACK = 13
O_COMPARED = 14
O_OVERRIDES = 15
O_SOURCE = 16
O_SEL_WAITING = 17
O_SEL_WU = 18
O_NCOLS = 19

