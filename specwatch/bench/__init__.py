"""`specwatch bench`: throughput and overhead of every path, each beside an alternative measured in the same run."""
