"""`paratrain bench comm`: native, ring and tree collectives timed and counted side by side.

Flags -> `Sweep` (sweep.py) -> for each world size, k rank processes time and count every
(op, algorithm, size) (calls.py) -> run.py takes the slowest rank per sample and the median
sample, checks the bytes against comm/traffic.py, and fits alpha and beta per algorithm
(fit.py) -> tables, the comparison with native and the plot (report.py).
"""
