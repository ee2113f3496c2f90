#!/bin/sh
# Runs on the postgres volume's first start only (docker-entrypoint-initdb.d): one role and one
# database each for Prefect and MLflow, so neither service can read or drop the other's tables.
# psql's :'var' quoting keeps the passwords safe whatever characters they contain. No `set -u`:
# the entrypoint sources (rather than executes) a script that lost its executable bit.
set -e
: "${PREFECT_DB_PASSWORD:?}" "${MLFLOW_DB_PASSWORD:?}"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
    -v prefect_password="$PREFECT_DB_PASSWORD" -v mlflow_password="$MLFLOW_DB_PASSWORD" <<'SQL'
CREATE ROLE prefect LOGIN PASSWORD :'prefect_password';
CREATE DATABASE prefect OWNER prefect;
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_password';
CREATE DATABASE mlflow OWNER mlflow;
SQL
