"""Periodic jobs end to end: several schedulers, one of them killed, each tick run once."""
