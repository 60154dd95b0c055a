"""Where decisions go once made: the signed decisions topic engines follow, and Alertmanager.

The archive sink is the archive's own (`specwatch.archive.sink`); the pure decision logic
these carry out sits one level up, in `specwatch.actions`.
"""
