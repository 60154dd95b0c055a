"""A simulated fleet of speculative engine workers: the load generator behind demo, simulate, soak, evaluate and bench."""
