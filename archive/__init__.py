"""The ClickHouse archive: decisions, samples, audit and window statistics, for postmortems and replay."""
