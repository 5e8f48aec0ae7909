"""Chaos suite: delivery guarantees of PostgresBroker under failure.

Run ``python -m benchmarks.chaos`` (all eight scenarios, >= 20,000 messages
each, broker defaults) or ``python -m benchmarks.chaos --quick``.  See
``docs/chaos.md`` for what each scenario does and the latest results.
"""
