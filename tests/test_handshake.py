"""Handshake: version, layout hash, field-naming rejections, malformed input (hypothesis)."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_flagcx.layout.regions import Region, Section
from vllm_flagcx.wire import handshake as hs
from vllm_flagcx.wire.params import (
    TransferParamsError,
    parse_remote_prefill,
    remote_prefill_params,
)

LAYOUT = hs.LayoutFacts(model="Qwen/Qwen3.6-35B-A3B", dtype="bfloat16",
                        kv_cache_dtype="fp8_e4m3", group_kinds=("full_attention", "mamba"),
                        block_sizes=(528, 528), kernel_block_sizes=(16, 528),
                        page_bytes=(270336, 270336), conv_layout="SD", num_kv_heads=2,
                        cache_format="FLASH_ATTN:stride=0,1,2,3,4:layout=HND")


def _sheet(layout=LAYOUT, **kw):
    args = dict(engine_id="p0", incarnation="i1", tp_size=2, tp_rank=0)
    args.update(kw)
    return hs.make_sheet(layout=layout, **args)


def test_hygon_and_metax_builds_pair():
    # The vLLM version is not part of the sheet: 0.20.0+das and 0.20.2 pair.
    hs.check_compatible(_sheet(engine_id="hygon-0.20.0+das"), _sheet(engine_id="metax-0.20.2"))


def test_tp_sizes_differ_and_still_pair():
    hs.check_compatible(_sheet(tp_size=4), _sheet(tp_size=1))


@pytest.mark.parametrize(("field", "value"), [
    ("kv_cache_dtype", "fp8_e5m2"), ("dtype", "float16"), ("block_sizes", (512, 512)),
    ("model", "other/model"), ("conv_layout", "DS"), ("kernel_block_sizes", (32, 528)),
])
def test_mismatch_names_field_and_both_values(field, value):
    remote = _sheet(msgspec.structs.replace(LAYOUT, **{field: value}), engine_id="peer")
    with pytest.raises(hs.HandshakeError) as err:
        hs.check_compatible(_sheet(), remote)
    text = str(err.value)
    assert field in text and repr(value) in text and repr(getattr(LAYOUT, field)) in text
    hs.check_compatible(_sheet(), remote, skip_hash=True)  # the escape hatch


def test_protocol_version_checked_even_with_escape_hatch():
    old = msgspec.structs.replace(_sheet(), protocol_version=0)
    with pytest.raises(hs.HandshakeError,
                       match=f"protocol_version: local {hs.PROTOCOL_VERSION}, remote 0"):
        hs.check_compatible(_sheet(), old, skip_hash=True)


def test_tampered_hash_detected():
    forged = msgspec.structs.replace(_sheet(), compat_hash="0" * 64)
    with pytest.raises(hs.HandshakeError, match="altered or corrupted"):
        hs.check_compatible(_sheet(), forged)


def test_messages_round_trip():
    sheet = _sheet(regions=(Region("l.kv", "l", 0, "full_attention", 4096, 1024, 8,
                                   1024, (Section("heads", 0, 2, 512, 2),)),))
    for message in (hs.HandshakeRequest(1, 3), hs.HandshakeReply(sheet),
                    hs.HandshakeRefused("nope")):
        assert hs.decode(hs.encode(message)) == message


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_malformed_messages_raise_handshake_error(data):
    try:
        hs.decode(data)
    except hs.HandshakeError as exc:
        assert "malformed handshake message" in str(exc)


GOOD = remote_prefill_params(transfer_id="t-1", host="127.0.0.1", port=5600, tp_size=2,
                             engine_id="p0", block_sizes=(16, 16))


def test_params_round_trip():
    parsed = parse_remote_prefill(GOOD)
    assert (parsed.remote_tp_size, parsed.remote_port, parsed.remote_block_sizes) == (
        2, 5600, (16, 16))


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("remote_port", "5600", "remote_port must be int"),
    ("remote_port", 0, "remote_port=0 is not a TCP port"),
    ("remote_tp_size", True, "remote_tp_size must be int"),
    ("remote_tp_size", 0, "remote_tp_size=0"),
    ("transfer_id", "", "must be non-empty"),
    ("remote_block_sizes", [16, -1], "remote_block_sizes must be a list"),
])
def test_bad_params_name_the_field(key, value, needle):
    with pytest.raises(TransferParamsError, match=needle):
        parse_remote_prefill({**GOOD, key: value})


def test_missing_param_says_how_to_fix():
    bad = dict(GOOD)
    del bad["remote_tp_size"]
    with pytest.raises(TransferParamsError, match="remote_tp_size is missing; forward"):
        parse_remote_prefill(bad)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8),
                                                                          c, max_size=3),
                     max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*sorted(GOOD), "x"]), _json, max_size=8))
def test_arbitrary_params_never_crash_elsewhere(params):
    with contextlib.suppress(TransferParamsError):
        parse_remote_prefill(params)


def test_unknown_cache_format_is_refused_never_guessed():
    unknown = msgspec.structs.replace(LAYOUT, cache_format=hs.UNKNOWN_FORMAT)
    with pytest.raises(hs.HandshakeError, match="cache_format of engine 'p0'"):
        hs.check_compatible(_sheet(), _sheet(unknown))
    with pytest.raises(hs.HandshakeError, match="unknown"):
        hs.check_compatible(_sheet(unknown), _sheet())
    hs.check_compatible(_sheet(unknown), _sheet(unknown), skip_hash=True)  # the escape hatch
