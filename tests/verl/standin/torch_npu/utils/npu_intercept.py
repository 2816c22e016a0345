"""Test double shaped like torch_npu's ``utils/npu_intercept.py`` (written for these tests): a
``functools.wraps`` closure named ``wrapper`` that refuses the call when its check says the
input is on the NPU. On this CPU host every call counts as an NPU call, so the wrapper always
raises: a nested tensor that builds proves the wrapper is gone."""

from functools import wraps

import torch


def _create_wrap_func(check_func):
    def decorator(func):
        @wraps(func)
        def wrapper(*args, **kwargs):
            if check_func(*args, **kwargs):
                raise RuntimeError(f"{func} is not supported in npu.")
            return func(*args, **kwargs)

        return wrapper

    return decorator


def _every_call_counts_as_npu(*args, **kwargs):
    return True


def _add_intercept_methods():
    wrap = _create_wrap_func(_every_call_counts_as_npu)
    for name in ("nested_tensor", "as_nested_tensor"):
        setattr(torch.nested, name, wrap(getattr(torch.nested, name)))
