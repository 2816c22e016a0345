"""The ``verl_npu_autopatch.pth`` line, rendered from the start-up module's ``WATCHED`` and the
commented template below (never imported at start-up). ``tests/unit/test_pth_line.py`` checks
that the committed file is :func:`render`'s; after a change to ``WATCHED`` or the template:

    PYTHONPATH=src python3 -m verl_npu_autopatch.bootstrap.pth_line > verl_npu_autopatch.pth

``site`` runs a ``.pth`` line starting with ``import`` as code, compiled at every interpreter
start (twice in a venv, cpython#75723): so the line is one short statement that imports nothing
and defines no function but a lambda (docs/performance.md, (a)). It puts a *placeholder* first on
``sys.meta_path``, standing in for the start-up observer (``startup.Observer``, whose mode is
"placeholder" meanwhile) until the first watched name.
"""

from verl_npu_autopatch.bootstrap.startup import NAME, PLACEHOLDER, WATCHED

#: The line: the placeholder is a ``types.SimpleNamespace`` (``type(sys.implementation)``, no
#: import needed) marked with ``PLACEHOLDER``, whose ``find_spec`` is :data:`FIND_SPEC`.
LINE = "import sys; sys.meta_path.insert(0, type(sys.implementation)({marker}=True, find_spec={find_spec}))\n"

#: The placeholder's ``find_spec(n, *a)`` (``n``: the name looked up; ``a``: path, target), a lambda
#: whose defaults hold its data: ``w``, the watched names in one string, and ``r``, a list through
#: which :data:`BODY` hands back its answer (``exec`` returns ``None``; ``or`` then pops it).
#: The miss path, every import of every process until the first watched name, is one substring
#: test: ``n in w`` (a part of a name, such as ``torch``, runs the body, which checks the exact one).
FIND_SPEC = "lambda n, *a, w={watched!r}, r=[]: exec({body!r}) or r.pop() if n in w else None"

#: What the placeholder runs for a name inside ``w``: for a watched one, import the start-up module
#: (the global import lock is held: ``find_spec``) and let its observer take the placeholder's
#: place and answer. Any exception (a stale ``.pth`` without the package, a broken install)
#: leaves ``None``: the import goes on untouched.
BODY = """r.append(None)
if n in w.split():
 try: from {module} import take_over as t; r[-1] = t(n, *a)
 except Exception: pass"""


def render() -> str:
    """The ``.pth`` file's content: :data:`LINE` with the watched names (sorted) and :data:`BODY`."""
    body = BODY.format(module=NAME)
    find_spec = FIND_SPEC.format(watched=" ".join(sorted(WATCHED)), body=body)
    return LINE.format(marker=PLACEHOLDER, find_spec=find_spec)


if __name__ == "__main__":
    print(render(), end="")
