"""The local servers' pure parts, without starting one: URLs, files and commands per server, and
the ports from servers.json, else the environment, else the defaults."""

import json

from rlflow.flows.servers import Server, servers, write_registry


def test_prefects_url_has_the_api_path_and_mlflows_does_not(tmp_path):
    prefect, mlflow = Server("prefect", 4300, tmp_path), Server("mlflow", 5100, tmp_path)
    assert (prefect.url, prefect.ui_url, prefect.health_url) == (
        "http://127.0.0.1:4300/api", "http://127.0.0.1:4300", "http://127.0.0.1:4300/api/health",
    )  # fmt: skip
    assert (mlflow.url, mlflow.health_url) == ("http://127.0.0.1:5100", "http://127.0.0.1:5100/health")
    assert (mlflow.pid_file, mlflow.log_file) == (tmp_path / "mlflow.pid", tmp_path / "mlflow.log")


def test_each_server_keeps_its_data_under_the_state_dir(tmp_path):
    argv, env = Server("prefect", 4300, tmp_path).command()
    assert argv[1:] == ["server", "start", "--host", "127.0.0.1", "--port", "4300"]
    assert env["PREFECT_API_DATABASE_CONNECTION_URL"] == f"sqlite+aiosqlite:///{tmp_path / 'prefect'}/prefect.db"
    argv, env = Server("mlflow", 5100, tmp_path).command()
    assert argv[argv.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path / 'mlflow'}/mlflow.db"
    assert argv[argv.index("--workers") + 1] == "1" and env == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def test_ports_come_from_the_registry_else_the_environment_else_the_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("RLFLOW_PREFECT_PORT", raising=False)
    monkeypatch.setenv("RLFLOW_MLFLOW_PORT", "5999")
    assert [(s.name, s.port) for s in servers(tmp_path)] == [("prefect", 4200), ("mlflow", 5999)]
    write_registry(tmp_path, [Server("prefect", 4301, tmp_path)])
    assert json.loads((tmp_path / "servers.json").read_text()) == {
        "prefect": {"url": "http://127.0.0.1:4301/api", "port": 4301}
    }
    assert [(s.name, s.port) for s in servers(tmp_path)] == [("prefect", 4301), ("mlflow", 5999)]
    (tmp_path / "servers.json").write_text("[1, 2]")  # not a registry: ignored
    assert [s.port for s in servers(tmp_path)] == [4200, 5999]
