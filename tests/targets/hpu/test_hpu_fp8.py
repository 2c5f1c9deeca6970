"""The HPU implementation of vLLM's ``lora_shrink_fp8`` / ``lora_expand_fp8`` against a float64 oracle.

The oracle below is written from the kernel's definition, element by element (each code times the scale
its position reads at the call's granularity, summed in float64), and shares nothing with
``conformance.targets.hpu.fp8``. Checked, for every granularity (tensor, channel, block with group sizes
that divide nothing evenly, and no scales without ``use_fp8_w8a8``), both variants (mask, gather) and
the three ways the code decodes fp8 (the CPU's cast, Gaudi 2's byte table, Gaudi 3's fp8 GEMM with a
stand-in that computes what ``torch.ops.hpu.fp8_gemm_v2`` is documented to):

* the values, within float32 accumulation error, including e4m3fn codes above Gaudi 2's 240;
* the shrink leaves rows of slot −1 and the columns past the rank as given, like the target's lora_shrink
  (vLLM's op zeroes the whole buffer, which the buffer the wrapper hands it already is); the expand leaves
  rows of slot −1 and the columns outside its slices bit for bit (NaN and −0.0 included);
* under ``torch.compile(dynamic=False)`` the batches of one bucket compile no new graph, whatever their
  size, adapter mix and scales; a new bucket does (the control).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from graph_counting import CountingBackend, fresh_dynamo

from conformance.reference import LoRAKernelMeta
from conformance.targets.hpu import BucketPolicy, HpuEmulatedGatherTarget, HpuEmulatedTarget, fp8
from conformance.targets.hpu.device import CpuDeviceLayer, HpuDeviceLayer, HpuRuntime
from conformance.targets.hpu.fp8 import Fp8Backend, Fp8Steps, TableDecode, cast_decode

E4M3 = torch.float8_e4m3fn
L, H, R = 3, 40, 12  # slots, hidden, rank: 40 and 12 divide by neither group size below
GROUP_N, GROUP_K = 8, 16
GRANULARITIES = {  # name → (use_fp8_w8a8, per_channel_quant, group_k, group_n)
    "none": (False, False, 0, 0),
    "tensor": (True, False, 0, 0),
    "channel": (True, True, 0, 0),
    "block": (True, False, GROUP_K, GROUP_N),
}
SLOTS = [2, -1, 0, 0, 2, -1, 1]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the oracle ---------------------------------------------------------------------------------


def weight_scale(b_scale: torch.Tensor, granularity: str, slot: int, n: int, k: int) -> float:
    if granularity == "none":
        return 1.0
    if granularity == "tensor":
        return float(b_scale[slot])
    if granularity == "channel":
        return float(b_scale[slot, n])
    return float(b_scale[slot, n // GROUP_N, k // GROUP_K])


def activation_scale(a_scale: torch.Tensor, granularity: str, t: int, k: int) -> float:
    if granularity == "none":
        return 1.0
    if granularity == "tensor":
        return float(a_scale.reshape(-1)[0])
    if granularity == "channel":
        return float(a_scale[t, 0])
    return float(a_scale[t, k // GROUP_K])


def oracle_product(x_q, a_scale, w_q, b_scale, granularity: str, slot: int, t: int, magnitude: bool = False):
    """``Σ_k x[t,k]·σx · W[slot,n,k]·σW`` for every ``n``, in float64, scales looked up per element
    (with ``magnitude``, also ``Σ_k |x·σx|·|W·σW|``, what bounds a float32 sum's error)."""
    rows, cols = w_q.shape[1:]
    x = torch.tensor([float(x_q[t, k].double()) * activation_scale(a_scale, granularity, t, k) for k in range(cols)],
                     dtype=torch.float64)
    w = torch.tensor([[float(w_q[slot, n, k].double()) * weight_scale(b_scale, granularity, slot, n, k) for k in range(cols)]
                      for n in range(rows)], dtype=torch.float64)
    return (w @ x, w.abs() @ x.abs()) if magnitude else w @ x


def float32_sum_bound(terms: int, magnitude: torch.Tensor) -> torch.Tensor:
    """How far a float32 sum of ``terms`` products (each rounded, then summed in any order) may land
    from the exact sum: ``(terms + 1)·u·Σ|products|``, u = 2⁻²⁴, plus the scales' own float32 products."""
    return (terms + 4) * 2.0**-24 * magnitude


# -- the values ---------------------------------------------------------------------------------


def codes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """e4m3fn codes spread over the whole range, a few at ±448 (above Gaudi 2's 240)."""
    values = torch.randn(*shape, generator=gen, dtype=torch.float64) * 120
    values.view(-1)[::7] = 448.0
    values.view(-1)[3::11] = -300.0
    return values.clamp(-448, 448).to(E4M3)


def weight_scales(gen, granularity: str, rows: int, cols: int) -> torch.Tensor:
    shapes = {"none": (L,), "tensor": (L,), "channel": (L, rows), "block": (L, ceil_div(rows, GROUP_N), ceil_div(cols, GROUP_K))}
    return (torch.rand(*shapes[granularity], generator=gen) + 0.5) / 256


def activation_scales(gen, granularity: str, tokens: int, cols: int) -> torch.Tensor:
    shapes = {"none": (1,), "tensor": (1,), "channel": (tokens, 1), "block": (tokens, ceil_div(cols, GROUP_K))}
    return (torch.rand(*shapes[granularity], generator=gen) + 0.5) / 64


def meta(slots: list[int]) -> tuple:
    token_lora_mapping, *rest, no_lora_flag_cpu = LoRAKernelMeta.build(torch.tensor(slots), L).meta_args()
    num_active_loras = L + 1  # what vLLM passes without specialization: only the Triton grid reads it
    return (token_lora_mapping, *rest, no_lora_flag_cpu, num_active_loras)


def emulated_fp8_gemm_v2(a, trans_a, b, trans_b, d, out_dtype, a_scale_inv, b_scale_inv, bias, accumulate):
    """What habana_frameworks' fp8_gemm_v2 computes: the codes' product, times the row and column scales."""
    assert d is None and bias is None and not accumulate
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    a, b = a.double(), b.double()
    product = (a.T if trans_a else a) @ (b.T if trans_b else b)
    for scale in (a_scale_inv, b_scale_inv):
        if scale is not None:
            product = product * scale.double()
    return product.to(out_dtype)


BACKENDS = {
    "cpu-cast": lambda: Fp8Backend("cpu", cast_decode),
    "gaudi2-table": lambda: Fp8Backend("gaudi2", TableDecode(torch.device("cpu"))),
    "gaudi3-native": lambda: Fp8Backend("gaudi3", cast_decode, emulated_fp8_gemm_v2),
}


def target(variant: str, backend: str, layer: CpuDeviceLayer | None = None):
    cls = HpuEmulatedTarget if variant == "mask" else HpuEmulatedGatherTarget
    t = cls(buckets=BucketPolicy())
    if layer is not None:
        t.engine.layer = layer
    t._fp8 = Fp8Steps(t.engine, BACKENDS[backend]())
    return t


def inputs_for(granularity: str, seed: int, slots=SLOTS, widths=(24, 16)):
    gen = torch.Generator().manual_seed(seed)
    tokens = len(slots)
    quantized = granularity != "none"
    x = codes(gen, tokens, H) if quantized else torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    a = [codes(gen, L, R, H) if quantized else (torch.randn(L, R, H, generator=gen) / 8).to(torch.bfloat16) for _ in widths]
    s = codes(gen, len(widths), tokens, R) if quantized else torch.randn(len(widths), tokens, R, generator=gen).to(torch.bfloat16)
    b = [codes(gen, L, n, R) if quantized else (torch.randn(L, n, R, generator=gen) / 4).to(torch.bfloat16) for n in widths]
    return {
        "x": x, "a": a, "s": s, "b": b,
        "a_scale_x": activation_scales(gen, granularity, tokens, H),
        "a_scale_s": activation_scales(gen, granularity, tokens, R),
        "b_scale_a": [weight_scales(gen, granularity, R, H) for _ in widths],
        "b_scale_b": [weight_scales(gen, granularity, n, R) for n in widths],
    }


def fp8_flags(granularity: str) -> dict:
    use, per_channel, group_k, group_n = GRANULARITIES[granularity]
    return {"group_k": group_k, "group_n": group_n, "use_fp8_w8a8": use, "per_channel_quant": per_channel}


# -- shrink ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["mask", "gather"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_shrink_matches_a_float64_dequantize_matmul(granularity, variant, backend):
    v = inputs_for(granularity, seed=1)
    scaling, out_dtype = 0.75, torch.float32
    out = torch.full((2, len(SLOTS), R + 3), float("nan"), dtype=out_dtype)  # NaN where the op must not write
    target(variant, backend).lora_shrink_fp8(v["x"], v["a"], out, *meta(SLOTS), scaling, v["b_scale_a"], v["a_scale_x"],
                                              **fp8_flags(granularity))
    assert out[:, :, R:].isnan().all(), "the columns past the rank are left as given"
    for s in range(2):
        for t, slot in enumerate(SLOTS):
            if slot < 0:
                assert out[s, t].isnan().all(), f"slice {s} row {t} of slot -1 is left as given"
                continue
            exact, magnitude = oracle_product(v["x"], v["a_scale_x"], v["a"][s], v["b_scale_a"][s], granularity, slot, t, True)
            error = (out[s, t, :R].double() - scaling * exact).abs()
            assert (error <= scaling * float32_sum_bound(H, magnitude)).all(), f"slice {s} row {t}: error {error.max()}"


@pytest.mark.parametrize("granularity", ["tensor", "block"])
def test_shrink_rounds_once_into_a_16_bit_output(granularity):
    v = inputs_for(granularity, seed=2)
    out = torch.zeros(2, len(SLOTS), R, dtype=torch.bfloat16)
    target("mask", "cpu-cast").lora_shrink_fp8(v["x"], v["a"], out, *meta(SLOTS), 1.0, v["b_scale_a"], v["a_scale_x"],
                                                **fp8_flags(granularity))
    t, slot = 0, SLOTS[0]
    expected = oracle_product(v["x"], v["a_scale_x"], v["a"][1], v["b_scale_a"][1], granularity, slot, t)
    assert torch.equal(out[1, t], expected.to(torch.bfloat16))


def test_no_lora_flag_leaves_the_output_as_it_was():
    v = inputs_for("tensor", seed=3)
    flagged = list(meta([-1] * len(SLOTS)))
    assert bool(flagged[5].item())  # no_lora_flag_cpu: no token has an adapter
    out = torch.full((2, len(SLOTS), R), 7.0)
    target("mask", "cpu-cast").lora_shrink_fp8(v["x"], v["a"], out, *flagged, 1.0, v["b_scale_a"], v["a_scale_x"],
                                                **fp8_flags("tensor"))
    assert out.eq(7.0).all()


# -- expand ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_inputs", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["mask", "gather"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_expand_matches_a_float64_dequantize_matmul(granularity, variant, backend, add_inputs):
    v = inputs_for(granularity, seed=4)
    widths, offset = (24, 16), 5
    gen = torch.Generator().manual_seed(5)
    out = torch.randn(len(SLOTS), offset + sum(widths) + 3, generator=gen).to(torch.bfloat16)
    out[1] = float("nan")  # a row of slot -1
    out[5, ::2] = -0.0
    before = out.clone()
    target(variant, backend).lora_expand_fp8(v["s"], v["b"], out, *meta(SLOTS), v["b_scale_b"], v["a_scale_s"], offset,
                                              add_inputs, **fp8_flags(granularity))
    slices = [(offset, offset + 24), (offset + 24, offset + 40)]
    outside = torch.ones(out.size(1), dtype=torch.bool)
    outside[offset : offset + sum(widths)] = False
    assert torch.equal(out[:, outside].view(torch.int16), before[:, outside].view(torch.int16)), "columns outside the slices"
    for t, slot in enumerate(SLOTS):
        if slot < 0:
            assert torch.equal(out[t].view(torch.int16), before[t].view(torch.int16)), f"row {t} of slot -1, bit for bit"
            continue
        for s, (first, last) in enumerate(slices):
            delta = oracle_product(v["s"][s], v["a_scale_s"], v["b"][s], v["b_scale_b"][s], granularity, slot, t)
            base = before[t, first:last].double() if add_inputs else 0.0
            # the kernel rounds the delta to the output dtype, then the sum: two bfloat16 roundings
            expected = (base + delta.to(torch.bfloat16).double()).to(torch.bfloat16)
            got = out[t, first:last]
            # one bfloat16 unit of the terms' size: the float32 accumulation may round the delta the other way
            scale = (base.abs() if add_inputs else 0.0) + delta.abs()
            close = (got.double() - expected.double()).abs() <= 2 ** -7 * scale + 1e-30
            assert close.all(), f"row {t} slice {s}: {got} vs {expected}"


# -- decoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_byte_table_decodes_every_code_as_torch_does(dtype):
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    table = TableDecode(torch.device("cpu"))(every.reshape(16, 16)).reshape(-1)
    cast = every.to(torch.float32)
    assert torch.equal(table.isnan(), cast.isnan())
    finite = ~cast.isnan()
    assert torch.equal(table[finite].view(torch.int32), cast[finite].view(torch.int32))  # −0.0 too
    if dtype == torch.float8_e4m3fn:
        assert table[finite].abs().max() == 448.0  # Gaudi 2 would saturate at 240


# -- static shapes -------------------------------------------------------------------------------


def test_one_bucket_compiles_once_whatever_the_batch():
    """Batches of 5–8 tokens (bucket 8) with different adapter mixes and per-token scales: no new graph
    after the first; 9–16 tokens (bucket 16) compile new graphs (the control)."""
    batches = [[2, -1, 0, 0, 2], [1, 1, 1, 1, 1, 1, 1], [-1, -1, 0, 2, 1, 0, 2, -1], [0, -1, -1, -1, -1, -1]]
    counting = CountingBackend()
    with fresh_dynamo():
        t = target("mask", "cpu-cast", CpuDeviceLayer(compile_backend=counting))
        after_first = None
        for granularity in ("channel", "block"):
            for i, slots in enumerate(batches):
                v = inputs_for(granularity, seed=10 + i, slots=slots)
                shrunk = torch.zeros(2, len(slots), R)
                t.lora_shrink_fp8(v["x"], v["a"], shrunk, *meta(slots), 0.5, v["b_scale_a"], v["a_scale_x"], **fp8_flags(granularity))
                out = torch.zeros(len(slots), 40, dtype=torch.bfloat16)
                t.lora_expand_fp8(v["s"], v["b"], out, *meta(slots), v["b_scale_b"], v["a_scale_s"], 0, True, **fp8_flags(granularity))
                if i == 0:
                    after_first = counting.graphs
                    assert after_first > 0, "the core functions ran compiled"
            assert counting.graphs == after_first, f"{granularity}: batches of one bucket recompiled"
        bigger = [0, 1, 2, -1] * 3
        v = inputs_for("block", seed=20, slots=bigger)
        t.lora_shrink_fp8(v["x"], v["a"], torch.zeros(2, len(bigger), R), *meta(bigger), 0.5, v["b_scale_a"], v["a_scale_x"],
                          **fp8_flags("block"))
        assert counting.graphs > after_first, "a new bucket compiles (the counter can move)"


# -- the device: which path each Gaudi gets, and the device layer's hooks ---------------------------


class FakeBridge:
    """What the device layer uses of the bridge (``mark_step``, ``wrap_in_hpu_graph``), recording calls."""

    def __init__(self) -> None:
        self.mark_steps = 0
        self.captured = []
        self.hpu = SimpleNamespace(wrap_in_hpu_graph=self.wrap_in_hpu_graph)

    def mark_step(self) -> None:
        self.mark_steps += 1

    def wrap_in_hpu_graph(self, module, disable_tensor_cache=False):
        self.captured.append(module)
        return module


def lazy_hpu_layer() -> tuple[HpuDeviceLayer, FakeBridge]:
    bridge = FakeBridge()
    runtime = HpuRuntime(bridge, bridge, lazy=True, device=torch.device("cpu"), synchronize=lambda: None)
    return HpuDeviceLayer(runtime, None, hpu_graphs=True), bridge


@pytest.mark.parametrize(("device_type", "has_gemm", "path"), [
    (2, True, "table"), (3, True, "native"), (3, False, "table"), (7, True, "table"),
], ids=["gaudi2", "gaudi3", "gaudi3-without-fp8_gemm_v2", "unknown"])
def test_each_gaudi_gets_its_fp8_path(monkeypatch, device_type, has_gemm, path):
    """Gaudi 3 with the bridge's fp8 GEMM runs it; Gaudi 2, and anything not known to be Gaudi 3, decodes bytes."""
    kinds = SimpleNamespace(synDeviceGaudi2=2, synDeviceGaudi3=3)
    experimental = SimpleNamespace(_get_device_type=lambda: device_type, synDeviceType=kinds)
    monkeypatch.setitem(sys.modules, "habana_frameworks.torch.utils.experimental", experimental)
    monkeypatch.setattr(fp8, "hpu_fp8_gemm", lambda: emulated_fp8_gemm_v2 if has_gemm else None)
    backend = fp8.backend_for(lazy_hpu_layer()[0])
    assert isinstance(backend.decode, TableDecode) == (path == "table")
    assert (backend.gemm is emulated_fp8_gemm_v2) == (path == "native")
    assert fp8.backend_for(CpuDeviceLayer()).decode is cast_decode


def test_fp8_ops_run_through_the_device_layer():
    """Lazy mode with HPU graphs: every core function captured, one mark_step per op call."""
    layer, bridge = lazy_hpu_layer()
    t = target("mask", "gaudi3-native", layer)
    assert len(bridge.captured) == 4  # the dequantize and the native shrink and expand
    v = inputs_for("channel", seed=30)
    t.lora_shrink_fp8(v["x"], v["a"], torch.zeros(2, len(SLOTS), R), *meta(SLOTS), 1.0, v["b_scale_a"], v["a_scale_x"],
                      **fp8_flags("channel"))
    t.lora_expand_fp8(v["s"], v["b"], torch.zeros(len(SLOTS), 40), *meta(SLOTS), v["b_scale_b"], v["a_scale_s"], 0, False,
                      **fp8_flags("channel"))
    assert bridge.mark_steps == 2
