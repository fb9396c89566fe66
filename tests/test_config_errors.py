"""Configuration mistakes end in an error that names the setting and the fix, never a bare
library error: a side-channel port in use (was a bare ``ZMQError``), a bind address that
is a host name (was ``No such device``), a ``transport_factory`` with the wrong signature
or result (was ``TypeError`` from deep inside), the secret in the environment under its
old ``VLLM_`` name (vLLM's ``--fail-on-environ-validation`` refuses unknown ``VLLM_*``), a
malformed peer host (a release thread died on ``ZMQError``)."""

from __future__ import annotations

import pytest
import zmq
from testkit import pd_harness as pd

from vllm_flagcx.connector.common.settings import ConnectorSettings
from vllm_flagcx.connector.common.transport_choice import make_transport
from vllm_flagcx.connector.worker import WorkerHalf
from vllm_flagcx.wire import auth, client
from vllm_flagcx.wire import handshake as hs


def test_a_side_channel_port_in_use_names_the_setting():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    try:
        with pytest.raises(RuntimeError, match=r"side_channel_port: .* served by another"):
            pd.build_instance("kv_producer", 1, port, model="dense")
    finally:
        p.shutdown()


def test_a_taken_side_channel_is_refused_when_vllm_builds_the_worker_connector(tmp_path):
    """Before the model loads: vLLM builds the worker's connector first, and a port found
    taken only at ``register_kv_caches`` cost minutes of engine start. Both endpoints: the
    Unix socket, and with a secret the TCP port."""
    from testkit import vllm_harness as harness

    from vllm_flagcx.compat.connector_api import KVConnectorRole
    from vllm_flagcx.connector import FlagCXConnector

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    secret.chmod(0o600)
    for secret_file in (None, str(secret)):
        port = pd.free_port()
        p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
        extra = {"side_channel_port": port, "side_channel_secret_file": secret_file,
                 "transport_factory": "testkit.transport_standin:factory"}
        config = harness.make_vllm_config(model=harness.DENSE_MODEL, hma=True,
                                          kv_role="kv_producer", extra_config=extra)
        try:
            with pytest.raises(RuntimeError, match=r"side_channel_port: .*served by another"):
                FlagCXConnector(config, KVConnectorRole.WORKER, p.ranks[0].config)
            if secret_file:  # the socket is free, the TCP port is not
                p.workers[0].server.shutdown()
                import socket

                with socket.create_server(("127.0.0.1", port)), pytest.raises(
                        RuntimeError, match=r"side_channel_port: port \d+ .* in use"):
                    FlagCXConnector(config, KVConnectorRole.WORKER, p.ranks[0].config)
        finally:
            p.shutdown()
    FlagCXConnector(config, KVConnectorRole.WORKER, p.ranks[0].config)  # free again


def test_a_host_name_as_bind_address_names_the_setting():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    w = p.workers[0]
    key = auth.load_key(environ={auth.SECRET_ENV: "s" * 24})
    settings = w.settings.__class__(**{**w.settings.__dict__, "bind_host": "prefill-0.invalid",
                                       "side_channel_port": port + 3, "key": key})
    half = WorkerHalf(settings, w.transport.__class__())
    try:
        with pytest.raises(RuntimeError, match=r"side_channel_bind .*not a host name"):
            half.register_regions(w.regions, serve=True)
    finally:
        half.shutdown()
        p.shutdown()


@pytest.mark.parametrize(("factory", "why"), [
    ("os:getcwd", "calling it as factory"),
    ("testkit.transport_standin:not_a_transport", "not a vllm_flagcx"),
])
def test_a_wrong_transport_factory_names_the_key(factory, why):
    settings = ConnectorSettings.from_extra({"transport_factory": factory})
    with pytest.raises(ValueError, match="transport_factory") as info:
        make_transport(settings, None, 0, True)
    assert why in str(info.value)


def test_the_secret_has_a_name_vllm_accepts_and_the_old_one_still_works(caplog):
    secret = "a secret of twenty-four!"
    new = auth.load_key(environ={"FLAGCX_SIDE_CHANNEL_SECRET": secret})
    assert new is not None and not auth.SECRET_ENV.startswith("VLLM_")
    with caplog.at_level("WARNING", logger="vllm_flagcx"):
        old = auth.load_key(environ={auth.LEGACY_SECRET_ENV: secret})
    assert old == new and "deprecated" in caplog.text and secret not in caplog.text


def test_a_malformed_peer_host_is_an_oserror_every_caller_handles():
    with pytest.raises(ConnectionError, match="cannot connect"):
        client.ask(zmq.Context.instance(), "bad host name", 5600,
                   hs.Release("t"), 1.0)
    assert client.release_transfer("bad host name", 5600, 2, "t", 0.5)  # errors, no raise
