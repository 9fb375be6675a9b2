"""kvstrata.cluster.bench: the workloads, trace replay and measurements behind `kvstrata bench`."""
