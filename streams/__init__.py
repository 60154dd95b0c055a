"""Streams: the processing topology (stage 1 combines, stage 2 merges and hands each final slice to
the decider of `specwatch.actions`), embedded or on Faust."""
