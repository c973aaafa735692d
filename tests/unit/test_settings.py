"""Settings from the environment, their documentation, and URL normalisation (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.settings import ApiSettings
from staleflow_db.settings import Settings, get_settings, to_libpq_url, to_sqlalchemy_url
from workers.client import api_urls, default_token
from workers.settings import (
    ClientSettings,
    CoordinatorSettings,
    EngineSettings,
    SettingsError,
    SimEngineSettings,
    StaleFlowSettings,
    client_settings,
    env_name,
)

ENV = (
    "STALEFLOW_DATABASE_URL",
    "STALEFLOW_HOME",
    "STALEFLOW_STATEMENT_TIMEOUT",
    "STALEFLOW_LOCK_TIMEOUT",
    "STALEFLOW_IDLE_IN_TRANSACTION_TIMEOUT",
    "STALEFLOW_POOL_SIZE",
    "STALEFLOW_MAX_OVERFLOW",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults(clean_env: pytest.MonkeyPatch) -> None:
    s = get_settings()
    assert s.database_url is None
    assert s.home == Path("~/.staleflow").expanduser()
    assert s.pgdata == s.home / "pgdata"
    assert (s.statement_timeout, s.lock_timeout, s.idle_in_transaction_session_timeout) == ("30s", "10s", "60s")
    assert s.pool_size > 0


def test_from_env(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_env.setenv("STALEFLOW_DATABASE_URL", "postgresql+psycopg://u@h:5433/d")
    clean_env.setenv("STALEFLOW_HOME", str(tmp_path))
    clean_env.setenv("STALEFLOW_STATEMENT_TIMEOUT", "500ms")
    clean_env.setenv("STALEFLOW_LOCK_TIMEOUT", "0")
    clean_env.setenv("STALEFLOW_POOL_SIZE", "3")
    s = get_settings()
    assert s.database_url == "postgresql://u@h:5433/d"  # kept in libpq form
    assert s.home == tmp_path and s.pgdata == tmp_path / "pgdata"
    assert (s.statement_timeout, s.lock_timeout, s.pool_size) == ("500ms", "0", 3)


@pytest.mark.parametrize("bad", ["30s -c fsync=off", "soon", "-1"])
def test_timeout_values_are_validated(clean_env: pytest.MonkeyPatch, bad: str) -> None:
    clean_env.setenv("STALEFLOW_STATEMENT_TIMEOUT", bad)
    with pytest.raises(ValueError, match="STALEFLOW_STATEMENT_TIMEOUT"):
        get_settings()


def test_bad_integer(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("STALEFLOW_POOL_SIZE", "many")
    with pytest.raises(ValueError, match="STALEFLOW_POOL_SIZE"):
        Settings.from_env()


@pytest.mark.parametrize(
    ("url", "sa", "libpq"),
    [
        ("postgresql://u@h/d", "postgresql+psycopg://u@h/d", "postgresql://u@h/d"),
        ("postgres://u@h/d", "postgresql+psycopg://u@h/d", "postgres://u@h/d"),
        ("postgresql+psycopg://u@h/d", "postgresql+psycopg://u@h/d", "postgresql://u@h/d"),
        ("postgresql+psycopg2://u@h/d", "postgresql+psycopg2://u@h/d", "postgresql://u@h/d"),
    ],
)
def test_url_forms(url: str, sa: str, libpq: str) -> None:
    assert to_sqlalchemy_url(url) == sa
    assert to_libpq_url(url) == libpq


# ---- the other layers' settings, and the one table that documents them all ----------------

CLASSES = (Settings, ApiSettings, ClientSettings, CoordinatorSettings, SimEngineSettings, EngineSettings)
DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def _variables() -> dict[str, object]:
    """Every variable of the settings classes and its default (nested settings excluded)."""
    out: dict[str, object] = {}
    for cls in CLASSES:
        for name, field in cls.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, StaleFlowSettings):
                continue  # e.g. ApiSettings.db: the database's own variables
            assert env_name(cls, name) not in out, f"{env_name(cls, name)} is read by two classes"
            out[env_name(cls, name)] = field.default
    return out


def _documented() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`STALEFLOW_"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def test_the_table_lists_exactly_the_settings() -> None:
    documented, variables = _documented(), _variables()
    assert sorted(documented) == sorted(variables)
    for name, default in variables.items():
        shown = "unset" if default is None else f"`{default}`"
        assert documented[name] == shown, name


def test_the_readme_links_the_table() -> None:
    assert "docs/settings.md" in (DOC.parents[1] / "README.md").read_text()


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _variables():
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_layer_defaults(bare_env: pytest.MonkeyPatch) -> None:
    api = ApiSettings.from_env()
    assert (api.max_wait, api.listen, api.max_body_bytes, api.db) == (30.0, True, 64 * 1024 * 1024, get_settings())
    assert client_settings().api_url == "http://127.0.0.1:8000" and client_settings().retry_for == 60.0
    assert (CoordinatorSettings().policy, CoordinatorSettings().period, SimEngineSettings().time_scale) == (
        "staleflow",
        None,
        1.0,
    )


def test_layers_from_env(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bare_env.setenv("STALEFLOW_API_LISTEN", "off")
    bare_env.setenv("STALEFLOW_API_MAX_WAIT", "2.5")
    bare_env.setenv("STALEFLOW_API_URL", " http://a:1/, http://b:2 ,http://a:1")
    bare_env.setenv("STALEFLOW_CLIENT_RETRY_FOR", "forever")
    bare_env.setenv("STALEFLOW_CLIENT_WAIT", "0.5")
    bare_env.setenv("STALEFLOW_COORDINATOR_LEASE", "1.5")
    bare_env.setenv("STALEFLOW_SIM_PREFILL_RATE", "5000")
    api = ApiSettings.from_env()
    assert (api.listen, api.max_wait) == (False, 2.5)
    assert api_urls() == ["http://a:1", "http://b:2"]
    assert (client_settings().retry_for, client_settings().wait) == (None, 0.5)
    assert (CoordinatorSettings().lease, SimEngineSettings().prefill_rate) == (1.5, 5000.0)
    # The token: the variable, else the file `staleflow serve` writes under STALEFLOW_HOME.
    bare_env.setenv("STALEFLOW_HOME", str(tmp_path))
    assert default_token() is None
    (tmp_path / "token").write_text("sf_file\n")
    assert default_token() == "sf_file"
    bare_env.setenv("STALEFLOW_TOKEN", "sf_env")
    assert default_token() == "sf_env"


@pytest.mark.parametrize(
    ("cls", "name", "bad"),
    [
        (ApiSettings, "STALEFLOW_API_MAX_WAIT", "601"),
        (ApiSettings, "STALEFLOW_API_LISTEN", "maybe"),
        (ClientSettings, "STALEFLOW_CLIENT_TIMEOUT", "0"),
        (CoordinatorSettings, "STALEFLOW_COORDINATOR_PERIOD", "fast"),
        (SimEngineSettings, "STALEFLOW_SIM_TIME_SCALE", "-1"),
        (Settings, "STALEFLOW_IDLE_IN_TRANSACTION_TIMEOUT", "1 week"),
    ],
)
def test_bad_values_name_the_variable(bare_env: pytest.MonkeyPatch, cls: type, name: str, bad: str) -> None:
    bare_env.setenv(name, bad)
    with pytest.raises(SettingsError, match=f"{name}='{bad}'"):
        cls()


def test_cached_per_environment(bare_env: pytest.MonkeyPatch) -> None:
    assert get_settings() is get_settings()
    bare_env.setenv("STALEFLOW_POOL_SIZE", "4")
    assert get_settings().pool_size == 4  # a changed environment is read again, no cache to clear
    assert Settings(pool_size=2).pool_size == 2  # keyword overrides win over the environment


def test_the_sim_engine_reads_its_settings(bare_env: pytest.MonkeyPatch) -> None:
    from workers.rollout.engines.sim_engine import SimEngine

    bare_env.setenv("STALEFLOW_SIM_TIME_SCALE", "0.25")
    bare_env.setenv("STALEFLOW_SIM_PULL_S", "2")
    engine = SimEngine()
    assert (engine.time_scale, engine.pull_s, engine.prefill_rate) == (0.25, 2.0, 0.0)
    assert SimEngine(time_scale=0).time_scale == 0  # an argument wins


def test_coordinator_options_win_over_the_environment(bare_env: pytest.MonkeyPatch) -> None:
    """The policy is checked before the database is touched, so the refusal shows which
    value the command used."""
    from typer.testing import CliRunner

    from staleflow_cli.main import app

    bare_env.setenv("STALEFLOW_COORDINATOR_POLICY", "from-env")
    out = CliRunner().invoke(app, ["coordinator", "--run", "1"])
    assert out.exit_code == 2 and "from-env" in out.output
    out = CliRunner().invoke(app, ["coordinator", "--run", "1", "--policy", "from-option"])
    assert out.exit_code == 2 and "from-option" in out.output and "from-env" not in out.output
