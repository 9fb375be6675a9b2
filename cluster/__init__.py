"""kvstrata.cluster: front ends, CLI, config and benchmarks."""
