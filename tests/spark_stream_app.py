"""A streaming query that the Spark tests kill and restart: JSON files -> format("dramatiq").

``python -m tests.spark_stream_app URL INPUT_DIR CHECKPOINT_DIR [MASTER]``: it prints where
the executors import this package from, then runs one micro-batch per input file, each
written by two tasks (two transactions), until every file present is processed; then it
prints the query's plan (``explain(extended=True)``) and exits 0.  Restarted with the same
checkpoint it goes on where the checkpoint says.  With ``MASTER`` (``spark://...``) it runs
on that cluster (:func:`cluster_session`), else on ``local[2]``.
"""

from __future__ import annotations

import sys

from dramatiq_pg_outbox.spark import cluster_session, local_session, register


def main(url: str, input_dir: str, checkpoint: str, master: str = "") -> None:
    # The session helpers set the executors' Python (and ship this package to a cluster's
    # executors), as a user's script would get them.
    name = "dramatiq-pg-outbox-stream-test"
    spark = cluster_session(master, name) if master else local_session(name, cores="2")
    register(spark)
    # Where the executors' Python workers import this package from (on a cluster: the zip that
    # cluster_session shipped with the job).
    files = spark.sparkContext.parallelize(range(2), 2).mapPartitions(_package_file).collect()
    print(f"executors import the package from {sorted(set(files))}", flush=True)
    rows = (
        spark.readStream.format("json")
        .schema("id long, email string")
        .option("maxFilesPerTrigger", 1)
        .load(input_dir)
        .repartition(2)
    )
    query = (
        rows.writeStream.format("dramatiq")
        .option("url", url)
        .option("actor", "notify_customer")
        .option("queue", "notifications")
        .option("batch", "stream")
        .option("key", "id")
        .option("args", "id,email")
        .option("checkpointLocation", checkpoint)
        .start()
    )
    print(f"query {query.id} started", flush=True)
    query.processAllAvailable()
    query.explain(extended=True)
    query.stop()
    spark.stop()


def _package_file(_: object) -> list[str]:
    import dramatiq_pg_outbox

    return [dramatiq_pg_outbox.__file__ or ""]


if __name__ == "__main__":
    main(*sys.argv[1:5])
