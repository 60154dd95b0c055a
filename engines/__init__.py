"""Serving engines started and driven from outside, for qualification, reproduce and the gateway.

Not the in-engine plugin (that is collectors/): these start an engine, send it work and stop it.
"""
