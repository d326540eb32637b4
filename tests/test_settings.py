import pytest

from keyserial import ConfigError, Settings


def test_settings_come_from_keyserial_environment_variables() -> None:
    settings = Settings.from_env({"KEYSERIAL_LEASE_TTL": "2.5", "KEYSERIAL_SHARD_COUNT": "32",
                                  "KEYSERIAL_NAMESPACE": "orders", "OTHER": "x"})
    assert (settings.lease_ttl, settings.shard_count, settings.namespace) == (2.5, 32, "orders")


def test_a_misspelled_variable_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match="unknown setting KEYSERIAL_LEASE_TLL"):
        Settings.from_env({"KEYSERIAL_LEASE_TLL": "2"})


def test_a_value_of_the_wrong_type_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="KEYSERIAL_MAX_STRIKES='many'"):
        Settings.from_env({"KEYSERIAL_MAX_STRIKES": "many"})


@pytest.mark.parametrize(
    "changes",
    [{"lease_ttl": 0}, {"shard_count": 0}, {"namespace": "a{b}"}, {"namespace": ""},
     {"max_backlog": -1}, {"preload_states": -1}],
)
def test_unworkable_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Settings(**changes)  # type: ignore[arg-type]


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(TypeError):
        Settings(lease_tll=3)  # type: ignore[call-arg]
