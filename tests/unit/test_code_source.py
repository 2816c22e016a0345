"""``normalized_source`` reads a function's block from its file's lines, as ``inspect.getsource``
does, without inspect's scan of every loaded module: the two readings agree on every function of
a sample of the standard library (decorated, nested, lambdas, async) and on a wrapped function."""

from __future__ import annotations

import argparse
import asyncio.tasks
import dataclasses
import email.message
import functools
import inspect
import json.decoder
import types

from verl_npu_autopatch.authoring.patching import _code_source, normalized_source


def _functions(module: types.ModuleType) -> list[types.FunctionType]:
    found = []
    for value in vars(module).values():
        for item in [value, *(vars(value).values() if isinstance(value, type) else ())]:
            item = getattr(item, "__func__", item)
            if isinstance(item, types.FunctionType) and item.__module__ == module.__name__:
                found.append(item)
    return found


def test_the_block_read_equals_inspects_on_the_standard_library() -> None:
    functions = [
        f for m in (argparse, asyncio.tasks, dataclasses, email.message, json.decoder, inspect) for f in _functions(m)
    ]
    assert len(functions) > 300
    differ = [
        f.__qualname__ for f in functions if _code_source(f.__code__) != "".join(inspect.getsource(f.__code__).split())
    ]
    assert differ == []


def test_a_wrapped_function_reads_as_inspect_reads_it() -> None:
    def original(x):
        return x + 1

    @functools.wraps(original)
    def wrapper(x):
        return original(x) * 2

    decorated = functools.lru_cache(maxsize=None)(original)
    assert normalized_source(wrapper) == "".join(inspect.getsource(wrapper).split()) == "deforiginal(x):returnx+1"
    assert normalized_source(decorated) == normalized_source(original)
    square = lambda v: v * v  # noqa: E731  (a lambda's block is its line)
    assert normalized_source(square) == "".join(inspect.getsource(square).split())
