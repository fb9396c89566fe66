"""Issue 13's attacks against the real prefill and decode workers, side channel and
same-host transport over loopback (real vLLM Scheduler): authentication with a shared
secret, writes only into registered memory, a transfer id that grants nothing alone.

Each test names the attack it replays; on the code before this change each one succeeded
(the closing note of issue 13 has the table)."""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import msgspec
import numpy as np
import pytest
import zmq
from testkit import pd_harness as pd
from testkit import vllm_harness as harness

from vllm_flagcx.connector.common import integrity
from vllm_flagcx.layout import bounds, plans
from vllm_flagcx.wire import auth, client
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.params import prefill_leg_params

SECRET = "correct horse battery staple 42"


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return str(path)


def _ask(port: int, message: hs.Message, key: bytes | None = None,
         role: str = "decode") -> hs.Message:
    return client.ask(zmq.Context.instance(), "127.0.0.1", port, message, 5.0, key=key,
                      role=role)


# ---------------------------------------------------------------- pure parts
def test_seal_and_unseal_round_trip_and_refuse_every_mismatch():
    key, other = auth.load_key(environ={auth.SECRET_ENV: SECRET}), auth.load_key(
        environ={auth.SECRET_ENV: SECRET + "!"})
    payload = hs.encode(hs.Release("t"))
    assert auth.unseal(key, auth.seal(key, payload)) == payload
    assert auth.seal(None, payload) == payload
    with pytest.raises(auth.AuthError, match="differs"):
        auth.unseal(other, auth.seal(key, payload))
    with pytest.raises(auth.AuthError, match="sent none"):
        auth.unseal(key, payload)
    with pytest.raises(auth.AuthError, match="has no secret"):
        auth.unseal(None, auth.seal(key, payload))
    tampered = bytearray(auth.seal(key, payload))
    tampered[-1] ^= 1
    with pytest.raises(auth.AuthError, match="differs"):
        auth.unseal(key, bytes(tampered))


def test_secret_sources_and_their_errors_never_show_the_secret(tmp_path):
    assert auth.load_key(environ={}) is None
    short = tmp_path / "short"
    short.write_text("tiny")
    short.chmod(0o600)
    with pytest.raises(auth.AuthError, match=auth.SECRET_FILE_KEY) as err:
        auth.load_key(str(short), environ={})
    assert "tiny" not in str(err.value)
    with pytest.raises(auth.AuthError, match="cannot read"):
        auth.load_key(str(tmp_path / "missing"), environ={})
    (tmp_path / "good").write_text(SECRET)
    with pytest.raises(auth.AuthError, match="chmod 600") as err:  # umask's 644: refused
        auth.load_key(str(tmp_path / "good"), environ={})
    assert SECRET not in str(err.value)
    (tmp_path / "good").chmod(0o600)
    from_file = auth.load_key(str(tmp_path / "good"), environ={auth.SECRET_ENV: "x" * 20})
    assert from_file == auth.load_key(environ={auth.SECRET_ENV: SECRET})


def test_unauthenticated_side_channel_only_on_loopback():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        auth.require_secret_off_loopback(host, None)
    for host in ("0.0.0.0", "::", "10.0.0.5", "*"):
        with pytest.raises(auth.AuthError, match="only served on loopback"):
            auth.require_secret_off_loopback(host, None)
        auth.require_secret_off_loopback(host, b"k" * 32)


def test_check_within_refuses_a_descriptor_outside_registered_memory():
    plan = plans.TransferPlan(np.array([100, 300], dtype=np.uint64),
                              np.array([1000, 1100], dtype=np.uint64),
                              np.array([50, 50], dtype=np.uint64))
    bounds.check_within(plan, [(100, 50), (300, 100)], [(1000, 200)])
    with pytest.raises(plans.PlanError, match="descriptor 1: destination"):
        bounds.check_within(plan, [(100, 50), (300, 100)], [(1000, 120)])
    with pytest.raises(plans.PlanError, match="descriptor 0: source"):
        bounds.check_within(plan, [(120, 400)], [(1000, 200)])
    assert integrity.outside([(1000, 64)], [(1000, 200)]) is None
    assert integrity.outside([(1000, 64), (5, 8)], [(1000, 200)]) == (5, 8)
    assert integrity.outside([(1000, 1 << 20)], [(0, 1 << 40)]) == (1000, 1 << 20)


# ---------------------------------------------------------------- real side channel
def test_pd_with_a_shared_secret_moves_kv_and_a_decode_without_it_recomputes(secret_file):
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense", secret_file=secret_file)
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense",
                          secret_file=secret_file)
    stranger = pd.build_instance("kv_consumer", 1, port + 7, seed=2, model="dense")
    try:
        records = pd.run_pd(p, d, [37, 70])
        assert all(r["d_req"] in pd.finished_ids(d) for r in records.values())
        assert d.workers[0].observations.total("bytes_transferred")[1] > 0
        assert sum(d.workers[0].ledger.counts.values()) == 0
        # A decode without the secret cannot pull: its request fails and is recomputed.
        records = pd.run_prefill(p, [37])
        pd.run_decode(p, stranger, records)
        assert next(iter(records.values()))["d_req"] in pd.finished_ids(stranger)
        assert stranger.workers[0].observations.total("bytes_transferred")[1] == 0
        assert stranger.workers[0].ledger.counts["handshake"] == 1
        assert not pd.busy(p) and not pd.busy(d) and not pd.busy(stranger)
    finally:
        for inst in (p, d, stranger):
            inst.shutdown()


def test_non_loopback_bind_without_a_secret_stops_the_worker_at_startup():
    from vllm_flagcx.connector.worker import WorkerHalf

    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    try:
        worker = p.workers[0]
        exposed = WorkerHalf(dataclasses.replace(worker.settings, bind_host="0.0.0.0",
                                                 side_channel_port=pd.free_port()),
                             worker.transport)
        with pytest.raises(auth.AuthError, match=r"side_channel_bind='0\.0\.0\.0'"):
            exposed.register_regions(worker.regions, serve=True)
    finally:
        p.shutdown()


def _bystander() -> tuple[ctypes.Array, int]:
    buf = (ctypes.c_char * (1 << 16))()
    return buf, ctypes.addressof(buf)


def test_pull_naming_memory_outside_the_receivers_regions_writes_nothing():
    """The arbitrary-write attack: a pull whose sheet keeps decode's incarnation but moves a
    region's base onto a bystander buffer."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 1, port + 5, seed=1, model="dense")
    try:
        records = pd.run_pd(p, d, [37])  # pins decode's sheet at prefill
        assert d.workers[0].observations.total("bytes_transferred")[1] > 0
        buf, address = _bystander()
        records = pd.run_prefill(p, [37])
        tid = next(iter(records))
        pd.step_prefill(p)
        sheet = d.workers[0].sheet
        moved = tuple(msgspec.structs.replace(r, base=address) for r in sheet.regions)
        forged = msgspec.structs.replace(sheet, regions=moved)
        groups = len(sheet.layout.block_sizes)
        reply = _ask(port, hs.PullRequest(tid, forged, ((0,),) * groups))
        assert isinstance(reply, hs.PullReply) and not reply.ok
        assert "other regions" in reply.error
        assert bytes(buf) == bytes(len(buf))  # not one byte written
        pd.settle(p, d)
    finally:
        p.shutdown()
        d.shutdown()


def test_a_transfer_id_alone_does_not_let_another_decode_read_it():
    """The read-another-tenant attack: the routed decode (TP 2) pulls with its rank 0, and
    a second decode instance that learned the id pulls as rank 1."""
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    d = pd.build_instance("kv_consumer", 2, port + 5, seed=1, model="dense",
                          engine_id="decode-a")
    thief = pd.build_instance("kv_consumer", 2, port + 7, seed=2, model="dense",
                              engine_id="decode-b")
    try:
        records = pd.run_prefill(p, [70])
        tid = next(iter(records))
        pd.step_prefill(p)
        groups = len(d.workers[0].sheet.layout.block_sizes)
        blocks = ((1, 2, 3, 4, 5),) * groups
        first = _ask(port, hs.PullRequest(tid, d.workers[0].sheet, blocks))
        assert first.ok and first.num_bytes > 0
        stolen = _ask(port, hs.PullRequest(tid, thief.workers[1].sheet, blocks))
        assert not stolen.ok and "another decode instance" in stolen.error
        assert stolen.num_bytes == 0
        rest = _ask(port, hs.PullRequest(tid, d.workers[1].sheet, blocks))
        assert rest.ok  # the routed decode's own rank still gets its half
    finally:
        for inst in (p, d, thief):
            inst.shutdown()


ROGUE_REPLIES = {
    # an integrity sample at an address decode never registered: decode used to read it
    # (SIGSEGV)
    "foreign_sample": lambda pull: hs.PullReply(pull.transfer_id, True, "", 64, 1,
                                                ((8, 64),), 0),  # address 8: never mapped
    # "ok" for another transfer: decode used to take it as this request's finished load
    "other_transfer": lambda pull: hs.PullReply(pull.transfer_id + "-other", True, "", 64,
                                                1),
    # "ok", bytes written, no integrity sample: decode used to count it as a finished load
    "no_sample": lambda pull: hs.PullReply(pull.transfer_id, True, "", 64, 1),
    # "ok" with nothing written and no sample: decode used to finish the load and serve
    # whatever its blocks held (now its digests are missing: unproven)
    "zero_bytes": lambda pull: hs.PullReply(pull.transfer_id, True, "", 0, 0),
    # more digests than decode has layers (bounded per reply, before any compare)
    "too_many_digests": lambda pull: hs.PullReply(
        pull.transfer_id, True, "", 0, 0,
        digests=tuple((f"model.layers.{i}.self_attn.attn", 0) for i in range(65))),
    # a sheet of another engine than the params name (checked before any pull)
    "other_engine": None,
}
ROGUE_ERRORS = {"foreign_sample": "outside this worker's KV caches",
                "other_transfer": "not this request's", "no_sample": "no integrity sample",
                "other_engine": "that port serves another instance",
                "zero_bytes": "no integrity digest",
                "too_many_digests": "65 integrity digests"}


@pytest.mark.parametrize("reply", sorted(ROGUE_REPLIES))
def test_rogue_prefill_reply_fails_the_request_no_read(reply):
    """A prefill whose pull reply decode must not trust: the request fails (its blocks
    reported for recompute), and nothing is read or counted as received."""
    port = pd.free_port()
    d = pd.build_instance("kv_consumer", 1, port + 5, model="dense")
    honest = pd.build_instance("kv_producer", 1, pd.free_port(), model="dense")
    context = zmq.Context.instance()
    sock = context.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def rogue() -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            message = hs.decode(sock.recv())
            if isinstance(message, hs.HandshakeRequest):
                sheet = honest.workers[0].sheet
                if reply == "other_engine":
                    sheet = msgspec.structs.replace(sheet, engine_id="someone-else")
                answer: hs.Message = hs.HandshakeReply(sheet)
            elif isinstance(message, hs.PullRequest):
                answer = ROGUE_REPLIES[reply](message)
            else:
                answer = hs.Ack("")
            sock.send(hs.encode(answer))

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    try:
        params = {"do_remote_prefill": True, "transfer_id": "rogue-1",
                  "remote_host": "127.0.0.1", "remote_port": port, "remote_tp_size": 1,
                  "remote_engine_id": honest.workers[0].sheet.engine_id,
                  "remote_block_sizes": list(honest.workers[0].sheet.layout.block_sizes)}
        req = harness.make_request(37, max_tokens=2, kv_transfer_params=params)
        d.scheduler.add_request(req)
        pd.settle(honest, d, timeout=30)
        assert req.request_id in pd.finished_ids(d)
        assert sum(d.workers[0].ledger.counts.values()) == 1
        [(*_, error)] = d.workers[0].ledger.recent
        assert ROGUE_ERRORS[reply] in error, error
        assert not d.workers[0].observations.total("bytes_transferred")[1]
    finally:
        stop.set()
        thread.join(timeout=2)
        sock.close()
        d.shutdown()
        honest.shutdown()


def test_second_request_under_a_held_transfer_id_is_not_offered():
    port = pd.free_port()
    p = pd.build_instance("kv_producer", 1, port, model="dense")
    try:
        reqs = [harness.make_request(37, max_tokens=1, kv_transfer_params=
            prefill_leg_params("same-id")) for _ in range(2)]
        for req in reqs:
            p.scheduler.add_request(req)
        for _ in range(20):
            p.step()
        offered = [o.kv_transfer_params for step in p.outputs for eng in step.values()
                   for o in eng.outputs if o.kv_transfer_params]
        assert len(offered) == 1  # the second request's blocks were freed, not held
        assert p.scheduler.connector.scheduler.num_held == 1
    finally:
        p.shutdown()
