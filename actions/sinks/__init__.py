"""Where decisions go once made: the signed decisions topic engines follow, and Alertmanager
(the archive sink is the archive's own, `specwatch.archive.sink`)."""
