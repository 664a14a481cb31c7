"""The memory governor: probes, the swap policy, swaps between variants, the quality gate."""
