"""Actions: the decider of each final slice, the fallback policy, admission, flag state, and where
decisions go (publishing them, alerting)."""
