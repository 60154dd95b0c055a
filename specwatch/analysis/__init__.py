"""Offline analysis over the archive: the postmortem page, the timeline picture, sample reproduction, draft-length advice."""
