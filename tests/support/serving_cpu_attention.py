"""TEST SUPPORT ONLY: vllm-omni's SDPA diffusion attention backend with a CPU forward (see serving_cpu_platform).

``AttentionImpl.forward`` (``diffusion/attention/backends/abstract.py``) dispatches to a cuda/npu/xpu/hip/musa
method and raises for any other platform; this backend's ``forward`` calls the SDPA implementation's own torch
``scaled_dot_product_attention`` path directly, with the broadcast mask layout the CUDA path uses.
"""
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(self, query, key, value, attn_metadata=None):
        return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls():
        return CpuSDPAImpl
