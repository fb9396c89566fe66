"""The full logical digest on a CUDA device: the torch path equals the numpy reference,
and the one-launch kernel (``transport.cuda_kernel``'s ``vllm_flagcx_digest``) equals the
torch path. Needs CUDA (skipped elsewhere; CI has none and compiles the kernel in
``tests/e2e/test_nvrtc_kernels.py``); on the GPU machine: ``bash benchmarks/gpu_run.sh
digest OUT``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_digest_on_a_device_equals_the_numpy_reference():
    """The torch digest of a GPU cache view (int64 arithmetic wrapping on the device)
    equals the host reference bit for bit; a changed element changes it."""
    from vllm_flagcx.compat import kv_views
    from vllm_flagcx.compat.kv_cache import SpecKind
    from vllm_flagcx.layout import digest

    cache = torch.randn((2, 6, 16, 4, 128), device="cuda").to(torch.bfloat16)
    k, v = kv_views.layer_parts(cache, SpecKind.FULL_ATTENTION, "2BNHD")
    views = {"l": kv_views.LayerView(0, (kv_views.Part("k", k, 0, 4),
                                         kv_views.Part("v", v, 0, 4)))}
    ids = [5, 0, 3]
    got = kv_views.layer_digests(views, [ids], (0, 1), (0, 1), sending=True)["l"]

    def host(t):
        return t[ids].cpu().contiguous().reshape(48, 4, -1).view(torch.uint8).numpy()

    assert got == digest.reference({"k": (host(k), 0), "v": (host(v), 0)}, "l")
    cache.view(torch.int16)[1, 3, 7, 1, 5] ^= 1
    assert kv_views.layer_digests(views, [ids], (0, 1), (0, 1), sending=True)["l"] != got


def test_the_digest_kernel_equals_the_torch_digest_on_the_device():
    """One launch for a request's attention and GDN state (``cuda_kernel``'s digest) gives
    the torch path's digests; a flipped bit in one block changes its layer's."""
    from vllm_flagcx.compat import kv_views
    from vllm_flagcx.compat.kv_cache import SpecKind
    from vllm_flagcx.connector.common import integrity

    cache = torch.randn((2, 9, 16, 4, 128), device="cuda").to(torch.bfloat16)
    k, v = kv_views.layer_parts(cache, SpecKind.FULL_ATTENTION, "2BNHD")
    conv = torch.randn((9, 3, 96), device="cuda").to(torch.bfloat16)
    ssm = torch.randn((9, 4, 32, 32), device="cuda")
    views = {"a": kv_views.LayerView(0, (kv_views.Part("k", k, 0, 4),
                                         kv_views.Part("v", v, 0, 4))),
             "g": kv_views.LayerView(1, kv_views.state_parts(
                 [conv, ssm], None, "SD", (("q", 32, 32), ("k", 32, 32), ("v", 32, 32)), 0,
                 1))}
    ids = [[5, 0, 3, 8], [7]]
    torch_path = kv_views.layer_digests(views, ids, (0, 1), (0, 1), sending=True)
    integrity._KERNEL_CHECKED.clear()
    assert integrity.layer_digests(views, ids, (0, 1), (0, 1), True) == torch_path
    assert integrity._KERNEL_CHECKED[torch.cuda.current_device()] is True
    ssm.view(torch.int32)[7, 2, 3, 4] ^= 1
    changed = integrity.layer_digests(views, ids, (0, 1), (0, 1), True)
    assert changed["a"] == torch_path["a"] and changed["g"] != torch_path["g"]
    assert changed == kv_views.layer_digests(views, ids, (0, 1), (0, 1), sending=True)
