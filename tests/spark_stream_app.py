"""A streaming query that the Spark tests kill and restart: JSON files -> format("dramatiq").

``python -m tests.spark_stream_app URL INPUT_DIR CHECKPOINT_DIR``: one micro-batch per
input file, each written by two tasks (two transactions), until every file present is
processed; then it exits 0.  Restarted with the same checkpoint it goes on where the
checkpoint says.
"""

from __future__ import annotations

import sys

from dramatiq_pg_outbox.spark import local_session, register


def main(url: str, input_dir: str, checkpoint: str) -> None:
    # local_session sets SPARK_LOCAL_IP and PYSPARK_PYTHON, as a user's script would get them.
    spark = local_session("dramatiq-pg-outbox-stream-test", cores="2")
    register(spark)
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
    query.stop()
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4])
