"""`specwatch bench`: throughput and overhead of every path, each beside an alternative measured in the same run."""

__all__ = ["SECTIONS"]

# Every section of the bench, in the order a full run takes them.
SECTIONS = ("stream", "kafka", "collector", "export", "engine", "archive", "replay", "startup", "growth", "keys",
            "metrics")
