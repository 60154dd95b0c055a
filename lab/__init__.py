"""The tools around the product, not the product: the simulated fleet, the benchmarks, the
evaluation suites and the demo scaffolding. The product never imports them; they import it."""
