"""Tensor parallelism and decode context parallelism: process groups and executor (executor.py),
collectives (state.py), weight sharding (tp.py) and the DCP geometry (dcp.py)."""
