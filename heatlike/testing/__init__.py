"""Testing support for MPI programs: a pytest plugin (``heatlike.testing.plugin``) and a runner
for a matrix of world sizes (``python -m heatlike.testing.matrix``)."""
