"""``kv_connector_extra_config`` is checked once at startup: each bad value is refused
naming the key and what is allowed; unknown keys are logged with the closest known one."""

from __future__ import annotations

import logging

import pytest
from testkit import vllm_harness as harness

from vllm_flagcx.connector.common.settings import (
    ConnectorSettings,
    SettingsError,
    checked_extra_config,
)


@pytest.mark.parametrize("key, value, allowed", [
    ("lease_seconds", 0, "seconds > 0"),
    ("lease_seconds", -5, "seconds > 0"),
    ("lease_seconds", "soon", "seconds > 0"),
    ("recv_timeout", float("nan"), "seconds > 0"),
    ("handshake_timeout", True, "seconds > 0"),
    ("side_channel_port", 70000, "1..65535"),
    ("side_channel_port", -1, "1..65535"),
    ("side_channel_port", "http", "1..65535"),
    ("verify_integrity", "maybe", "true or false"),
    ("transport", "rdma", "auto, flagcx, local"),
    ("side_channel_host", "", "non-empty"),
])
def test_bad_values_are_refused_naming_the_key(key, value, allowed):
    with pytest.raises(SettingsError) as err:
        checked_extra_config({key: value})
    assert f"kv_connector_extra_config.{key}=" in str(err.value)
    assert allowed in str(err.value)


def test_strings_that_mean_false_read_as_false():
    out = checked_extra_config({"verify_integrity": "false", "enforce_handshake_compat": "0",
                                "test_faults": "no", "flagcx_rdma_check": False})
    assert out == {"verify_integrity": False, "enforce_handshake_compat": False,
                   "test_faults": False, "flagcx_rdma_check": False}
    assert checked_extra_config({"side_channel_port": "5600"}) == {"side_channel_port": 5600}


def test_unknown_key_is_logged_with_the_closest_setting(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_flagcx"):
        out = checked_extra_config({"lease_secs": 5})
    assert out == {"lease_secs": 5}
    assert "lease_secs is not a setting" in caplog.text and "'lease_seconds'" in caplog.text


def test_not_an_object_is_refused():
    with pytest.raises(SettingsError, match="must be an object"):
        checked_extra_config(["lease_seconds", 5])


def test_the_connector_refuses_at_startup_on_the_real_scheduler():
    config = harness.make_vllm_config(kv_role="kv_consumer",
                                      extra_config={"lease_seconds": -1})
    with pytest.raises(SettingsError, match="lease_seconds=-1"):
        harness.make_scheduler(config, harness.dense_kv_cache_config())
    config = harness.make_vllm_config(kv_role="kv_producer",
                                      extra_config={"side_channel_port": 65535})
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(SettingsError, match="ports up to 65536"):
        harness.make_scheduler(config, harness.dense_kv_cache_config())


def test_settings_object_holds_every_checked_key_once_with_its_default():
    import dataclasses

    from vllm_flagcx.connector.common.settings import KEYS, ConnectorSettings

    fields = {f.name for f in dataclasses.fields(ConnectorSettings)} - {"raw"}
    assert fields == set(KEYS)  # a key added to one is added to the other
    s = ConnectorSettings.from_extra({"lease_seconds": "12", "verify_integrity": "false",
                                      "side_channel_bind": "::1", "my_plugin_key": 3})
    assert s.lease_seconds == 12.0 and s.verify_integrity is False
    assert s.pull_timeout == 22.0 and s.bind_host == "::1"
    assert s.raw["my_plugin_key"] == 3  # unknown keys kept for transport plugins
    assert ConnectorSettings.from_extra(None).bind_host == "127.0.0.1"


def test_the_halves_take_every_user_default_from_connector_settings():
    """Each user-settable default is stated once (ConnectorSettings): the worker's and the
    scheduler's settings start from the same values, so a changed default reaches both."""
    import dataclasses

    from vllm_flagcx.connector.common.worker_settings import WorkerSettings
    from vllm_flagcx.connector.scheduler import SchedulerSettings

    user = ConnectorSettings()
    renamed = {"recv_timeout": user.pull_timeout, "bind_host": user.bind_host,
               "skip_compat_hash": not user.enforce_handshake_compat,
               "first_lease_seconds": user.initial_lease}
    checked = 0
    for half in (WorkerSettings, SchedulerSettings):
        for f in dataclasses.fields(half):
            if f.default is dataclasses.MISSING:
                continue
            if f.name in renamed:
                expected = renamed[f.name]
            elif hasattr(user, f.name) and f.name != "key":
                expected = getattr(user, f.name)
            else:
                continue
            assert f.default == expected, (half.__name__, f.name, f.default, expected)
            checked += 1
    assert checked >= 12


def test_every_transport_name_but_auto_is_one_built_in_transport():
    from vllm_flagcx.connector.common.settings import TRANSPORT_NAMES
    from vllm_flagcx.connector.common.transport_choice import BUILT_IN

    assert set(TRANSPORT_NAMES) == {"auto", *BUILT_IN}
    with pytest.raises(SettingsError, match="auto, flagcx, local"):
        checked_extra_config({"transport": "nixl"})


def test_each_dp_rank_gets_its_own_side_channel_ports_and_an_overflow_names_the_setting():
    from vllm_flagcx.connector.entry import side_channel_base

    assert [side_channel_base(5600, dp, 4) for dp in range(3)] == [5600, 5604, 5608]
    assert side_channel_base(65532, 0, 4) == 65532  # ranks 65532 .. 65535
    with pytest.raises(SettingsError, match=r"side_channel_port=65530: .*up to 65537"):
        side_channel_base(65530, 1, 4)
