"""Actions: the fallback policy, flag state, publishing decisions and archiving evidence."""
