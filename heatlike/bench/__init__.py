"""The benchmark suites behind ``python -m heatlike.bench`` (run under mpiexec or srun): comm,
dndarray, dp, daso, algorithms, tta (time to accuracy) and costmodel (an alpha-beta model, not a
measurement); ``--json`` records, ``--plot`` figures (:mod:`heatlike.bench.plot`), ``--trace``
Chrome traces (:mod:`heatlike.bench.trace`)."""
