"""Streams: the processing topology (stage 1 combine, stage 2 merge+detect), embedded or on Faust."""
