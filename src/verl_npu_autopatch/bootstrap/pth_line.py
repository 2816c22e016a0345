"""The ``verl_npu_autopatch.pth`` line, rendered from ``startup.WATCHED`` and the template below
(``tests/unit/test_pth_line.py`` checks the committed file). After a change:

    PYTHONPATH=src python3 -m verl_npu_autopatch.bootstrap.pth_line > verl_npu_autopatch.pth

``site`` compiles the line at every interpreter start (twice in a venv, cpython#75723), so it is one
short statement that imports nothing (docs/performance.md, (a)): it puts a placeholder for the
start-up observer first on ``sys.meta_path``, until the first watched name.
"""

from verl_npu_autopatch.bootstrap.startup import NAME, PLACEHOLDER, WATCHED

#: The placeholder: a ``types.SimpleNamespace`` (``type(sys.implementation)``, no import) marked
#: with ``PLACEHOLDER``, whose ``find_spec`` is :data:`FIND_SPEC`.
LINE = "import sys; sys.meta_path.insert(0, type(sys.implementation)({marker}=True, find_spec={find_spec}))\n"

#: ``find_spec(n, path, target)``: ``w`` holds the watched names in one string, ``r`` hands back
#: :data:`BODY`'s answer (``exec`` returns ``None``; ``or`` pops it). Every import until the first
#: watched name costs one substring test, ``n in w``; the body checks the exact name. ``path`` and
#: ``target`` by name: a finder wrapping the others passes them so (Cirq's import test), and named
#: parameters cost a call no tuple or dict (``*a``, ``**k``).
FIND_SPEC = "lambda n, path=None, target=None, *, w={watched!r}, r=[]: exec({body!r}) or r.pop() if n in w else None"

#: For a watched name, import the start-up module and let its observer take the placeholder's place
#: and answer; any exception (a stale ``.pth``, a broken install) leaves ``None``: the import goes on.
BODY = """r.append(None)
if n in w.split():
 try: from {module} import take_over as t; r[-1] = t(n, path, target)
 except Exception: pass"""


def render() -> str:
    """The ``.pth`` file's content: :data:`LINE` with the watched names (sorted) and :data:`BODY`."""
    body = BODY.format(module=NAME)
    find_spec = FIND_SPEC.format(watched=" ".join(sorted(WATCHED)), body=body)
    return LINE.format(marker=PLACEHOLDER, find_spec=find_spec)


if __name__ == "__main__":
    print(render(), end="")
