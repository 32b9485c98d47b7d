"""`paratrain bench comm`: native, ring and tree collectives timed and counted side by side.

    sweep.py    the flags made into a checked `Sweep` (ops, algorithms, worlds, sizes)
    calls.py    what each rank runs: every collective of the sweep, timed and counted
    fit.py      cost models, the alpha-beta fit and busbw conventions
    report.py   tables, the comparison with native, the plot
    run.py      per world size: ranks started, slowest rank per sample, bytes checked
                against comm/traffic.py, fits and predictions

Flags -> Sweep -> calls.py in k processes per world size -> run.py combines and checks
-> fit.py fits -> report.py shows.
"""
