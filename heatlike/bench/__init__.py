"""The benchmark suites behind ``python -m heatlike.bench`` (run under mpiexec or srun)."""
