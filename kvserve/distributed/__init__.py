"""Several processes, one model (seed §5): the tensor-parallel group (group.py), how the model
is split over its ranks (sharding.py), and how the ranks are started (launch.py)."""
