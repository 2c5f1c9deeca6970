"""Seeded-fault targets that say they run on a Gaudi: what a port converting e4m3fn codes through Gaudi 2's
e4m3 (±240) computes, on the CPU, reporting a Gaudi 2 or a Gaudi 3 through ``describe_device`` as the
suite's fingerprint describes an HPU (``conformance.report.fingerprint``). For device-scoped expectations,
with the entry such a port would need (:func:`gaudi2_entry`)."""

from __future__ import annotations

from fault_targets import Fp8SaturatesAtGaudi2Range


class SaturatingOnGaudi2(Fp8SaturatesAtGaudi2Range):
    name = "fault-fp8-saturates-at-240-on-gaudi2"
    generation, driver = "gaudi2", "1.20.0-ee698fb"

    def describe_device(self) -> dict:
        return {"device": f"hpu: {self.generation.upper()} (emulated on the CPU)", "driver": self.driver,
                "device_generation": self.generation}


class SaturatingOnGaudi3(SaturatingOnGaudi2):
    name = "fault-fp8-saturates-at-240-on-gaudi3"
    generation = "gaudi3"


def gaudi2_entry(expires: str = "2027-06-30") -> str:
    """An expectations entry for such a port: every fp8 operand of the suite holds codes in (240, 448]
    (conformance/cases/fp8_values.py), which Gaudi 2's e4m3 (±240) cannot hold, so it fails every fp8 case."""
    return f"""
[[known_failure]]
id = "gaudi2-e4m3-range"
reason = "Gaudi 2's e4m3 saturates at 240: e4m3fn codes in (240, 448], which every fp8 operand holds, do not survive a cast"
upstream = ["https://github.com/HabanaAI/vllm-hpu-extension/blob/7d97fa2e0742a0c18c3d61f4c5c16a15c5d7bdfa/vllm_hpu_extension/scales.py"]
link = "https://docs.habana.ai/en/latest/PyTorch/Inference_on_PyTorch/Inference_Using_FP8.html"
expires = {expires}
approver = "lora-conformance maintainers"
ops = ["lora_shrink_fp8", "lora_expand_fp8", "fused_moe_lora_fp8"]
kinds = ["numerics"]
devices = {{ generation = ["gaudi2"], driver = ">=1.18,<1.22" }}
"""
