"""The typed stores: the only code that looks a statement up by name in the package's ``.sql`` files.

One module per area, each a class that fills the schema in once and has one method per
statement: typed keyword parameters, the connection (or cursor) passed in first, typed rows
returned.  Callers keep owning connections, pools, transactions and retries.

- ``messages``: the broker's runtime and hot path (enqueue, claim, ack, flush, maintenance),
  and the outboxes' writes (``queries.sql``).
- ``results``, ``rate_limits``, ``periodic``: the features on ``queries.sql``.
- ``admin``: the operator statements (``admin.sql``: CLI, partitions, metrics, migrations,
  test servers); ``relay``: ``relay.sql``; ``spark``: ``spark.sql`` and ``spark_backlog.sql``.
"""
