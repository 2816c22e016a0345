"""Test double: the ``torch_npu.utils`` package of the torch_npu stand-in."""
