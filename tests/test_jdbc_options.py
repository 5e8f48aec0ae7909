"""``spark.jdbc_options``: libpq URL parameters reach the PostgreSQL JDBC driver, or are refused.

The mapping tests need neither PySpark nor Java; the last test reads through
Spark's JDBC source with the real driver, in a subprocess (its own JVM, with
the driver jar on the classpath).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from sqlalchemy.engine import make_url

from dramatiq_pg_outbox.spark import Plan, jdbc_jar, jdbc_options

ROOT = Path(__file__).resolve().parent.parent


def query_of(jdbc_url: str) -> dict[str, str]:
    """The decoded properties of a JDBC URL (as pgjdbc decodes them)."""
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(jdbc_url.removeprefix("jdbc:")).query))


def test_ssl_parameters_are_carried_to_the_driver() -> None:
    options = jdbc_options(
        "postgresql+psycopg://app@db.example:6543/app?sslmode=verify-full"
        "&sslrootcert=/etc/ssl/ca%20root.pem&sslcert=/etc/ssl/client.crt&sslkey=/etc/ssl/client.pk8"
    )
    assert options["url"].startswith("jdbc:postgresql://db.example:6543/app?")
    assert query_of(options["url"]) == {
        "stringtype": "unspecified",
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ssl/ca root.pem",
        "sslcert": "/etc/ssl/client.crt",
        "sslkey": "/etc/ssl/client.pk8",
    }
    assert options["driver"] == "org.postgresql.Driver" and options["user"] == "app"


@pytest.mark.parametrize(
    ("libpq", "pgjdbc"),
    [
        ("options=-c%20search_path%3Dapp", {"options": "-c search_path=app"}),
        ("connect_timeout=7", {"connectTimeout": "7"}),
        ("application_name=nightly%20job", {"ApplicationName": "nightly job"}),
        ("fallback_application_name=fallback", {"ApplicationName": "fallback"}),
        ("application_name=a&fallback_application_name=b", {"ApplicationName": "a"}),
        ("target_session_attrs=read-write", {"targetServerType": "primary"}),
        ("target_session_attrs=read-only", {"targetServerType": "secondary"}),
        ("target_session_attrs=any", {"targetServerType": "any"}),
        ("channel_binding=require", {"channelBinding": "require"}),
        ("gssencmode=disable", {"gssEncMode": "disable"}),
        ("krbsrvname=pg", {"kerberosServerName": "pg"}),
        ("keepalives=1", {"tcpKeepAlive": "true"}),
        ("keepalives=0", {"tcpKeepAlive": "false"}),
        ("load_balance_hosts=random", {"loadBalanceHosts": "true"}),
        ("client_encoding=utf8", {}),
    ],
)
def test_each_supported_libpq_parameter_becomes_its_pgjdbc_property(
    libpq: str, pgjdbc: dict[str, str]
) -> None:
    options = jdbc_options(f"postgresql://app@db/app?{libpq}")
    assert query_of(options["url"]) == {"stringtype": "unspecified", **pgjdbc}


def test_passwords_stay_out_of_the_jdbc_url() -> None:
    options = jdbc_options("postgresql://app:p%40ss@db/app?sslmode=require&sslpassword=key%20pass")
    assert options["password"] == "p@ss" and options["sslpassword"] == "key pass"
    assert "pass" not in options["url"]


def test_a_query_password_and_user_are_used_like_libpq_does() -> None:
    options = jdbc_options("postgresql://db/app?user=app&password=secret&dbname=other&port=6000")
    assert options["url"] == "jdbc:postgresql://db:6000/other?stringtype=unspecified"
    assert (options["user"], options["password"]) == ("app", "secret")


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("postgresql://app@/app?host=a:5433&host=b:5434", "a:5433,b:5434"),
        ("postgresql://app@/app?host=a,b&port=5433,5434", "a:5433,b:5434"),
        ("postgresql://app@/app?host=a,b&port=5433", "a:5433,b:5433"),
        ("postgresql://app@[::1]:5435/app", "[::1]:5435"),
        ("postgresql://app@/app?host=%5B::1%5D:5436", "[::1]:5436"),
        ("postgresql:///app", "localhost:5432"),
    ],
)
def test_hosts_and_ports_become_the_jdbc_server_list(url: str, servers: str) -> None:
    assert jdbc_options(url)["url"].startswith(f"jdbc:postgresql://{servers}/app?")


def test_a_database_name_is_percent_encoded() -> None:
    assert jdbc_options("postgresql://app@db/my%20app%2Fx")["url"].startswith(
        "jdbc:postgresql://db:5432/my%20app%2Fx?"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://app@db/app?sslcrl=/etc/crl.pem", "sslcrl cannot be passed"),
        (
            "postgresql://app@db/app?passfile=/home/app/.pgpass&service=x",
            "passfile, service cannot be passed",
        ),
        ("postgresql://app@db/app?hostaddr=10.0.0.1", "hostaddr cannot be passed"),
        ("postgresql://app@db/app?keepalives_idle=30", "keepalives_idle cannot be passed"),
        ("postgresql://app@db/app?sslrootcert=system", "sslrootcert=system"),
        ("postgresql://app@db/app?sslmode=verify_full", "sslmode='verify_full' cannot be passed"),
        ("postgresql://app@db/app?target_session_attrs=standby", "target_session_attrs='standby'"),
        (
            "postgresql://app@db/app?target_session_attrs=prefer-standby",
            "target_session_attrs='prefer-standby'",
        ),
        ("postgresql://app@db/app?channel_binding=yes", "channel_binding='yes'"),
        ("postgresql://app@db/app?keepalives=2", "keepalives='2'"),
        ("postgresql://app@db/app?connect_timeout=1.5", "connect_timeout='1.5'"),
        ("postgresql://app@db/app?client_encoding=latin1", "always uses UTF8"),
        ("postgresql://app@db/app?sslmode=require&sslmode=disable", "'sslmode' is given 2 times"),
        ("postgresql://app@/app?host=/var/run/postgresql", "Unix-domain socket"),
        ("postgresql://app@/app?host=a,b,c&port=1,2", "3 hosts but 2 ports"),
        ("mysql://app:secret@db/app", "Not a PostgreSQL URL"),
    ],
)
def test_parameters_the_driver_cannot_carry_are_refused_not_dropped(url: str, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        jdbc_options(url)
    assert message in str(excinfo.value)
    assert "secret" not in str(excinfo.value)


def test_the_executors_plan_does_not_show_the_password_in_its_repr() -> None:
    plan = Plan.build(
        key="id",
        conninfo="postgresql://app:s3cret@db/app",
        schema="dramatiq",
        channel="dramatiq_pg_outbox.dramatiq",
        queue_name="default",
        actor_name="task",
        batch_id="b",
        options={},
        delay_ms=0,
        notify=True,
        encoder=dramatiq.get_encoder(),
    )
    assert "s3cret" not in repr(plan)


# -- through Spark and the real driver --------------------------------------------

SPARK_READ = """
import json, sys
from dramatiq_pg_outbox.spark import jdbc_options, local_session

spark = local_session("dpo-jdbc-options-test", cores="1", memory="512m")
results = {}
for name, url in json.loads(sys.argv[1]).items():
    try:
        row = (
            spark.read.format("jdbc")
            .options(**jdbc_options(url))
            .option("query", "SELECT current_setting('application_name') AS app, "
                             "current_setting('search_path') AS path, current_user AS who")
            .load()
            .collect()[0]
        )
        results[name] = {"app": row["app"], "path": row["path"], "who": row["who"]}
    except Exception as e:
        # Spark's message is generic; the driver's reason is in the Java causes.
        messages, cause = [str(e)], getattr(e, "_origin", None)
        while cause is not None and len(messages) < 10:
            messages.append(str(cause.getMessage()))
            cause = cause.getCause()
        results[name] = {"error": " | ".join(messages)[:4000]}
spark.stop()
print("RESULTS " + json.dumps(results))
"""


def find_jdbc_jar() -> str | None:
    """The driver jar that ``jdbc_jar()`` finds, else one in the local Maven repository."""
    found = jdbc_jar()
    if found is None:
        jars = sorted(
            glob.glob(os.path.expanduser("~/.m2/repository/org/postgresql/postgresql/*/postgresql-*.jar"))
        )
        found = jars[-1] if jars else None
    return found


@pytest.mark.slow
def test_spark_connects_with_the_url_parameters_through_the_jdbc_driver(database_url: str) -> None:
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install -e '.[dev]')")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Java is not installed (Spark needs a JVM): apt-get install -y openjdk-17-jre-headless")
    jar = find_jdbc_jar()
    if jar is None:
        pytest.skip("no PostgreSQL JDBC driver jar: apt-get install -y libpostgresql-jdbc-java")
    # Given: the test database's URL with an application name, session options and sslmode
    base = make_url(database_url)
    urls = {
        "carried": base.update_query_dict(
            {
                "application_name": "dpo jdbc & test",
                "options": "-c search_path=dpo_jdbc,public",
                "sslmode": "disable",
            }
        ).render_as_string(hide_password=False),
        # The test server has no SSL: a driver that got sslmode=require must refuse to connect.
        "ssl_required": base.update_query_dict({"sslmode": "require"}).render_as_string(hide_password=False),
    }
    # When: Spark reads through its JDBC source with jdbc_options(url)
    env = {**os.environ, "DRAMATIQ_PG_OUTBOX_JDBC_JAR": jar}
    done = subprocess.run(
        [sys.executable, "-c", SPARK_READ, json.dumps(urls)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    results: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULTS "))
    # Then: the server saw the application name and the search_path from the URL
    assert results["carried"] == {"app": "dpo jdbc & test", "path": "dpo_jdbc,public", "who": base.username}
    # And: sslmode reached the driver (it was silently dropped before)
    ssl_result = results["ssl_required"]
    assert "error" in ssl_result and "SSL" in ssl_result["error"], ssl_result
