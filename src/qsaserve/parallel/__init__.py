"""What models call for tensor and decode context parallelism: one rank's ParallelContext and its
collectives (state.py), weight sharding (tp.py) and the DCP geometry (dcp.py). The processes that
run the ranks are the engine's (engine/executor/)."""
